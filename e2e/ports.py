"""Ports for the processes the harness starts.

vLLM must be told its HTTP, KV-event and replay ports on its command line, so the harness
picks ports that are free now; a port taken in between fails that engine's start loudly.
(kvroute's own tests never do this: its servers bind port 0 themselves.)"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
