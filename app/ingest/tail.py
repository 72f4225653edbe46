"""`kvroute tail`: print a vLLM KV-event stream readably, for debugging a deployment.

It shows every batch (seq, time, data-parallel rank, one line per event), reports gaps and
fills them from the replay endpoint when one is given, reports seq going backwards (an engine
restart), and never stops on a bad frame. Ctrl-C prints a summary and exits 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from typing import Any, TextIO

import zmq

from kvroute.app.ingest.sequence import Kind, Verdict, classify
from kvroute.app.ingest.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
    decode_batch,
    decode_replay_frame,
    decode_seq,
    encode_seq,
)

_POLL_MS = 100
_REPLAY_TIMEOUT_MS = 2_000


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "tail", help="print a vLLM KV-event stream readably",
        description="Subscribe to one vLLM KV-event publisher and print each batch.")
    parser.add_argument("endpoint", help="the publisher, e.g. tcp://10.0.0.5:5557")
    parser.add_argument("--replay", metavar="ENDPOINT",
                        help="the replay endpoint, e.g. tcp://10.0.0.5:5558: fills gaps")
    parser.add_argument("--topic", default="", help="topic prefix to subscribe to (default all)")
    parser.add_argument("--from-start", action="store_true",
                        help="first print everything the publisher still buffers (needs --replay)")
    parser.add_argument("--max-batches", type=int, default=None, metavar="N",
                        help="exit after printing N batches")
    parser.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                        help="exit after this many seconds")
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.from_start and not args.replay:
        print("kvroute tail: --from-start needs --replay", file=sys.stderr)
        return 2
    if not args.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        print(f"kvroute tail: {args.endpoint!r} is not a ZMQ endpoint (tcp://HOST:PORT)",
              file=sys.stderr)
        return 2
    tail = Tail(args.endpoint, args.replay, args.topic, out=sys.stdout)
    try:
        tail.follow(from_start=args.from_start, max_batches=args.max_batches,
                    duration=args.duration)
        tail.summary()
    except KeyboardInterrupt:
        tail.summary()
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python from complaining
        # again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        tail.close()
    return 0


class Tail:
    def __init__(self, endpoint: str, replay: str | None, topic: str, out: TextIO) -> None:
        self.endpoint = endpoint
        self.replay = replay
        self.out = out
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.last: int | None = None       # last seq printed
        self.last_live: int | None = None  # last seq seen on the live stream
        self.batches = self.gaps = self.malformed = self.restarts = 0

    def close(self) -> None:
        self.sub.close(0)

    def say(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def follow(self, *, from_start: bool, max_batches: int | None,
               duration: float | None) -> None:
        self.say(f"# subscribed to {self.endpoint}" + (f", replay {self.replay}"
                                                       if self.replay else ""))
        deadline = None if duration is None else time.monotonic() + duration
        self.max_batches = max_batches
        if from_start:
            self.fill(0)
        while not self.done() and (deadline is None or time.monotonic() < deadline):
            if self.sub.poll(_POLL_MS):
                self.on_live(self.sub.recv_multipart())

    def done(self) -> bool:
        return self.max_batches is not None and self.batches >= self.max_batches

    def on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.malformed += 1
            self.say(f"! malformed message: {len(frames)} frames, expected 3")
            return
        try:
            seq = decode_seq(frames[1])
        except WireError as exc:
            self.malformed += 1
            self.say(f"! malformed message: {exc}")
            return
        previous_live, self.last_live = self.last_live, seq
        verdict = self.verdict_for(seq, last_live=previous_live)
        if verdict.kind is Kind.RESTART:
            self.restarts += 1
            self.say(f"! seq went back from {previous_live} to {seq}: the engine restarted")
            self.last = None
        elif verdict.kind is Kind.DUPLICATE:
            return  # already printed from a replay
        elif verdict.kind is Kind.GAP:
            missing = verdict.missing
            self.gaps += 1
            self.say(f"! gap: seq {missing[0]}..{missing[-1]} missing")
            if self.replay:
                self.fill(missing[0])
            if self.verdict_for(seq).kind is Kind.DUPLICATE:
                return  # the replay printed it
        self.show(seq, frames[2], replayed=False)

    def verdict_for(self, seq: int, *, last_live: int | None = None) -> Verdict:
        # Not from_zero: tail joins a stream midway, and after a restart it prints the new
        # engine's stream from wherever it is rather than calling the start of it a gap.
        return classify(seq, last_applied=self.last, last_live=last_live, from_zero=False)

    def fill(self, start: int) -> None:
        """Print what the replay endpoint has from ``start`` on; report what it lacks."""
        assert self.replay is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay)
            dealer.send_multipart([b"", encode_seq(start)])
            first = True
            while not self.done():
                if not dealer.poll(_REPLAY_TIMEOUT_MS):
                    self.say(f"! replay from {self.replay} timed out")
                    return
                try:
                    reply = decode_replay_frame(dealer.recv_multipart())
                except WireError as exc:
                    self.malformed += 1
                    self.say(f"! malformed replay reply: {exc}")
                    return
                if reply.seq is None:
                    return
                if first and reply.seq > start:
                    self.say(f"! replay starts at seq {reply.seq}: {start}..{reply.seq - 1} "
                             "are no longer buffered")
                first = False
                if self.verdict_for(reply.seq).kind is Kind.DUPLICATE:
                    continue
                self.show(reply.seq, reply.payload, replayed=True)
        finally:
            dealer.close(0)

    def show(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        self.last = seq
        self.batches += 1
        tag = " (replayed)" if replayed else ""
        try:
            batch = decode_batch(payload)
        except WireError as exc:
            self.malformed += 1
            self.say(f"seq {seq}{tag}: ! undecodable payload ({exc})")
            return
        self.say(describe_batch(seq, batch) + tag)
        for event in batch.events:
            self.say("  " + describe_event(event))
        if batch.malformed or batch.unknown:
            self.malformed += batch.malformed
            self.say(f"  ! {batch.malformed} malformed and {batch.unknown} unknown events skipped")

    def summary(self) -> None:
        self.say(f"# {self.batches} batches, {self.gaps} gaps, {self.restarts} restarts, "
                 f"{self.malformed} malformed")


def describe_batch(seq: int, batch: EventBatch) -> str:
    try:
        when = dt.datetime.fromtimestamp(batch.ts, dt.UTC).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        when = repr(batch.ts)
    rank = "-" if batch.data_parallel_rank is None else str(batch.data_parallel_rank)
    return f"seq {seq}  ts {when}  rank {rank}  {len(batch.events)} events"


def hash_hex(value: int | bytes | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, bytes):
        text = value.hex()
        return text if len(text) <= 16 else text[:16] + "…"
    return f"{value & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def describe_event(event: Any) -> str:
    if isinstance(event, BlockStored):
        n = len(event.block_hashes)
        parts = [f"BlockStored      {n:3d} blocks", _span(event.block_hashes),
                 f"parent {hash_hex(event.parent_block_hash)}", f"medium {event.medium or 'GPU'}",
                 f"tokens {len(event.token_ids)} (bs {event.block_size})"]
        if event.lora_name is not None or event.lora_id is not None:
            parts.append(f"lora {event.lora_name or event.lora_id}")
        if event.group_idx or event.kv_cache_spec_kind not in (None, "full_attention"):
            parts.append(f"group {event.group_idx or 0} {event.kv_cache_spec_kind or ''}".strip())
        if event.locality is not None:
            parts.append(f"locality {event.locality}")
        return "  ".join(parts)
    if isinstance(event, BlockRemoved):
        n = len(event.block_hashes)
        parts = [f"BlockRemoved     {n:3d} blocks", _span(event.block_hashes),
                 f"medium {event.medium or 'GPU'}"]
        if event.group_idx:
            parts.append(f"group {event.group_idx}")
        return "  ".join(parts)
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared"
    return f"? {event!r}"


def _span(hashes: list[int | bytes]) -> str:
    if not hashes:
        return "(none)"
    if len(hashes) == 1:
        return f"{hash_hex(hashes[0])}"
    return f"{hash_hex(hashes[0])}..{hash_hex(hashes[-1])}"
