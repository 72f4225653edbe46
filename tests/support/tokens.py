"""Token ids for tests."""

from __future__ import annotations


def unique_tokens(seed: int, n: int) -> list[int]:
    """`n` token ids determined by `seed`, distinct prompts for distinct seeds. All are >= 256,
    so they never coincide with the simulator's byte tokens of a text prompt (ids 0-255)."""
    return [(seed * 7919 + i * 104729) % 30_000 + 256 for i in range(n)]
