"""Where the repository's files are, for tests that read them (docs, fixtures, the chart)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
