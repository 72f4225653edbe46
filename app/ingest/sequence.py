"""Where a batch's seq stands relative to what was already applied: the one place that decides.

Shared by the subscriber and its replay (which keep the index), the compiled drain of live
messages and ``kvroute tail`` (which prints), so none can drift from the others on what
counts as the next batch, a gap, a duplicate or an engine restart. ``is_next`` is
``classify``'s IN_ORDER without the verdict, for the path every live batch takes. What to
do about a verdict (replay, rebuild, print) stays with each caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(Enum):
    IN_ORDER = "in order"
    DUPLICATE = "duplicate"
    GAP = "gap"
    RESTART = "restart"


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: Kind
    missing: range = range(0)  # GAP only: the seqs between the last applied one and this one


def next_seq(last_applied: int | None) -> int:
    """The seq that comes after ``last_applied`` on a stream that begins at 0."""
    return 0 if last_applied is None else last_applied + 1


def is_next(seq: int, last_applied: int | None, last_live: int | None = None) -> bool:
    """Whether ``seq`` is the next batch in order: ``classify``'s IN_ORDER on a stream that
    begins at 0, without making a verdict. (``next_seq`` spelled out: this runs for every
    live batch.)"""
    return (seq == (0 if last_applied is None else last_applied + 1)
            and (last_live is None or seq > last_live))


def classify(seq: int, *, last_applied: int | None, last_live: int | None = None,
             from_zero: bool = True) -> Verdict:
    """Classify ``seq``, which is never negative (seqs are unsigned on the wire).

    ``last_applied`` is the last seq applied (live or replayed), None when nothing is.
    ``last_live`` is the previous seq seen on the live stream, None when there is none to
    compare with (a fresh connection, or a batch that is not live, such as a replayed one).
    ``from_zero`` says whether, with nothing applied, the stream must begin at seq 0 (the
    subscriber: it rebuilt from the publisher's whole history) or may begin anywhere
    (``kvroute tail``, which joins a stream midway).

    - RESTART: ``seq <= last_live``. One publisher's live stream strictly increases, so going
      back means a new engine counting from 0 again. It takes precedence over the others.
    - DUPLICATE: ``seq <= last_applied``: already applied, by a replay that the live copy was
      queued behind. Whether it is really the same batch is the caller's to check (only it
      has the payloads).
    - GAP: ``seq`` is above the next expected seq (``last_applied + 1``, or 0 when nothing is
      applied and ``from_zero``); ``missing`` is the seqs in between, never empty.
    - IN_ORDER: ``seq`` is the next expected one, or, with nothing applied and not
      ``from_zero``, any seq.
    """
    if seq < 0:
        raise ValueError(f"seq {seq} is negative")
    if last_live is not None and seq <= last_live:
        return Verdict(Kind.RESTART)
    expected = seq if last_applied is None and not from_zero else next_seq(last_applied)
    if seq == expected:
        return Verdict(Kind.IN_ORDER)
    if seq < expected:
        return Verdict(Kind.DUPLICATE)
    return Verdict(Kind.GAP, range(expected, seq))
