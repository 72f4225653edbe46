"""The proxy's in-flight ledger: every ticket closes exactly once and leaves no trace."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.app.routing.inflight import InFlight, RecentAnswers, WorkerLoad
from kvroute.app.routing.load import Load

A, B = ("a", 0), ("b", 1)


def test_a_ticket_counts_until_closed_and_its_prefill_until_the_answer_starts():
    ledger = InFlight()
    first = ledger.open(A, prefill_tokens=480)
    second = ledger.open(A, prefill_tokens=60)
    assert ledger.get(A) == WorkerLoad(requests=2, queued_prefill_tokens=540)
    first.started()
    first.started()  # a second chunk changes nothing
    assert ledger.get(A) == WorkerLoad(requests=2, queued_prefill_tokens=60)
    first.close()
    first.close()  # idempotent
    assert ledger.get(A) == WorkerLoad(requests=1, queued_prefill_tokens=60)
    second.close()  # closed before it started: its prefill leaves with it
    second.started()  # too late: nothing to take back
    assert ledger.get(A) == WorkerLoad() and len(ledger) == 0 and ledger.total() == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["open", "start", "close"]), st.integers(0, 7),
                          st.sampled_from([A, B]), st.integers(-3, 1000)), max_size=60))
def test_the_ledger_always_equals_its_open_tickets(steps):
    """Model: each ticket is open or closed, prefilling until started or closed."""
    ledger = InFlight()
    tickets = []
    model: list[dict] = []
    for action, pick, key, tokens in steps:
        if action == "open" or not tickets:
            tickets.append(ledger.open(key, tokens))
            model.append({"key": key, "tokens": max(tokens, 0), "open": True, "prefill": True})
        else:
            i = pick % len(tickets)
            if action == "start":
                tickets[i].started()
                model[i]["prefill"] = False
            else:
                tickets[i].close()
                model[i]["open"] = model[i]["prefill"] = False
        for worker in (A, B):
            mine = [m for m in model if m["key"] == worker and m["open"]]
            queued = sum(m["tokens"] for m in mine if m["prefill"])
            assert ledger.get(worker) == WorkerLoad(len(mine), queued)
    for ticket in tickets:
        ticket.close()
    assert len(ledger) == 0 and ledger.get(A) == ledger.get(B) == WorkerLoad()


def test_negative_prefill_is_taken_as_none():
    ledger = InFlight()
    ledger.open(B, prefill_tokens=-5).close()
    with pytest.raises(AssertionError):
        ledger._add(B, -1, 0)  # accounting that would go negative is a bug, said loudly


def test_route_answers_count_until_a_later_metrics_reading_or_their_age_says_otherwise():
    answers = RecentAnswers(max_age=3.0, margin=0.05)
    answers.add(A, 500, now=10.0)
    answers.add(A, 100, now=10.5)
    answers.add(B, 70, now=10.0)
    # A's metrics were read after the first answer only; B's never
    readings = {A: Load(read_at=10.2)}
    answers.settle(11.0, readings.get)
    assert answers.get(A) == WorkerLoad(requests=1, queued_prefill_tokens=100)
    assert answers.get(B) == WorkerLoad(requests=1, queued_prefill_tokens=70)
    answers.settle(13.0, readings.get)  # B's answer is 3 s old: no longer trusted
    assert answers.get(B) == WorkerLoad()
    readings[A] = Load(read_at=10.52)  # within the margin: the request may not be there yet
    answers.settle(13.0, readings.get)
    assert answers.get(A).requests == 1
    readings[A] = Load(read_at=10.6)
    answers.settle(13.0, readings.get)
    assert answers.get(A) == WorkerLoad()


def test_route_answers_last_as_long_as_the_engines_requests_lately_did():
    """An engine that answers in 30 ms ran one request at a time for a single client; the
    answers of a whole scrape interval counted as 16 requests queued there."""
    answers = RecentAnswers(max_age=3.0, margin=0.05)
    reading = Load(read_at=9.0, ttft_seconds=0.2, request_seconds=0.5)
    for at in (10.0, 10.2, 10.4):
        answers.add(A, 100, now=at)
    answers.add(B, 70, now=10.0)  # B's engine exports no request times
    readings = {A: reading, B: Load(read_at=9.0)}
    answers.settle(10.3, readings.get)  # the first one's first token is most likely out
    assert answers.get(A) == WorkerLoad(requests=3, queued_prefill_tokens=200)
    answers.settle(10.56, readings.get)  # the first one has most likely ended
    assert answers.get(A) == WorkerLoad(requests=2, queued_prefill_tokens=100)
    answers.settle(10.7, readings.get)  # the last one's first token: none queued
    assert answers.get(A) == WorkerLoad(requests=2, queued_prefill_tokens=0)
    answers.settle(10.96, readings.get)
    assert answers.get(A) == WorkerLoad()
    assert answers.get(B) == WorkerLoad(requests=1, queued_prefill_tokens=70)  # max_age only
    answers.settle(13.0, readings.get)
    assert answers.get(B) == WorkerLoad()


def test_a_worker_whose_engine_says_no_request_time_uses_the_fleets():
    """An engine whose first scrapes fail under load has no reading: its answers counted
    for max_age while the others' ended, so it looked the busiest and lost its prefixes."""
    answers = RecentAnswers(max_age=3.0, margin=0.05)
    answers.add(A, 100, now=10.0)
    answers.add(B, 100, now=10.0)
    readings = {B: Load(read_at=9.0)}  # A: never read; B: read, without the histograms
    answers.settle(10.3, readings.get, typical=(0.2, 0.5))
    assert answers.get(A) == answers.get(B) == WorkerLoad(requests=1, queued_prefill_tokens=0)
    answers.settle(10.56, readings.get, typical=(0.2, 0.5))
    assert answers.get(A) == answers.get(B) == WorkerLoad()


def test_the_typical_prefill_of_a_worker_outlives_its_answers_and_is_bounded(monkeypatch):
    answers = RecentAnswers(max_age=3.0)
    assert answers.typical_prefill(A) is None
    answers.add(A, 800, now=0.0)
    assert answers.typical_prefill(A) == 800
    for n in range(80):  # a moving mean: the first answer's weight fades to nothing
        answers.add(A, 100, now=float(n))
    answers.settle(100.0, {}.get)  # every answer too old: none counts any more ...
    assert answers.get(A) == WorkerLoad()
    typical = answers.typical_prefill(A)  # ... but what they cost is remembered
    assert typical is not None and 100 < typical < 101
    answers.add(B, -5, now=0.0)  # tickets never count negative tokens; nor does the mean
    assert answers.typical_prefill(B) == 0
    monkeypatch.setattr("kvroute.app.routing.inflight.TYPICAL_WORKERS", 2)
    answers.add(A, 100, now=1.0)  # A answered last: B is the one forgotten for C
    answers.add(("c", 0), 100, now=1.0)
    assert answers.typical_prefill(B) is None and answers.typical_prefill(A) is not None
