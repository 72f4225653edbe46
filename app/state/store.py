"""Where saved state lives: one opaque blob, replaced whole.

A store knows nothing of what it holds (``app.state.format`` writes and checks the blob);
it only promises that a reader sees either the previous blob or the new one, never a mix.

- ``DirectoryStore``: a file in a directory, replaced atomically (write a temporary file
  beside it, fsync, rename over, fsync the directory). A crash at any point leaves the
  previous file or the new one.
- ``app.state.valkey.ValkeyStore``: one key in Valkey or Redis (``SET`` replaces it atomically);
  replicas share it, and the last one to save wins.

Stores do blocking work on a worker thread (files) or over the network (Valkey); neither
holds the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Protocol

__all__ = ["DirectoryStore", "StateStore", "StateStoreError"]

STATE_FILE = "kvroute-state.bin"


class StateStoreError(Exception):
    """The store could not be read or written; the message says where and why."""


class StateStore(Protocol):
    #: Where the state goes, for logs and /readyz (never a password).
    where: str

    async def read(self) -> bytes | None:
        """The last blob written, or None when nothing was saved yet."""
        ...

    async def write(self, chunks: list[bytes]) -> None:
        """Replace the blob with the concatenation of ``chunks``."""
        ...

    async def close(self) -> None: ...


class DirectoryStore:
    """The blob as ``kvroute-state.bin`` in a directory (created if missing)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.path = self.directory / STATE_FILE
        self.where = f"directory {self.directory}"

    async def read(self) -> bytes | None:
        return await asyncio.to_thread(self._read)

    async def write(self, chunks: list[bytes]) -> None:
        await asyncio.to_thread(self._write, chunks)

    async def close(self) -> None:
        pass

    def _read(self) -> bytes | None:
        # A process killed mid-write leaves its temporary file; reading comes first in a
        # process's life, before it writes one of its own.
        for stale in self.directory.glob(f".{STATE_FILE}.*.tmp"):
            with contextlib.suppress(OSError):
                stale.unlink()
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateStoreError(f"cannot read {self.path}: {exc.strerror}") from None

    def _write(self, chunks: list[bytes]) -> None:
        temporary = self.path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with temporary.open("wb") as handle:
                for chunk in chunks:
                    handle.write(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.path)
            directory = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as exc:
            with contextlib.suppress(OSError):  # there may be no file, or no directory
                temporary.unlink(missing_ok=True)
            raise StateStoreError(f"cannot write {self.path}: {exc.strerror}") from None
