"""What the index answers: per-worker matches and its own statistics (plain immutable values)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Match:
    """One worker's cached prefix of a query.

    Invariants: ``tokens == blocks * block_size``; ``by_medium`` has the keys "GPU", "CPU"
    and "STORAGE" and counts each matched block the worker really holds once, under the
    fastest tier it holds it in; ``pending`` counts the matched blocks that are only
    placement guesses (``index.placement``); ``sum(by_medium.values()) + pending ==
    blocks``. ``block_size`` is 0 for a worker that never stored a block (its size is not
    known yet).
    """

    blocks: int
    tokens: int
    block_size: int
    by_medium: dict[str, int] = field(default_factory=dict)
    pending: int = 0


@dataclass(frozen=True, slots=True)
class IndexStats:
    """A snapshot of the index's size and of the events it counted instead of applying.

    - ``nodes``: distinct content blocks held by at least one worker.
    - ``holdings``: per worker, per medium, the engine block hashes it holds there (a hash
      stored twice counts once; its reference count is kept separately).
    - ``orphaned_blocks``: stored blocks that could not be placed - their chain's parent hash,
      or for a token-less (offload) store the block's own hash, was unknown for that worker.
    - ``unknown_removals``: removals of a hash (in a medium) the worker did not hold.
    - ``ignored_blocks`` / ``ignored_removals``: blocks stored in / removed from KV-cache
      groups that hold no full prefix (sliding window, mamba, ...), or held elsewhere
      than the publishing worker (a ``locality`` other than "LOCAL").
    - ``hash_conflicts``: a worker re-announced one of its engine hashes for different token
      content; the newer announcement replaced the older one.
    - ``estimated_bytes``: see ``PrefixIndex.stats``.
    """

    nodes: int
    workers: int
    holdings: dict[Hashable, dict[str, int]]
    orphaned_blocks: int
    unknown_removals: int
    ignored_blocks: int
    ignored_removals: int
    hash_conflicts: int
    estimated_bytes: int
