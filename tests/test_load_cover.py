"""Which route answers a metrics reading shows: vLLM publishes a step's gauges when the
step ends, with the queue as it was when the step began. A request that arrived during a
step shows only after the next step ends; until then kvroute keeps counting its answer."""

from __future__ import annotations

from kvroute.app.inflight import RecentAnswers, WorkerLoad
from kvroute.app.load import Load, _covering

KEY = ("engine", 0)


def readings(*works: float | None, every: float = 1.0) -> list[Load]:
    """Successive readings, `every` seconds apart from t=1, with these token counters."""
    out: list[Load] = []
    for n, work in enumerate(works, 1):
        out.append(_covering(Load(read_at=n * every, work=work), out[-1] if out else None))
    return out


def test_a_reading_covers_requests_sent_before_the_step_before_the_last_one_seen_ending():
    r = readings(100, 100, 200, 200, 200, 300, 400)
    assert [x.covers_until for x in r] == [0, 0, 0, 0, 0, 2, 5]
    # t=3: a step ended between 2 and 3, but it may have begun long before 2.
    # t=6: another ended between 5 and 6; it began after the first one ended, after 2.
    # t=7: the step ending between 6 and 7 began after 5.
    assert [x.work_since for x in r] == [1, 1, 3, 3, 3, 6, 7]


def test_without_token_counters_a_reading_shows_everything_sent_before_it():
    assert [x.covers_until for x in readings(None, None, None)] == [1, 2, 3]


def test_an_answer_counts_through_a_long_step_and_stops_once_a_later_one_shows_it():
    answers = RecentAnswers(max_age=30.0, margin=0.05)
    answers.add(KEY, 90, now=1.5)  # sent while a step that began before 1 was running
    history = readings(100, 100, 200, 200, 300)
    for reading in history[:4]:  # the long step ends between 2 and 3: not this request's
        answers.settle(reading.read_at, lambda _key, r=reading: r.covers_until)
        assert answers.get(KEY) == WorkerLoad(requests=1, queued_prefill_tokens=90)
    last = history[4]  # a step that began after 2 ended between 4 and 5: it showed it
    answers.settle(last.read_at, lambda _key: last.covers_until)
    assert answers.get(KEY) == WorkerLoad()
