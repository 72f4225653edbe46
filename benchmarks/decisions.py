"""Read a decision log (``GET /v1/decisions``, saved by ``benchmarks.real_hitrate`` as
``decisions-N.json`` beside each kvroute run's log): where each prefix went, and every
decision that sent a prefix to another worker than its previous one, with what was weighed.

Usage: .venv/bin/python -m benchmarks.decisions FILE [FILE ...]

stdout: one JSON object per file (prefixes, moves, requests per worker), then the moves as
lines a person reads: time, prefix key, from -> to, the cached tokens the engine reported
(proxied requests), and each weighed worker's matched tokens and cost terms.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def summarize(decisions: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """(figures, one line per move) of one log's decisions, oldest first."""
    where: dict[str, Counter[str]] = {}
    previous: dict[str, str] = {}
    lines = []
    for d in decisions:
        prefix, chosen = d["prefix"], d["chosen"]["instance"]
        where.setdefault(prefix, Counter())[chosen] += 1
        before = previous.get(prefix)
        if before is not None and before != chosen:
            weighed = " | ".join(
                f"{s['instance']} matched {s['matched_tokens']} cost {s['cost']:.0f} = "
                f"prefill {s['prefill']:.0f} + copy {s['copy']:.0f} + crowding "
                f"{s['crowding']:.0f} + queue {s['queue']:.0f} (in flight {s['inflight']}, "
                f"answered {s['answered']}, queued prefill {s['queued_prefill']})"
                for s in d["scores"])
            lines.append(f"t={d['at']:.2f}s #{d['id']} prefix {prefix[:8]} {before} -> "
                         f"{chosen} cached {d['cached_tokens']}: {weighed}")
        previous[prefix] = chosen
    figures = {"decisions": len(decisions), "moves": len(lines),
               "per_worker": dict(Counter(d["chosen"]["instance"] for d in decisions)),
               "prefixes": {p[:8]: dict(c) for p, c in where.items()}}
    return figures, lines


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    for path in paths:
        try:
            decisions = json.loads(path.read_text())["decisions"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"{path}: not a decision log ({type(exc).__name__}: {exc})", file=sys.stderr)
            return 1
        figures, lines = summarize(decisions)
        print(json.dumps({"file": str(path), **figures}))
        for line in lines:
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
