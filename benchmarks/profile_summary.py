"""A py-spy raw (collapsed) profile as a short table: the share of samples in each
function's own code, and in a few named frames with everything below them.

Usage: python -m benchmarks.profile_summary PROFILE [--top N] [--frame NAME ...]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--frame", action="append", default=[],
                        help="a function name: share of samples with it on the stack")
    args = parser.parse_args()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in args.profile.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        own[frames[-1].split(" (")[0]] += n
        names = {f.split(" (")[0] for f in frames}
        for wanted in args.frame:
            if any(name.startswith(wanted) for name in names):
                inclusive[wanted] += n
    print(f"{total} samples")
    for name, n in own.most_common(args.top):
        print(f"{100 * n / total:5.1f}%  own  {name}")
    for wanted in args.frame:
        print(f"{100 * inclusive[wanted] / total:5.1f}%  with {wanted} on the stack")


if __name__ == "__main__":
    main()
