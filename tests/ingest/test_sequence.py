"""The seq classifier shared by the subscriber and `kvroute tail`, against a brute-force model."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.app.ingest.sequence import Kind, Verdict, classify, is_next

IN_ORDER = Verdict(Kind.IN_ORDER)
DUPLICATE = Verdict(Kind.DUPLICATE)
RESTART = Verdict(Kind.RESTART)


def gap(first: int, final: int) -> Verdict:
    return Verdict(Kind.GAP, range(first, final + 1))


@pytest.mark.parametrize(("seq", "state", "verdict"), [
    (0, dict(last_applied=None), IN_ORDER),                        # a publisher's first batch
    (3, dict(last_applied=None), gap(0, 2)),                       # its first three were lost
    (3, dict(last_applied=None, from_zero=False), IN_ORDER),       # tail joining midway
    (5, dict(last_applied=4), IN_ORDER),
    (4, dict(last_applied=4), DUPLICATE),                          # queued behind a replay
    (1, dict(last_applied=4), DUPLICATE),
    (7, dict(last_applied=4), gap(5, 6)),
    (7, dict(last_applied=4, from_zero=False), gap(5, 6)),         # from_zero only matters at None
    (5, dict(last_applied=4, last_live=2), IN_ORDER),
    (5, dict(last_applied=9, last_live=5), RESTART),               # the same live seq again
    (2, dict(last_applied=9, last_live=5), RESTART),               # beats being a duplicate
    (0, dict(last_applied=None, last_live=3), RESTART),            # beats being in order
    (8, dict(last_applied=9, last_live=5), DUPLICATE),             # live moved on, replay ahead
    (12, dict(last_applied=9, last_live=5), gap(10, 11)),
])
def test_named_examples(seq, state, verdict):
    assert classify(seq, **state) == verdict


def test_a_negative_seq_is_refused():
    with pytest.raises(ValueError):
        classify(-1, last_applied=None)


def model(seq: int, last_applied: int | None, last_live: int | None, from_zero: bool,
          joined: int) -> Verdict:
    """The rules spelled out over explicit sets: ``applied`` is every seq applied so far, from
    where the reader joined (0 for from_zero) up to ``last_applied``, each exactly once."""
    if last_live is not None and seq in range(last_live + 1):
        return RESTART
    if last_applied is None:
        applied: set[int] = set()
        start = 0 if from_zero else seq
    else:
        start = 0 if from_zero else joined
        applied = set(range(start, last_applied + 1))
    # The next expected seq: the first one at or after the stream's start not applied yet.
    expected = next(s for s in itertools.count(start) if s not in applied)
    if seq < expected:
        return DUPLICATE
    missing = [s for s in range(seq) if s >= start and s not in applied]
    if not missing:
        return IN_ORDER
    return Verdict(Kind.GAP, range(missing[0], missing[-1] + 1))


small = st.integers(0, 40)


@settings(max_examples=1000, deadline=None)
@given(seq=small, last_applied=st.none() | small, last_live=st.none() | small,
       from_zero=st.booleans(), joined=small)
def test_classify_matches_the_model(seq, last_applied, last_live, from_zero, joined):
    if last_applied is not None:
        joined = min(joined, last_applied)  # a reader joins at or before what it applied
    verdict = classify(seq, last_applied=last_applied, last_live=last_live, from_zero=from_zero)
    assert verdict == model(seq, last_applied, last_live, from_zero, joined)
    if verdict.kind is Kind.GAP:
        assert len(verdict.missing) > 0 and verdict.missing.stop == seq
    else:
        assert len(verdict.missing) == 0
    if from_zero:  # the fast path every live and replayed batch takes is the same rule
        assert is_next(seq, last_applied, last_live) == (verdict.kind is Kind.IN_ORDER)


@settings(max_examples=300, deadline=None)
@given(delivered=st.sets(small), from_zero=st.booleans())
def test_over_a_lossy_live_stream_the_gaps_are_exactly_the_lost_batches(delivered, from_zero):
    """A publisher sends 0, 1, 2, ...; only ``delivered`` arrive, in order, once each, and a
    reader applies each as it comes. Nothing is a restart or a duplicate, and the gaps name
    every lost seq before the last delivered one (the ones before the first delivered one
    only when the reader follows from zero)."""
    last_applied = last_live = None
    reported: list[int] = []
    for seq in sorted(delivered):
        verdict = classify(seq, last_applied=last_applied, last_live=last_live,
                           from_zero=from_zero)
        assert verdict.kind in (Kind.IN_ORDER, Kind.GAP)
        reported.extend(verdict.missing)
        last_applied = last_live = seq
    first = 0 if from_zero or not delivered else min(delivered)
    lost = [s for s in range(first, max(delivered, default=-1)) if s not in delivered]
    assert reported == lost
