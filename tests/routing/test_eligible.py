"""A route weighs a kept set of eligible workers and groups the unloaded ones
(`app.routing.eligible`, `Service._group`): its choice and the scores it shows are what scoring
every eligible worker one by one gives, through real subscribers on real sockets, with load,
mixed block sizes, models, candidates and excluded workers; and the kept set follows the
registry as workers come, go and change state."""

from __future__ import annotations

import asyncio
import random
import time

from kvroute.app.api.route_request import route_request_type
from kvroute.app.config import InstanceConfig, Settings
from kvroute.app.errors import NoEligibleWorker
from kvroute.app.ingest.wire import BlockStored
from kvroute.app.routing.cost import TieBreaker, best_of, ranked, score_workers
from kvroute.app.routing.eligible import eligible_among
from kvroute.app.service import TOP_SCORES, Service
from kvroute.app.workers import WorkerState
from kvroute.sim.publisher import EventPublisher
from tests.support.tokens import unique_tokens
from tests.support.waiting import run_async, wait_until

PREFIX = unique_tokens(7, 8 * 16)


def _store(publisher: EventPublisher, tokens: list[int], block_size: int, first: int) -> None:
    blocks = len(tokens) // block_size
    publisher.publish([BlockStored(block_hashes=list(range(first, first + blocks)),
                                   parent_block_hash=None,
                                   token_ids=tokens[:blocks * block_size],
                                   block_size=block_size)])


class _QueueAsItStands:
    """A steady queue that weighs every queue as it stands: the grouping is compared here,
    not the averaging (tests/routing/test_steady_queue.py)."""

    def observe(self, key, queue_cost: float, now: float) -> float:
        return queue_cost

    def settle(self, idle, now: float) -> None:
        pass


def _every_score(service: Service, request, exclude, tokens):
    """What scoring every eligible worker one by one gives (no grouping, no kept set)."""
    instances = ([service.registry.get(c) for c in dict.fromkeys(request.candidates)]
                 if request.candidates is not None else list(service.registry))
    workers = [w for i in instances if i.serves(request.model) for w in i.workers
               if w.state.serving and w.key not in exclude]
    matches = service.index.match(tokens[:-1], workers=[w.key for w in workers],
                                  matched_only=True)
    scores = score_workers([service._view(w) for w in workers], matches, service.weights,
                           prompt_tokens=len(tokens),
                           held_elsewhere=max((m.tokens for m in matches.values()), default=0))
    return workers, scores


