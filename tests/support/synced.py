"""Subscribers and a PrefixIndex against the truth their ledgers imply: the same holdings and
the same answer to every stored prompt, once every subscriber has caught up."""

from __future__ import annotations

from typing import Any

from kvroute.app.ingest.subscriber import Subscriber
from kvroute.app.ingest.wire import BlockStored
from kvroute.index import PrefixIndex
from tests.support.events import (
    Ledger,
    caught_up,
    truth_index,
)
from tests.support.waiting import wait_until


def queries(ledgers: dict[Any, Ledger]) -> list[list[int]]:
    return [e.token_ids + [1, 2, 3] for ledger in ledgers.values()
            for events in ledger.sent.values() if events
            for e in events if isinstance(e, BlockStored)]


def assert_same_answers(index: PrefixIndex, ledgers: dict[Any, Ledger]) -> None:
    truth = truth_index(ledgers)
    workers = list(ledgers)
    held, expected = index.stats().holdings, truth.stats().holdings
    assert {w: held.get(w) for w in workers} == {w: expected.get(w) for w in workers}
    for query in queries(ledgers):
        assert index.match(query, workers=workers) == truth.match(query, workers=workers)


async def synced(subs: list[Subscriber], index: PrefixIndex, ledgers: dict[Any, Ledger],
                 what: str) -> None:
    """Wait (cheaply) until every subscriber is live at its ledger's last batch, then check
    once that the index answers exactly like the truth."""
    await wait_until(lambda: all(caught_up(sub, ledgers[sub.worker]) for sub in subs), what,
                     detail=lambda: [sub.status for sub in subs])
    assert_same_answers(index, ledgers)
