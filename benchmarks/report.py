"""How every benchmark ends: one JSON object on stdout, then the same figures as a table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], table: str, *, json_only: bool = False,
         out_file: Path | None = None) -> None:
    """Print ``result`` as one line of JSON and, unless ``json_only``, ``table`` after a
    blank line; with ``out_file``, also write the JSON there (indented)."""
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    if not json_only:
        print()
        print(table)
