"""Simulated publishers for benchmarks/fleet_bench.py, in a process of their own (so their
CPU is not kvroute's): `--count` EventPublishers, one in `--holders-every` holding the
prefix `--prefix-blocks` blocks long (token ids 1.., block size 16). Prints one JSON line
(the endpoints), then serves until stdin closes."""

from __future__ import annotations

import argparse
import json
import sys

from kvroute.app.ingest.wire import BlockStored
from kvroute.sim.publisher import EventPublisher

BLOCK = 16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--first", type=int, default=0, help="number of the first publisher")
    parser.add_argument("--holders-every", type=int, default=8)
    parser.add_argument("--prefix-blocks", type=int, default=64)
    args = parser.parse_args()
    publishers = [EventPublisher(dp_rank=None).start() for _ in range(args.count)]
    tokens = list(range(1, args.prefix_blocks * BLOCK + 1))
    for number, pub in enumerate(publishers, start=args.first):
        if number % args.holders_every == 0:
            pub.publish([BlockStored(block_hashes=list(range(1000, 1000 + args.prefix_blocks)),
                                     parent_block_hash=None, token_ids=tokens,
                                     block_size=BLOCK)])
    print(json.dumps([[p.endpoint, p.replay_endpoint] for p in publishers]), flush=True)
    sys.stdin.read()
    for pub in publishers:
        pub.close()


if __name__ == "__main__":
    main()
