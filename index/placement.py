"""Placement guesses: blocks a worker is about to hold because a prompt was just routed to it.

vLLM announces a prompt's blocks only after the step that computed them, so for
one step (plus transport) the index cannot know where a new prefix is being
built. A burst of requests that share a new prefix would all see "nobody holds
it" and spread over the fleet, each instance computing the same prefix. A guess
closes that window: when kvroute routes a prompt to a worker, it records that
the worker will soon hold the prompt's full blocks, for a short time to live.

Invariants:
- A guess names content keys (`index.keys`), so it matches exactly the queries
  the real blocks would match, at the worker's block size and LoRA.
- A guess is placed as a chain from the root. A key guessed for a worker stops
  being a guess when the worker really stores it (`confirm`): from then on only
  real events decide, so a later eviction is seen at once. A worker's extent for
  a query therefore walks keys that are guessed *or* really held, and stops at the
  first that is neither.
- A guess is never renewed by another guess: placing a key that is already guessed
  keeps the first guess's expiry. Routing answers that follow a guess would otherwise
  keep it alive forever; only the worker's real events (or a fresh guess after the old
  one ran out) say anything new.
- A guess that reaches its expiry is removed entirely; after `expire(now)`
  nothing of an expired guess remains.
- Time is passed in by the caller; this module never reads a clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Hashable, Sequence

from sortedcontainers import SortedList
from xxhash import xxh3_128_digest

from kvroute.index.keys import TOKEN_BYTES, root_key, token_bytes

__all__ = ["Placements", "chain_keys"]

_NO_KEYS: frozenset[bytes] = frozenset()


def chain_keys(token_ids: Sequence[int] | bytes, block_size: int,
               lora_name: str | None = None, *, parent: bytes | None = None) -> list[bytes]:
    """The content keys of every full block of a token sequence (or its uint32 bytes),
    first block first, hanging off `parent` (default: the root of its domain)."""
    tokens = token_ids if isinstance(token_ids, bytes) else token_bytes(token_ids)
    step = block_size * TOKEN_BYTES
    if parent is None:
        parent = root_key(block_size, lora_name)
    keys = []
    for start in range(0, len(tokens) - len(tokens) % step, step):
        parent = xxh3_128_digest(parent + tokens[start:start + step])
        keys.append(parent)
    return keys


class Placements:
    """Per worker, the keys it is expected to hold, each until an expiry time."""

    __slots__ = ("_expiry", "_guessed", "_order")

    def __init__(self) -> None:
        # worker -> key -> expiry of the latest guess naming that key
        self._guessed: dict[Hashable, dict[bytes, float]] = {}
        # (expiry, order, worker, keys): the guesses in the order they run out
        self._expiry: SortedList = SortedList()
        self._order = itertools.count()

    def __len__(self) -> int:
        """Keys currently guessed, over all workers."""
        return sum(len(keys) for keys in self._guessed.values())

    def __bool__(self) -> bool:
        return bool(self._guessed)

    def place(self, worker: Hashable, keys: Sequence[bytes], expires: float) -> None:
        """Guess that `worker` will hold `keys` (a chain continuing what it holds) until
        `expires`; keys it is guessed to hold already keep their expiry."""
        held = self._guessed.get(worker, {})
        new = [key for key in keys if key not in held]
        if not new:
            return
        self._guessed[worker] = held
        for key in new:
            held[key] = expires
        self._expiry.add((expires, next(self._order), worker, tuple(new)))

    def confirm(self, worker: Hashable, keys: Sequence[bytes]) -> None:
        """The worker really stored `keys`: they are no longer guesses."""
        held = self._guessed.get(worker)
        if held is None:
            return
        for key in keys:
            held.pop(key, None)
        if not held:
            del self._guessed[worker]

    def withdraw(self, worker: Hashable, keys: Sequence[bytes], expires: float) -> int:
        """Take back the guess that placed `keys` on `worker` with expiry `expires` (the
        request went elsewhere). Keys another guess placed (another expiry), or that the
        worker really stored meanwhile, stay. Returns the number of keys taken back."""
        held = self._guessed.get(worker)
        if held is None:
            return 0
        taken = 0
        for key in keys:
            if held.get(key) == expires:
                del held[key]
                taken += 1
        if not held:
            del self._guessed[worker]
        return taken

    def forget(self, worker: Hashable) -> None:
        """Drop every guess for a worker (cleared, dropped, or gone down)."""
        self._guessed.pop(worker, None)

    def expire(self, now: float) -> None:
        """Remove every guess whose expiry is at or before `now`."""
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            expires, _, worker, keys = expiry.pop(0)
            held = self._guessed.get(worker)
            if held is None:
                continue
            for key in keys:
                # Confirmed and guessed anew since: that later guess has its own expiry.
                if held.get(key) == expires:
                    del held[key]
            if not held:
                del self._guessed[worker]

    def workers(self) -> list[Hashable]:
        """The workers holding at least one guess (O(those workers))."""
        return list(self._guessed)

    def has(self, worker: Hashable) -> bool:
        return worker in self._guessed

    def guessed(self, worker: Hashable) -> Container[bytes]:
        """The keys guessed for `worker` now, for the caller to look in (never to change),
        as `extent` does: the compiled index's own extent reads them."""
        return self._guessed.get(worker, _NO_KEYS)

    def extent(self, worker: Hashable, keys: Sequence[bytes],
               really_holds: Callable[[bytes], bool],
               unconfirmed: Container[bytes] = ()) -> tuple[int, int]:
        """(blocks, of which pending): how many of `keys`, from the first, the worker
        really holds, is guessed to hold, or holds `unconfirmed` (saved holdings no replay
        vouched for, which count like guesses)."""
        guessed = self._guessed.get(worker, {})
        count = pending = 0
        for key in keys:
            if really_holds(key):
                count += 1
            elif key in guessed or key in unconfirmed:
                count += 1
                pending += 1
            else:
                break
        return count, pending
