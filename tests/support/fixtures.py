"""The captured vLLM 0.32.0 session in tests/fixtures/ (see the README there)."""

from __future__ import annotations

import base64
import json

from tests.support.paths import FIXTURES

VLLM_SESSION = FIXTURES / "vllm-0.32.0-cpu-session.jsonl"
END_SEQ = b"\xff" * 8


def session_frames() -> list[tuple[str, list[bytes]]]:
    """Every captured message in order: (kind, frames), kind "live" or "replay"."""
    records = (json.loads(line) for line in VLLM_SESSION.read_text().splitlines())
    return [(r["kind"], [base64.b64decode(f) for f in r["frames"]]) for r in records]


def live_payloads() -> dict[int, bytes]:
    """The live stream's payloads by seq."""
    return {int.from_bytes(frames[1], "big"): frames[2]
            for kind, frames in session_frames() if kind == "live"}


def replay_payloads() -> dict[int, bytes]:
    """The replay answer's payloads by seq (the end marker left out)."""
    return {int.from_bytes(frames[2], "big"): frames[3]
            for kind, frames in session_frames() if kind == "replay" and frames[2] != END_SEQ}
