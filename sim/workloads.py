"""Seeded synthetic workloads for the simulated cluster (no downloads).

A workload is a list of ``Session``s. A session is a chain of turns: its first turn arrives at
``start``; each later turn arrives ``think_s`` after the previous one finished, so multi-turn
chat is closed-loop like a real user. A one-shot request is a session of one turn.

- ``shared_system_prompts``: the shape of llm-d's prefix-cache benchmark (groups of prompts
  sharing a long system prompt, each with its own question), Poisson arrivals.
- ``multi_turn_chat``: every turn's prompt is the previous prompt + the previous answer + a
  new user message, so the whole history is a cacheable prefix.
- ``tenants``: ``shared_system_prompts`` sent by each of several tenants with its own
  ``cache_salt`` (the engine caches each tenant's copy apart).
- ``mooncake_trace``: replay of a Mooncake-format JSONL trace (``timestamp`` in ms,
  ``input_length``, ``output_length``, ``hash_ids``); hash id h stands for 512 tokens drawn from
  a generator seeded by h, so equal hash ids mean equal token blocks, as in Mooncake.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

MOONCAKE_BLOCK_TOKENS = 512
VOCAB = 32000


@dataclass(frozen=True, slots=True)
class Turn:
    prompt: tuple[int, ...]
    output: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Session:
    start: float
    turns: tuple[Turn, ...]
    think_s: float = 0.0
    cache_salt: str | None = None  # the tenant's: its blocks are cached apart


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _poisson_times(rng: random.Random, n: int, rate_per_s: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def shared_system_prompts(
    *,
    groups: int = 150,
    prompts_per_group: int = 5,
    system_tokens: int = 6000,
    question_tokens: int = 1200,
    output_tokens: int = 32,
    rate_per_s: float = 20.0,
    seed: int = 0,
) -> list[Session]:
    """``groups x prompts_per_group`` one-shot requests in random order."""
    rng = random.Random(seed)
    systems = [_tokens(rng, system_tokens) for _ in range(groups)]
    pairs = [(g, q) for g in range(groups) for q in range(prompts_per_group)]
    rng.shuffle(pairs)
    times = _poisson_times(rng, len(pairs), rate_per_s)
    return [
        Session(t, (Turn(tuple(systems[g] + _tokens(rng, question_tokens)),
                         tuple(_tokens(rng, output_tokens))),))
        for t, (g, _) in zip(times, pairs, strict=True)
    ]


def tenants(*, tenants: int = 4, seed: int = 0, **shared: Any) -> list[Session]:
    """``shared_system_prompts`` sent by each of ``tenants`` tenants with its own
    ``cache_salt``: the same system prompts, cached once per tenant and never shared
    between tenants. The arrivals of all tenants interleave; ``groups`` is per tenant."""
    sessions = [replace(session, cache_salt=f"tenant-{t}")
                for t in range(tenants)
                for session in shared_system_prompts(seed=seed, **shared)]
    rng = random.Random(seed + 1)
    return sorted(sessions, key=lambda session: (session.start, rng.random()))


def multi_turn_chat(
    *,
    sessions: int = 64,
    turns: int = 6,
    system_tokens: int = 400,
    user_tokens: tuple[int, int] = (60, 240),
    output_tokens: tuple[int, int] = (40, 160),
    think_s: float = 2.0,
    rate_per_s: float = 4.0,
    system_prompts: int = 4,
    seed: int = 0,
) -> list[Session]:
    """Chats that start as a Poisson process; each turn extends the previous prompt."""
    rng = random.Random(seed)
    systems = [_tokens(rng, system_tokens) for _ in range(system_prompts)]
    starts = _poisson_times(rng, sessions, rate_per_s)
    out = []
    for start in starts:
        history = list(rng.choice(systems))
        chat = []
        for _ in range(turns):
            prompt = history + _tokens(rng, rng.randint(*user_tokens))
            answer = _tokens(rng, rng.randint(*output_tokens))
            chat.append(Turn(tuple(prompt), tuple(answer)))
            history = prompt + answer
        out.append(Session(start, tuple(chat), think_s))
    return out


def mooncake_block(hash_id: int) -> list[int]:
    """The 512 tokens Mooncake hash id ``hash_id`` stands for (same id, same tokens)."""
    return _tokens(random.Random(f"mooncake-{hash_id}"), MOONCAKE_BLOCK_TOKENS)


def mooncake_trace(
    lines: Iterable[str],
    *,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    max_output_tokens: int | None = None,
    seed: int = 0,
) -> list[Session]:
    """Sessions (one turn each) from Mooncake JSONL lines; arrival = timestamp ms * scale.

    Raises ValueError naming the line when a record is malformed."""
    rng = random.Random(seed)
    blocks: dict[int, list[int]] = {}
    out: list[Session] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if max_requests is not None and len(out) >= max_requests:
            break
        try:
            rec = json.loads(line)
            ts, n_in, n_out = float(rec["timestamp"]), int(rec["input_length"]), int(
                rec["output_length"])
            hash_ids = [int(h) for h in rec["hash_ids"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"trace line {number}: not a Mooncake record ({exc})") from None
        if n_in < 1 or n_out < 1 or len(hash_ids) * MOONCAKE_BLOCK_TOKENS < n_in:
            raise ValueError(
                f"trace line {number}: input_length {n_in} needs "
                f"{-(-n_in // MOONCAKE_BLOCK_TOKENS)} hash ids, got {len(hash_ids)}"
            )
        prompt: list[int] = []
        for h in hash_ids:
            if h not in blocks:
                blocks[h] = mooncake_block(h)
            prompt += blocks[h]
            if len(prompt) >= n_in:
                break
        if max_output_tokens is not None:
            n_out = min(n_out, max_output_tokens)
        out.append(Session(ts / 1000 * time_scale,
                           (Turn(tuple(prompt[:n_in]), tuple(_tokens(rng, n_out))),)))
    return out


def load_mooncake(path: str | Path, **kwargs: object) -> list[Session]:
    with open(path, encoding="utf-8") as fh:
        return mooncake_trace(fh, **kwargs)  # type: ignore[arg-type]


def generate_mooncake_trace(
    *,
    requests: int = 400,
    apps: int = 10,
    rate_per_s: float = 8.0,
    seed: int = 0,
) -> list[dict[str, object]]:
    """A Mooncake-format trace with Mooncake's kind of sharing: requests of an app share its
    system-prompt hash ids; conversations grow turn by turn (hash ids extend); the rest of a
    prompt is unique. Used to make ``benchmarks/traces/sample_mooncake.jsonl``."""
    rng = random.Random(seed)
    next_id = iter(range(10**9))
    app_prefix = [[next(next_id) for _ in range(rng.randint(1, 6))] for _ in range(apps)]
    conversations: list[list[int]] = []
    records: list[dict[str, object]] = []
    t = 0.0
    for _ in range(requests):
        t += rng.expovariate(rate_per_s) * 1000
        if conversations and rng.random() < 0.45:
            ids = rng.choice(conversations)
            ids += [next(next_id) for _ in range(rng.randint(1, 2))]  # the chat grows
            if len(ids) >= 24:
                conversations.remove(ids)
        else:
            ids = list(rng.choice(app_prefix)) + [next(next_id) for _ in range(rng.randint(1, 4))]
            conversations.append(ids)
            if len(conversations) > 40:
                conversations.pop(0)
        ids = ids[:24]  # ~12k tokens at most
        n_in = (len(ids) - 1) * MOONCAKE_BLOCK_TOKENS + rng.randint(1, MOONCAKE_BLOCK_TOKENS)
        records.append({"timestamp": int(t), "input_length": n_in,
                        "output_length": rng.randint(8, 400), "hash_ids": list(ids)})
    return records
