"""A worker's subscription as the rest of kvroute sees it: where it publishes, how its
subscriber is bounded, what state it is in, and the counters its subscriber keeps.

A worker is one routing unit, an instance's data-parallel rank. Its ``WorkerStatus`` is
written only by its ``Subscriber`` (``app.ingest.subscriber``) and read by the service, the
metrics and the saved state; ``WorkerState`` and ``COUNTERS`` are the only spellings of its
states and counters in kvroute.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class WorkerState(StrEnum):
    """Where a worker's subscriber stands (the only spelling of these states in kvroute):
    `live` and `degraded` workers take traffic."""

    CONNECTING = "connecting"  # no connection yet, or reconnecting: holds nothing
    REPLAYING = "replaying"  # rebuilding from the publisher's buffer
    LIVE = "live"  # applying the live stream; its entries are exact
    DEGRADED = "degraded"  # live, but history was lost: its entries may under-report
    DOWN = "down"  # disconnected or given up: holds nothing

    @property
    def serving(self) -> bool:
        """Whether answers may include a worker in this state."""
        return self in SERVING


SERVING = frozenset({WorkerState.LIVE, WorkerState.DEGRADED})

WorkerKey = tuple[str, int]  # (instance id, data-parallel rank)

#: Every counter a subscriber keeps, declared once: the ``WorkerStatus`` field, and the
#: Prometheus counter (name, help) that /metrics exports it as, per worker.
COUNTERS: dict[str, tuple[str, str]] = {
    "batches": ("kvroute_batches", "event batches applied, garbage included"),
    "events": ("kvroute_events", "KV events applied to the index"),
    "blocks": ("kvroute_blocks", "blocks named by applied events"),
    "gaps": ("kvroute_sequence_gaps", "sequence gaps seen on the live stream"),
    "replays": ("kvroute_replays", "replay requests sent to the replay endpoint"),
    "replay_failures": ("kvroute_replay_failures",
                        "replay requests that got no complete answer"),
    "malformed": ("kvroute_malformed_frames", "frames or events that could not be decoded"),
    "unknown": ("kvroute_unknown_events", "events of a type kvroute does not know, skipped"),
    "duplicates": ("kvroute_duplicate_batches",
                   "live batches a replay had already applied, skipped"),
    "degraded_count": ("kvroute_degraded",
                       "times the worker turned degraded: history lost or a store skipped"),
    "restarts": ("kvroute_engine_restarts", "engine restarts detected (sequence went back)"),
    "disconnects": ("kvroute_disconnects", "connections to the publisher lost"),
    "rank_mismatches": ("kvroute_rank_mismatches",
                        "batches whose payload named another data-parallel rank"),
    "oversized_events": ("kvroute_oversized_events",
                         "BlockStored events over max_blocks_per_event, skipped"),
    "over_capacity": ("kvroute_over_capacity_events",
                      "BlockStored events that would take the worker past "
                      "max_blocks_per_worker blocks, skipped"),
    "unreceivable": ("kvroute_unreceivable_batches",
                     "replayed batches lost with their connection (a frame over "
                     "max_message_bytes drops it), skipped after clearing the worker"),
    "restored_blocks": ("kvroute_restored_blocks",
                        "saved blocks restored exactly (the replay continued the saved seq)"),
    "restored_unconfirmed": ("kvroute_restored_unconfirmed_blocks",
                             "saved blocks restored unconfirmed (no replay reached back)"),
}


@dataclass(frozen=True, slots=True)
class WorkerEndpoint:
    """Where one routing unit (an instance's data-parallel rank) publishes."""

    instance_id: str
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    @property
    def worker(self) -> WorkerKey:
        return (self.instance_id, self.dp_rank)


@dataclass(slots=True)
class WorkerStatus:
    """A worker's subscriber: its state, the last sequence number applied, and counters."""

    state: WorkerState = WorkerState.CONNECTING
    last_seq: int | None = None
    batches: int = 0
    events: int = 0
    blocks: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    malformed: int = 0
    unknown: int = 0
    duplicates: int = 0
    degraded_count: int = 0
    restarts: int = 0
    disconnects: int = 0
    rank_mismatches: int = 0
    oversized_events: int = 0
    over_capacity: int = 0
    unreceivable: int = 0
    restored_blocks: int = 0
    restored_unconfirmed: int = 0
    last_event_time: float | None = None
    last_error: str | None = None

    @property
    def serving(self) -> bool:
        """Whether answers may include this worker (it is connected and its state is known)."""
        return self.state.serving

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


class SubscriberHooks:
    """Override to follow state changes; called on the event loop, must not block."""

    def state_changed(self, worker: WorkerKey, state: WorkerState) -> None:
        pass


@dataclass(slots=True)
class SubscriberOptions:
    replay_timeout: float = 2.0     # seconds to wait for each replay reply frame
    replay_retries: int = 3         # attempts per replay request
    # Seconds one attempt may take in all (an answer trickling in slower than that is
    # asked again, and after the last attempt given up: the worker goes on degraded).
    replay_deadline: float = 30.0
    retry_backoff: float = 0.1      # first retry delay, doubled per attempt
    reconnect_ivl_ms: int = 100     # ZMQ reconnect interval, doubled by ZMQ up to the max
    reconnect_ivl_max_ms: int = 5_000
    idle_check: float = 5.0         # quiet live stream: look for dropped tail batches
    # Events decoded or applied between two yields to the loop. (The compiled drain of live
    # batches looks at the turn's clock and for a waiting request before each batch, and
    # yields only when the turn is over or a request waits: this and slice_blocks bound each
    # batch it applies, not their sum: app/ingest/_live_drain.pyx.)
    chunk_events: int = 256
    # Blocks of index work between two yields to the loop (a block of more than
    # wire.SLICE_TOKENS_PER_BLOCK tokens counts as one per that many): a short piece of
    # PrefixIndex work. An HTTP answer takes 6 to 10 turns of the loop, and a busy
    # subscriber may take one slice in each: so a flood adds a few slices' work to an answer, where
    # one huge store applied whole would hold the loop for the whole store.
    slice_blocks: int = 1024
    # Live messages ZMQ may hold for kvroute while the subscriber is busy (a replay, a big
    # batch). Bounded so that a publisher cannot grow kvroute's memory: at most rcvhwm
    # messages of at most max_message_bytes each (1 GiB at the defaults, for a publisher
    # that sends nothing but maximum-size frames; real batches are KBs). Nothing is lost
    # by a bounded queue: when it is full ZMQ stops reading the connection, so the backlog
    # waits in the publisher's send queue (vLLM's holds 100,000 messages), and what the
    # publisher drops past that becomes sequence gaps, which replay recovers. Not smaller:
    # ZMQ's reader hands credit back to its I/O thread every rcvhwm/2 messages, a wake-up
    # of that thread each time, so a smaller bound wakes it more often, at a cost in CPU
    # per block applied.
    rcvhwm: int = 64
    # Bounds against a hostile or broken publisher (Settings' max_event_message_bytes,
    # max_blocks_per_event, max_blocks_per_worker).
    max_message_bytes: int = 16 * 1024 * 1024
    max_blocks_per_event: int = 65_536
    max_blocks_per_worker: int = 4_194_304
    max_hole_retries: int = 5       # re-asks for holes inside replays, per gap
    # Saved holdings no replay confirmed count like placement guesses this long (seconds).
    unconfirmed_ttl: float = 600.0
