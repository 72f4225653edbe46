"""A model of one vLLM v1 engine's prefix cache and scheduler, in virtual time.

What it reproduces (vLLM v1 ``KVCacheManager`` / ``BlockPool`` / ``Scheduler``, as observed in
vLLM 0.32 and its captured traffic):

- A pool of ``num_blocks`` blocks of ``block_size`` tokens. Block 0 is vLLM's null block and is
  never handed out, so ``num_blocks - 1`` blocks hold KV.
- A block's hash chains its parent's hash and its own tokens. The chain starts from a root
  value derived from the engine's ``seed``, so two engines give the same tokens different
  hashes, as two vLLM processes with different PYTHONHASHSEED do.
- Prefix lookup walks a request's full blocks and stops at the first miss. At most
  ``len(prompt) - 1`` tokens can hit (vLLM always computes the last prompt token), and the
  trailing partial block never hits.
- Free blocks sit in a queue whose head is the least recently freed. A request's blocks are
  freed tail first, so a request's tail is evicted before its prefix. Hit blocks with no other
  user are taken out of the queue while in use ("touch"). Taking a block that still carries a
  hash evicts that hash: one ``BlockRemoved`` per block, as vLLM sends them.
- Blocks become cached when they are scheduled to be full (at allocation, in ``schedule``);
  events collected during a step are handed out with the step's result, i.e. after the
  forward pass. A step's batch holds its removals and its stores, in allocation order.
  Blocks reused from the cache are never announced again; the same hash may be stored twice
  (vLLM does not deduplicate) and each copy is removed on its own.
- Scheduling: running requests first (FCFS), each taking up to its remaining tokens from the
  step's token budget (chunked prefill), then waiting requests FCFS while ``max_num_seqs`` and
  the budget allow; a waiting request that cannot get blocks stops admission. A running
  request that cannot get a block preempts the last running request (recompute: its blocks
  are freed and it re-queues at the front of the waiting queue).
- ``reset_prefix_cache`` succeeds only when no block is in use; its ``AllBlocksCleared`` goes
  out with the next step's batch, as in vLLM.

Time is virtual: a step starting at ``t`` ends at ``t + TimeModel.step_seconds(...)``. Nothing
here sleeps, does I/O or takes locks; callers that share an engine across threads lock it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvroute.app.ingest.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event

HashFormat = Literal["int", "bytes"]
BlockHash = int | bytes
MEDIUM = "GPU"
KV_SPEC_KIND = "full_attention"


@dataclass(frozen=True, slots=True)
class TimeModel:
    """Cost of one engine step. Prefill is compute bound (per token); decode is memory bound
    (per running sequence); every step pays a fixed overhead."""

    step_overhead_s: float = 0.003
    prefill_s_per_token: float = 0.00004
    decode_s_per_seq: float = 0.0004

    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        return (
            self.step_overhead_s
            + self.prefill_s_per_token * prefill_tokens
            + self.decode_s_per_seq * decode_seqs
        )


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What a finished request reports. ``cached_tokens`` is the prefix-cache hit at its first
    scheduling (vLLM's ``usage.prompt_tokens_details.cached_tokens``)."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: tuple[int, ...]
    arrival_time: float
    first_token_time: float
    finish_time: float
    preemptions: int

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class StepResult:
    """One engine step. ``events`` is the batch vLLM publishes after this step."""

    start: float
    end: float
    events: list[Event]
    prefill_tokens: int
    decode_seqs: int
    first_token_ids: list[str]
    finished: list[RequestOutcome]


class _Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: list[int]
    planned_output: list[int]
    arrival_time: float
    tokens: list[int] = field(default_factory=list)  # prompt + outputs sampled so far
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks of `tokens`
    blocks: list[_Block] = field(default_factory=list)
    num_computed: int = 0
    num_cached_blocks: int = 0  # leading blocks already registered in the cache
    cached_tokens: int = -1  # set once, at first scheduling
    first_token_time: float | None = None
    preemptions: int = 0
    cache_salt: str | None = None
    # vLLM's kv_cache_report_mode "full": the blocks it reuses are announced again.
    report_reused: bool = False

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)


class EngineError(ValueError):
    """A request the engine can never serve (too long, empty, duplicate id)."""


class Engine:
    """One engine (one data-parallel rank). See the module docstring for the semantics."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int = 16,
        seed: int = 0,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        time_model: TimeModel | None = None,
        hash_format: HashFormat = "int",
        lookahead: int = 0,
    ) -> None:
        if block_size < 1 or num_blocks < 2:
            raise ValueError("need block_size >= 1 and num_blocks >= 2 (block 0 is reserved)")
        capacity = (num_blocks - 1) * block_size
        self.max_model_len = capacity if max_model_len is None else max_model_len
        if self.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the KV capacity {capacity} tokens "
                f"({num_blocks - 1} usable blocks of {block_size})"
            )
        if hash_format not in ("int", "bytes"):
            raise ValueError(f"hash_format must be 'int' or 'bytes', not {hash_format!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.time_model = time_model or TimeModel()
        self.hash_format = hash_format
        # vLLM 0.33's lookahead block hashes: each block hashed with the L tokens after it,
        # and only once they exist (speculative decoding with block drop).
        self.lookahead = lookahead
        self._key = hashlib.blake2b(seed.to_bytes(16, "big", signed=True)).digest()[:32]
        self._root = hashlib.blake2b(b"root", key=self._key, digest_size=32).digest()
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # OrderedDict as vLLM's doubly linked free list: O(1) pop-head, append, remove-any.
        self._free: OrderedDict[int, _Block] = OrderedDict(
            (b.block_id, b) for b in self._blocks[1:]
        )
        self._cached: dict[BlockHash, dict[int, _Block]] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._ids: set[str] = set()
        self._events: list[Event] = []
        self.clock = 0.0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # vLLM's vllm:prompt_tokens / vllm:generation_tokens counters: they move on every
        # step that does work, and only then.
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        # vLLM's vllm:time_to_first_token_seconds and vllm:e2e_request_latency_seconds
        # histograms, their sums and count (kept here when a request ends).
        self.ttft_seconds = 0.0
        self.e2e_seconds = 0.0
        self.requests_ended = 0
        # vLLM's gauges: the scheduler's counts at the last step, kept while the engine idles.
        self.reported_running = 0
        self.reported_waiting = 0
        self.reported_kv_usage = 0.0

    # --- hashing ------------------------------------------------------------------------------

    def hash_block(self, parent: BlockHash | None, tokens: Sequence[int],
                   cache_salt: str | None = None, ahead: Sequence[int] = ()) -> BlockHash:
        """The engine's hash of a full block whose parent block has hash ``parent``; a
        first block (no parent) of a salted request hashes its ``cache_salt`` too, as vLLM
        puts it in the first block's extra keys; ``ahead``: its lookahead tokens."""
        h = hashlib.blake2b(key=self._key, digest_size=32)
        h.update(self._root if parent is None else _as_bytes(parent))
        h.update(array("Q", tokens).tobytes())
        if parent is None and cache_salt:
            h.update(b"\x00salt\x00" + cache_salt.encode())
        if ahead:
            h.update(b"\x00ahead\x00" + array("Q", ahead).tobytes())
        digest = h.digest()
        if self.hash_format == "bytes":
            return digest
        return int.from_bytes(digest[:8], "big")  # uint64; half of them are >= 2**63

    def block_hashes(self, tokens: Sequence[int],
                     cache_salt: str | None = None) -> list[BlockHash]:
        """Hashes of every full block of ``tokens`` (under ``cache_salt``, if any) that has
        ``lookahead`` tokens after it."""
        out: list[BlockHash] = []
        self._extend_hashes(out, tokens, cache_salt)
        return out

    def _extend_hashes(self, hashes: list[BlockHash], tokens: Sequence[int],
                       cache_salt: str | None) -> None:
        """Append the hashes of the blocks of ``tokens`` that can be hashed now."""
        bs, ahead = self.block_size, self.lookahead
        k = len(hashes)
        while (k + 1) * bs + ahead <= len(tokens):
            parent = hashes[-1] if hashes else None
            hashes.append(self.hash_block(parent, tokens[k * bs:(k + 1) * bs], cache_salt,
                                          tokens[(k + 1) * bs:(k + 1) * bs + ahead]))
            k += 1

    # --- read-only views ----------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        """Tokens of the longest cached prefix of ``tokens`` (under ``cache_salt``) in whole
        blocks (no side effects).

        This is what an index of this engine's events should answer; admission itself can use
        at most ``len(prompt) - 1`` of them."""
        matched = 0
        for block_hash in self.block_hashes(tokens, cache_salt):
            if block_hash not in self._cached:
                break
            matched += 1
        return matched * self.block_size

    def cached_hashes(self) -> dict[BlockHash, int]:
        """Every cached hash with the number of blocks holding it."""
        return {h: len(blocks) for h, blocks in self._cached.items()}

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of usable blocks in use (vLLM's ``kv_cache_usage_perc``, 0..1)."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    @property
    def unpublished_events(self) -> int:
        """Events waiting for the next step's batch (a reset's ``AllBlocksCleared``); while
        there are any, the cache differs from what the published events describe."""
        return len(self._events)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def load(self) -> int:
        """Requests queued or running: what a load balancer calls this engine's load."""
        return len(self._waiting) + len(self._running)

    # --- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        output: Sequence[int],
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        report_reused: bool = False,
    ) -> None:
        """Queue a request that will "generate" exactly ``output`` (at least one token),
        its blocks cached under ``cache_salt`` (a tenant's: shared with no other salt)."""
        if request_id in self._ids:
            raise EngineError(f"request id {request_id!r} is already in flight")
        if not prompt:
            raise EngineError("the prompt must hold at least one token")
        if not output:
            raise EngineError("a request must generate at least one token")
        total = len(prompt) + len(output)
        if total > self.max_model_len:
            raise EngineError(
                f"prompt ({len(prompt)} tokens) plus output ({len(output)} tokens) exceeds "
                f"max_model_len {self.max_model_len}"
            )
        arrival = self.clock if arrival_time is None else arrival_time
        if not self.has_work():
            self.clock = max(self.clock, arrival)
        req = _Request(request_id, list(prompt), list(output), arrival, tokens=list(prompt),
                       cache_salt=cache_salt or None, report_reused=report_reused)
        req.block_hashes = self.block_hashes(req.tokens, req.cache_salt)
        self._ids.add(request_id)
        self._waiting.append(req)

    def abort_request(self, request_id: str) -> bool:
        """Drop a queued or running request (a client that went away); its blocks are freed
        like a finished request's, so what it cached stays cached. False if unknown."""
        if request_id not in self._ids:
            return False
        self._ids.discard(request_id)
        for req in self._running:
            if req.request_id == request_id:
                self._running.remove(req)
                self._free_request_blocks(req)
                return True
        self._waiting = deque(r for r in self._waiting if r.request_id != request_id)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, as in vLLM."""
        if len(self._free) != self.num_blocks - 1:
            return False
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    # --- stepping -----------------------------------------------------------------------------

    def step(self, now: float | None = None) -> StepResult:
        """Schedule and run one step starting at ``max(clock, now)``; advance the clock."""
        start = self.clock if now is None else max(self.clock, now)
        scheduled = self._schedule()
        self.reported_running, self.reported_waiting = len(self._running), len(self._waiting)
        self.reported_kv_usage = self.kv_cache_usage
        prefill_tokens = sum(n for req, n in scheduled if req.num_computed < len(req.prompt))
        decode_seqs = sum(1 for req, _ in scheduled if req.num_computed >= len(req.prompt))
        end = start + self.time_model.step_seconds(prefill_tokens, decode_seqs)
        self.prompt_tokens_computed += prefill_tokens
        first: list[str] = []
        finished: list[RequestOutcome] = []
        for req, num_new in scheduled:
            req.num_computed += num_new
            if req.num_computed < len(req.tokens):
                continue  # a prefill chunk: nothing sampled yet
            self._sample(req)
            self.generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = end
                first.append(req.request_id)
            if req.num_output == len(req.planned_output):
                finished.append(self._finish(req, end))
        self.clock = end
        events, self._events = self._events, []
        return StepResult(start, end, events, prefill_tokens, decode_seqs, first, finished)

    def _sample(self, req: _Request) -> None:
        req.tokens.append(req.planned_output[req.num_output])
        self._extend_hashes(req.block_hashes, req.tokens, req.cache_salt)

    def _finish(self, req: _Request, end: float) -> RequestOutcome:
        self._running.remove(req)
        self._ids.discard(req.request_id)
        self._free_request_blocks(req)
        assert req.first_token_time is not None
        self.ttft_seconds += req.first_token_time - req.arrival_time
        self.e2e_seconds += end - req.arrival_time
        self.requests_ended += 1
        return RequestOutcome(
            req.request_id,
            len(req.prompt),
            req.cached_tokens,
            tuple(req.tokens[len(req.prompt) :]),
            req.arrival_time,
            req.first_token_time,
            end,
            req.preemptions,
        )

    def _schedule(self) -> list[tuple[_Request, int]]:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[_Request, int]] = []
        preempted = False
        i = 0
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            num_new = min(len(req.tokens) - req.num_computed, budget)
            while not self._allocate(req, [], num_new):
                victim = self._running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1
        if preempted:
            return scheduled
        while self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            req = self._waiting[0]
            hits = self._computed_blocks(req)
            num_new = min(len(req.tokens) - len(hits) * self.block_size, budget)
            if not self._allocate(req, hits, num_new):
                break
            self._waiting.popleft()
            if req.cached_tokens < 0:
                req.cached_tokens = len(hits) * self.block_size
                self.prefix_cache_queries += len(req.prompt)
                self.prefix_cache_hits += req.cached_tokens
                if hits and req.report_reused:
                    self._report_reused(req, len(hits))
            self._running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new
        return scheduled

    def _report_reused(self, req: _Request, blocks: int) -> None:
        """A reuse report, as vLLM sends it: the request's hit blocks from its first one,
        stored again (nothing allocated; no removal will pair with it)."""
        bs, ahead = self.block_size, self.lookahead
        self._events.append(BlockStored(
            block_hashes=list(req.block_hashes[:blocks]), parent_block_hash=None,
            token_ids=req.tokens[:blocks * bs], block_size=bs, medium=MEDIUM,
            extra_keys=[[req.cache_salt] if k == 0 and req.cache_salt else None
                        for k in range(blocks)],
            group_idx=0, kv_cache_spec_kind=KV_SPEC_KIND,
            lookahead_token_ids=[req.tokens[(k + 1) * bs:(k + 1) * bs + ahead]
                                 for k in range(blocks)] if ahead else None))

    def _computed_blocks(self, req: _Request) -> list[_Block]:
        max_hit_blocks = (len(req.tokens) - 1) // self.block_size
        hits: list[_Block] = []
        for block_hash in req.block_hashes[:max_hit_blocks]:
            holders = self._cached.get(block_hash)
            if not holders:
                break
            hits.append(next(iter(holders.values())))
        return hits

    def _allocate(self, req: _Request, hits: list[_Block], num_new: int) -> bool:
        """Give ``req`` blocks for ``num_new`` more tokens after its ``hits``; cache the blocks
        that become full. False (and no change) when the pool cannot supply them."""
        if hits:
            req.num_computed = len(hits) * self.block_size
        bs = self.block_size
        total = req.num_computed + num_new
        need = -(-total // bs) - len(req.blocks) - len(hits)
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if need > len(self._free) - evictable_hits:
            if hits:
                req.num_computed = 0
            return False
        for block in hits:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
        req.blocks.extend(hits)
        req.num_cached_blocks = max(req.num_cached_blocks, len(hits))
        for _ in range(need):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            req.blocks.append(block)
        self._cache_full_blocks(req, total // bs)
        return True

    def _evict(self, block: _Block) -> None:
        if block.block_hash is None:
            return
        holders = self._cached.get(block.block_hash)
        block_hash, block.block_hash = block.block_hash, None
        if holders is None or holders.pop(block.block_id, None) is None:
            return
        if not holders:
            del self._cached[block_hash]
        self._events.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM, group_idx=0))

    def _cache_full_blocks(self, req: _Request, num_full: int) -> None:
        first = req.num_cached_blocks
        num_full = min(num_full, len(req.block_hashes))  # lookahead: hashed blocks only
        if num_full <= first:
            return
        bs, ahead = self.block_size, self.lookahead
        new_hashes = req.block_hashes[first:num_full]
        for block, block_hash in zip(req.blocks[first:num_full], new_hashes, strict=True):
            block.block_hash = block_hash
            self._cached.setdefault(block_hash, {})[block.block_id] = block
        self._events.append(
            BlockStored(
                block_hashes=list(new_hashes),
                parent_block_hash=req.block_hashes[first - 1] if first else None,
                token_ids=req.tokens[first * bs : num_full * bs],
                block_size=bs,
                medium=MEDIUM,
                # vLLM's extra keys: the salt in the first block's only.
                extra_keys=[[req.cache_salt] if first + i == 0 and req.cache_salt else None
                            for i in range(len(new_hashes))],
                group_idx=0,
                kv_cache_spec_kind=KV_SPEC_KIND,
                lookahead_token_ids=[req.tokens[(k + 1) * bs:(k + 1) * bs + ahead]
                                     for k in range(first, num_full)] if ahead else None,
            )
        )
        req.num_cached_blocks = num_full

    def _free_request_blocks(self, req: _Request) -> None:
        for block in reversed(req.blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
        req.blocks = []
        req.num_cached_blocks = 0

    def _preempt(self, req: _Request) -> None:
        self._free_request_blocks(req)
        req.num_computed = 0
        req.preemptions += 1
        self._waiting.appendleft(req)


def _as_bytes(block_hash: BlockHash) -> bytes:
    return block_hash if isinstance(block_hash, bytes) else block_hash.to_bytes(8, "big")
