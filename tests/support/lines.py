"""Reading a child process's output while it runs."""

from __future__ import annotations

import re
import threading

from tests.support.waiting import scaled

__all__ = ["Lines"]


class Lines:
    """Collects a child's stream line by line on a thread, so a test can wait for one."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def find(self, pattern: str) -> re.Match[str] | None:
        return next((m for line in list(self.lines) if (m := re.search(pattern, line))), None)

    def text(self) -> str:
        self._thread.join(scaled(10))
        return "".join(self.lines)
