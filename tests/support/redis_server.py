"""A real redis-server for the tests (Valkey speaks the same protocol), owned by its test.

The server is started with no persistence, on a unix socket with TCP off (no port to race
for), or on a loopback port found free just before (redis-server cannot report a port-0
bind, so a start that loses the port to another process is retried). Readiness means our
own process answers: the server's INFO must name the pid we started. It is stopped by that
pid, never by name.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from tests.support.waiting import scaled

REDIS_SERVER = "/usr/bin/redis-server"


class ServerFailed(RuntimeError):
    """redis-server exited or never answered; the message has the end of its log."""


class RedisServer:
    """One redis-server process: ``start``, ``stop``, and again ``start`` (same address)."""

    def __init__(self, directory: Path, *, port: int = 0, password: str | None = None,
                 tls: tuple[Path, Path, Path] | None = None) -> None:
        """`tls`: (certificate, key, CA) files; the port then speaks only TLS."""
        self.directory = directory
        self.port = port
        self.password = password
        self.tls = tls
        self.socket_path = directory / "redis.sock"
        self.log_path = directory / "redis.log"
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        """The address as a state_url (without the password)."""
        if self.port:
            return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/{db}"
        return f"unix://{self.socket_path}?db={db}"

    def start(self) -> RedisServer:
        if self.process is not None:
            raise RuntimeError("already running")
        plain_port = 0 if self.tls else self.port
        args = [REDIS_SERVER, "--port", str(plain_port), "--save", "", "--appendonly", "no",
                "--dir", str(self.directory), "--daemonize", "no"]
        if self.tls:
            cert, key, ca = self.tls
            args += ["--tls-port", str(self.port), "--tls-cert-file", str(cert),
                     "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                     "--tls-auth-clients", "no"]
        if self.port:
            args += ["--bind", "127.0.0.1"]
        else:
            args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        if self.password:
            args += ["--requirepass", self.password]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        try:
            self._wait_until_ours()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(scaled(15))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(scaled(15))

    def _wait_until_ours(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + scaled(30)
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerFailed(f"redis-server exited ({self.process.returncode}): "
                                   f"{self._log_tail()}")
            if self._answers_with_our_pid():
                return
            time.sleep(0.05)
        raise ServerFailed(f"redis-server did not answer in time: {self._log_tail()}")

    def _answers_with_our_pid(self) -> bool:
        assert self.process is not None
        if self.port:
            tls = {"ssl": True, "ssl_ca_certs": str(self.tls[2])} if self.tls else {}
            client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                                 socket_timeout=2, socket_connect_timeout=2, **tls)
        elif self.socket_path.exists():
            client = redis.Redis(unix_socket_path=str(self.socket_path),
                                 password=self.password, socket_timeout=2,
                                 socket_connect_timeout=2)
        else:
            return False
        try:
            return int(client.info("server")["process_id"]) == self.process.pid
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-5:])
        return "(no log)"


def free_port() -> int:
    """A loopback port nothing listens on right now (it may be taken before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_on_a_free_port(directory: Path, attempts: int = 5, **options: object) -> RedisServer:
    """A RedisServer on a loopback port, retried on a fresh port if another process took it."""
    failures = []
    for _ in range(attempts):
        server = RedisServer(directory, port=free_port(), **options)  # type: ignore[arg-type]
        try:
            return server.start()
        except ServerFailed as exc:
            failures.append(str(exc))
    raise ServerFailed(f"no free port in {attempts} attempts: {failures}")


def running(server: RedisServer) -> Iterator[RedisServer]:
    """A fixture's body: `server` started, then stopped by its pid."""
    server.start()
    try:
        yield server
    finally:
        server.stop()
