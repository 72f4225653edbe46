"""Route request decoding: what reading a `POST /v1/route` body costs before any routing.

Every body is decoded by the service's own decoder (`route_request_decoder`: the typed
msgspec struct the endpoint decodes with, its constraints and the settings' limits
included) and, in the same run and interleaved with it, by the floor: a msgspec decoder
of a struct with the same fields and no constraint at all. The ratio floor / service says
what the checks cost; wall-clock and CPU time are both reported (CPU time leaves out the
time other processes of a shared machine held the core).

Bodies: token ids (1k, 8k, 32k and 128k tokens, ids below 2**17 as a real vocabulary's),
block hashes (512 and 8k unsigned 64-bit ints, and 512 hex strings), a 64k-character text
prompt and a 16-message chat.

Usage: python -m benchmarks.route_bench [--quick] [--json-only]
Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvroute.app.config import Settings
from kvroute.app.service import route_request_decoder


class FloorMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class FloorRequest(msgspec.Struct):
    """The route request's fields with no constraint: the cheapest typed decode."""

    token_ids: list[int] | None = None
    block_hashes: list[int | str] | None = None
    prompt: str | None = None
    messages: list[FloorMessage] | None = None
    model: str | None = None
    lora_name: str | None = None
    candidates: list[str] | None = None
    probe: bool = False


_floor = msgspec.json.Decoder(FloorRequest)


def bodies(rng: random.Random) -> dict[str, bytes]:
    def encode(payload: dict[str, Any]) -> bytes:
        return msgspec.json.encode({**payload, "model": "llama", "probe": True})

    chat = [{"role": "user" if i % 2 else "assistant", "content": "".join(
        rng.choice("abcdefgh ") for _ in range(2000))} for i in range(16)]
    return {
        "token_ids 1k": encode({"token_ids": [rng.randrange(2**17) for _ in range(1024)]}),
        "token_ids 8k": encode({"token_ids": [rng.randrange(2**17) for _ in range(8192)]}),
        "token_ids 32k": encode({"token_ids": [rng.randrange(2**17) for _ in range(32768)]}),
        "token_ids 128k": encode({"token_ids": [rng.randrange(2**17) for _ in range(131072)]}),
        "block_hashes 512": encode({"block_hashes": [rng.randrange(2**64) for _ in range(512)]}),
        "block_hashes 8k": encode({"block_hashes": [rng.randrange(2**64) for _ in range(8192)]}),
        "hex hashes 512": encode({"block_hashes": [f"{rng.randrange(2**64):016x}"
                                                   for _ in range(512)]}),
        "prompt 64k chars": encode({"prompt": "".join(rng.choice("abcdefgh ")
                                                      for _ in range(65536))}),
        "messages 16 x 2k": encode({"messages": chat}),
    }


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed_us(runs: Sequence[Callable[[], Any]], repeats: int
             ) -> list[tuple[list[float], list[float]]]:
    """Wall-clock and CPU-time samples (microseconds) of each of `runs`, interleaved so that
    every run and its floor see the same machine."""
    samples: list[tuple[list[float], list[float]]] = [([], []) for _ in runs]
    for _ in range(repeats):
        for run, (wall, cpu) in zip(runs, samples, strict=True):
            cpu_start = time.process_time_ns()
            start = time.perf_counter_ns()
            run()
            wall.append((time.perf_counter_ns() - start) / 1e3)
            cpu.append((time.process_time_ns() - cpu_start) / 1e3)
    return samples


def bench_decode(quick: bool) -> list[dict[str, Any]]:
    repeats = 60 if quick else 300
    decode = route_request_decoder(Settings())  # the default limits, as POST /v1/route
    rows = []
    for name, body in bodies(random.Random(21)).items():
        decode(body)  # warm: msgspec builds its type info on first use
        _floor.decode(body)
        (wall, cpu), (floor_wall, floor_cpu) = timed_us(
            [lambda body=body: decode(body), lambda body=body: _floor.decode(body)], repeats)
        rows.append({
            "body": name,
            "bytes": len(body),
            "service_p50_us": statistics.median(wall),
            "service_p99_us": percentile(wall, 0.99),
            "service_cpu_p50_us": statistics.median(cpu),
            "floor_p50_us": statistics.median(floor_wall),
            "floor_cpu_p50_us": statistics.median(floor_cpu),
            "floor_vs_service_cpu": statistics.median(floor_cpu) / statistics.median(cpu),
        })
    return rows


def table(result: dict[str, Any]) -> str:
    lines = ["route request decode (floor: the same fields, no constraints; microseconds)",
             f"  {'body':<18} {'bytes':>8} {'p50':>8} {'p99':>8} {'cpu p50':>8} "
             f"{'floor p50':>9} {'floor cpu':>9} {'floor/service':>13}"]
    for row in result["decode"]:
        lines.append(
            f"  {row['body']:<18} {row['bytes']:>8} {row['service_p50_us']:>8.1f} "
            f"{row['service_p99_us']:>8.1f} {row['service_cpu_p50_us']:>8.1f} "
            f"{row['floor_p50_us']:>9.1f} {row['floor_cpu_p50_us']:>9.1f} "
            f"{row['floor_vs_service_cpu']:>13.0%}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a few seconds)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "route",
        "quick": args.quick,
        "python": sys.version.split()[0],
        "msgspec": msgspec.__version__,
        "decode": bench_decode(args.quick),
    }
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    if not args.json_only:
        print()
        print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