def test_a_route_chooses_what_scoring_every_worker_chooses():
    publishers = [EventPublisher(dp_rank=None).start() for _ in range(6)]
    try:
        # Publishers 0-2 hold a prefix at block size 16 (of different lengths), 3 at 8.
        for n, blocks in enumerate((8, 4, 8)):
            _store(publishers[n], PREFIX[:blocks * 16], 16, 1000 * (n + 1))
        _store(publishers[3], PREFIX[:40], 8, 5000)
        declared = (16, 16, None, 8, 16, 16, 16, None)  # None: declares none
        instances = tuple(
            InstanceConfig(id=f"i{n}", model="a" if n % 3 else "b",
                           block_size=declared[n],
                           events=tuple(publishers[(n + r) % 6].endpoint for r in range(3)),
                           replay=tuple(publishers[(n + r) % 6].replay_endpoint
                                        for r in range(3)))
            for n in range(8))
        settings = Settings(log_level="warning", load_interval=0.0, placement_ttl=0.0,
                            instances=instances)
        kind = route_request_type(settings)

        async def scenario() -> None:
            service = Service(settings)
            service.steady = _QueueAsItStands()
            await service.start()
            try:
                await wait_until(lambda: all(w.state == "live"
                                             for w in service.registry.workers()),
                                 "every worker to go live")
                await wait_until(lambda: len(service.index.match(PREFIX, matched_only=True))
                                 >= 12, "the index to learn the prefixes")
                keys = sorted(w.key for w in service.registry.workers())
                rng = random.Random(5)
                tickets = []
                for round_ in range(120):
                    for ticket in tickets:
                        ticket.close()
                    tickets = [service.inflight.open(key, rng.choice([0, 10, 500]))
                               for key in rng.sample(keys, rng.randint(0, 6))]
                    length = rng.choice([0, 20, 64, 129, 200])
                    tokens = PREFIX[:length] + unique_tokens(round_, rng.randint(1, 40))
                    request = kind(
                        token_ids=tokens, probe=True,
                        model=rng.choice([None, None, "a", "b"]),
                        candidates=rng.choice([None, None, ["i1", "i2", "i5"]]),
                        all_scores=rng.random() < 0.3)
                    exclude = frozenset(rng.sample(keys, rng.choice([0, 0, 3])))
                    workers, everyone = _every_score(service, request, exclude, tokens)
                    if not workers:
                        try:
                            await service.decide(request, exclude)
                        except NoEligibleWorker:
                            continue
                        raise AssertionError("a route with no eligible worker was answered")
                    decision = await service.decide(request, exclude)
                    busy = service._busy()
                    for worker in workers:  # a grouped worker's counts are not read: none
                        if worker.key not in busy:
                            unloaded = service._unloaded_view(worker, time.monotonic())
                            assert unloaded == service._view(worker)
                    expected = best_of(everyone, TieBreaker(tokens=tokens))
                    assert decision.best == expected, round_
                    assert decision.eligible == len(workers)
                    ranking = ranked(everyone)
                    if request.all_scores:
                        assert decision.scores == ranking
                    else:
                        top = ranking[:TOP_SCORES]
                        assert decision.scores == (top if expected in top else ranked(
                            [*top[:TOP_SCORES - 1], expected]))
                for ticket in tickets:
                    ticket.close()
            finally:
                await service.close()

        run_async(scenario, timeout=120)
    finally:
        for publisher in publishers:
            publisher.close()


def _same_as_walk(service: Service, kept, model) -> bool:
    """Whether a kept eligible set is what walking the registry now finds."""
    walked = eligible_among(service.registry, model)
    return (set(kept.workers) == set(walked.workers)
            and kept.sorted_keys == walked.sorted_keys
            and +kept.declared_sizes == walked.declared_sizes
            and kept.undeclared.keys() == walked.undeclared.keys()
            and kept.instances.keys() == walked.instances.keys()
            and sorted(kept.urls()) == sorted(walked.urls())
            and kept.adapter == walked.adapter and kept.served == walked.served)


def test_the_kept_eligible_set_follows_the_registry():
    publishers = [EventPublisher(dp_rank=None).start() for _ in range(2)]
    try:
        def config(n: int) -> InstanceConfig:
            return InstanceConfig(id=f"i{n}", model="m", block_size=16,
                                  events=(publishers[n % 2].endpoint,),
                                  replay=(publishers[n % 2].replay_endpoint,))

        settings = Settings(log_level="warning", load_interval=0.0,
                            instances=(config(0), config(1)))

        async def scenario() -> None:
            service = Service(settings)
            await service.start()
            try:
                def fresh() -> set:
                    return set(eligible_among(service.registry, None).workers)

                def same_as_fresh(kept) -> bool:
                    return _same_as_walk(service, kept, None)

                await wait_until(lambda: len(service.eligible.get(None)) == 2,
                                 "both workers eligible")
                kept = service.eligible.get(None)
                assert service.eligible.get(None) is kept  # nothing changed: kept
                added = await service.registry.add(config(2))
                await wait_until(lambda: set(service.eligible.get(None).workers) == fresh()
                                 and len(fresh()) == 3, "the new worker to be eligible")
                assert service.eligible.get("m").served
                assert not service.eligible.get("other").served
                # A worker going down leaves the kept set at once, in place, and comes back.
                kept = service.eligible.get(None)
                added.workers[0].subscriber._ledger.set_state(WorkerState.DOWN)
                assert service.eligible.get(None) is kept
                assert ("i2", 0) not in kept and same_as_fresh(kept)
                added.workers[0].subscriber._ledger.set_state(WorkerState.LIVE)
                assert ("i2", 0) in kept and same_as_fresh(kept)
                added.workers[0].subscriber._ledger.set_state(WorkerState.DOWN)
                assert same_as_fresh(service.eligible.get("m"))
                await service.registry.remove("i0")
                assert set(service.eligible.get(None).workers) == {("i1", 0)} == fresh()
            finally:
                await service.close()

        run_async(scenario, timeout=60)
    finally:
        for publisher in publishers:
            publisher.close()


