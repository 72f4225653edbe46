"""Child processes the harness starts, and the guarantee that it stops them.

Each child runs in its own session, so it leads a process group of its own:
vLLM's API server forks an engine-core process, and stopping the group by the
leader's pid reaches both without touching anything the harness did not start.
Every process started through a :class:`ProcessSet` is stopped by
:meth:`ProcessSet.stop_all`, which the harness calls from ``finally``, from
``atexit`` and (through the SIGTERM/SIGINT handlers installed by
:func:`install_signal_handlers`) when it is interrupted.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


class ManagedProcess:
    """One child process group, logging to a file."""

    def __init__(
        self, name: str, argv: Sequence[str], env: dict[str, str], log_path: Path
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = env
        self.log_path = log_path
        self._popen: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None  # the leader's exit status, once stopped

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen else None

    def start(self) -> None:
        self.returncode = None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== start {self.name}: {' '.join(self.argv)}\n".encode())
            log.flush()
            self._popen = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def exited(self) -> int | None:
        """The exit code once the group leader has exited, else None."""
        return self._popen.poll() if self._popen else None

    def terminate(self) -> None:
        """Ask the whole group to exit (SIGTERM); :meth:`stop` waits for it."""
        if self._popen is not None:
            _signal_group(self._popen.pid, signal.SIGTERM)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after ``grace``."""
        if self._popen is None:
            return
        pgid = self._popen.pid
        _signal_group(pgid, signal.SIGTERM)
        if not self._wait_group_gone(pgid, grace):
            _signal_group(pgid, signal.SIGKILL)
            self._wait_group_gone(pgid, 5.0)
        self.returncode = self._popen.wait(timeout=5.0)
        self._popen = None

    def kill(self) -> None:
        """SIGKILL the whole group at once: an engine crash, not a shutdown."""
        if self._popen is None:
            return
        pgid = self._popen.pid
        _signal_group(pgid, signal.SIGKILL)
        self._wait_group_gone(pgid, 10.0)
        self.returncode = self._popen.wait(timeout=5.0)
        self._popen = None

    def _wait_group_gone(self, pgid: int, timeout: float) -> bool:
        """Poll (reaping the leader) until no process of the group is left; False on timeout."""
        deadline = time.monotonic() + timeout
        while _group_alive(pgid):
            if time.monotonic() >= deadline:
                return False
            assert self._popen is not None
            self._popen.poll()
            time.sleep(0.05)
        return True

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader still counts as a member until it is reaped; reaping is
    # done by the poll() calls in the wait loops above.
    return True


class ProcessSet:
    """Everything the harness started; ``stop_all`` is safe to call repeatedly."""

    def __init__(self) -> None:
        self._procs: list[ManagedProcess] = []
        atexit.register(self.stop_all)

    def start(self, proc: ManagedProcess) -> ManagedProcess:
        self._procs.append(proc)
        proc.start()
        return proc

    def stop_all(self) -> None:
        # Every group gets SIGTERM at once, so the grace periods run in parallel.
        for proc in self._procs:
            proc.terminate()
        deadline = time.monotonic() + 15.0
        for proc in reversed(self._procs):
            try:
                proc.stop(grace=max(0.5, deadline - time.monotonic()))
            except Exception as exc:  # keep stopping the others
                print(f"e2e: could not stop {proc.name} (pid {proc.pid}): {exc}", flush=True)


def install_signal_handlers() -> None:
    """Turn SIGTERM into SystemExit so ``finally`` blocks stop the children."""

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGHUP, _exit)
