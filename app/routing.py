"""Choosing a worker from the index's answer.

The best worker is the one with the most matched tokens (block sizes differ
between instances, so blocks are not comparable). Among equals the choice
rotates, so a cold prefix that nobody holds does not always land on the same
worker: vLLM then builds it where the load balancer already is busiest.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from index import Match

__all__ = ["Score", "TieBreaker", "best_of", "scores_for"]

MEDIA = ("GPU", "CPU", "STORAGE")


@dataclass(frozen=True, slots=True)
class Score:
    instance: str
    dp_rank: int
    matched_blocks: int
    matched_tokens: int
    block_size: int | None
    by_medium: dict[str, int]
    state: str

    def as_json(self) -> dict[str, object]:
        return {
            "instance": self.instance,
            "dp_rank": self.dp_rank,
            "matched_blocks": self.matched_blocks,
            "matched_tokens": self.matched_tokens,
            "block_size": self.block_size,
            "by_medium": self.by_medium,
            "state": self.state,
        }


def scores_for(
    workers: Iterable[tuple[tuple[str, int], int | None, str]],
    matches: Mapping[tuple[str, int], Match],
) -> list[Score]:
    """One score per eligible worker, zero where the index knows nothing of it.

    `workers` yields (worker key, block size the instance announced, state).
    """
    scores = []
    for key, announced_block_size, state in workers:
        match = matches.get(key)
        if match is None:
            scores.append(Score(key[0], key[1], 0, 0, announced_block_size,
                                dict.fromkeys(MEDIA, 0), state))
            continue
        by_medium = dict.fromkeys(MEDIA, 0)
        by_medium.update(match.by_medium)
        scores.append(Score(key[0], key[1], match.blocks, match.tokens,
                            match.block_size or announced_block_size, by_medium, state))
    return scores


class TieBreaker:
    """Rotates through equally good workers; one counter per process is enough."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, tied: list[Score]) -> Score:
        return tied[next(self._counter) % len(tied)]


def best_of(scores: list[Score], ties: TieBreaker) -> Score:
    """The score with the most matched tokens; ties rotate. `scores` is not empty."""
    top = max(score.matched_tokens for score in scores)
    tied = [score for score in scores if score.matched_tokens == top]
    return tied[0] if len(tied) == 1 else ties.pick(tied)