def test_instances_added_and_removed_at_once_keep_the_eligible_set_exact_in_place():
    """Many instances registered at once (as concurrent API calls are), then removed at
    once: after every step the kept set for each model is exactly what a walk of the registry
    finds, it is updated in place (the same object, never rebuilt over the fleet), and a
    route chooses what scoring every worker chooses."""
    publishers = [EventPublisher(dp_rank=None).start() for _ in range(2)]
    try:
        _store(publishers[0], PREFIX, 16, 1000)

        def config(n: int, model: str, block_size: int | None) -> InstanceConfig:
            return InstanceConfig(id=f"i{n:02d}", model=model, block_size=block_size,
                                  events=(publishers[n % 2].endpoint,
                                          publishers[(n + 1) % 2].endpoint),
                                  replay=(publishers[n % 2].replay_endpoint,
                                          publishers[(n + 1) % 2].replay_endpoint))

        settings = Settings(log_level="warning", load_interval=0.0,
                            instances=(config(0, "m", 16), config(1, "m", None)))
        models = (None, "m", "n")

        async def scenario() -> None:
            service = Service(settings)
            await service.start()
            try:
                await wait_until(lambda: len(service.eligible.get(None)) == 4,
                                 "the configured workers eligible")
                kept = {model: service.eligible.get(model) for model in models}

                def exact() -> bool:
                    return all(service.eligible.get(model) is kept[model]
                               and _same_as_walk(service, kept[model], model)
                               for model in models)

                async def checked(steps) -> None:
                    tasks = [asyncio.ensure_future(step) for step in steps]
                    while not all(task.done() for task in tasks):
                        assert exact()
                        await asyncio.sleep(0)
                    for task in tasks:
                        task.result()
                    assert exact()

                added = [config(n, "m" if n % 3 else "n", 16 if n % 4 else None)
                         for n in range(2, 26)]
                await checked([service.registry.add(c) for c in added])
                await wait_until(lambda: len(kept[None]) == 2 * 26,
                                 "every added worker eligible")
                assert exact()
                await wait_until(lambda: len(service.index.match(PREFIX, matched_only=True))
                                 >= 26, "the index to learn the prefix on every holder")
                tokens = PREFIX + [1]
                for model in models:
                    request = route_request_type(settings)(token_ids=tokens, probe=True,
                                                           model=model)
                    decision = await service.decide(request, frozenset())
                    workers, everyone = _every_score(service, request, frozenset(), tokens)
                    assert decision.best == best_of(everyone, TieBreaker(tokens=tokens))
                    assert decision.eligible == len(workers)
                    assert decision.best.matched_blocks == len(PREFIX) // 16
                await checked([service.registry.remove(c.id) for c in added[::2]])
                await checked([service.registry.remove(c.id) for c in added[1::2]])
                assert set(kept[None].workers) == {(f"i{n:02d}", r) for n in (0, 1)
                                                   for r in (0, 1)}
                assert not kept["n"].served and not kept["n"].workers
            finally:
                await service.close()

        run_async(scenario, timeout=90)
    finally:
        for publisher in publishers:
            publisher.close()
