"""Token-id prompts for the checks; seeded, so every run sends the same traffic.

Token ids avoid 0..2 (special ids in the Llama config) and stay below the
vocabulary size. Prompts stay well under max_model_len because the engine
needs room for the one generated token.
"""

from __future__ import annotations

import random

from e2e.model import VOCAB_SIZE

Prompt = list[int]


def random_tokens(rng: random.Random, n: int) -> Prompt:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


def shared_prefix_workload(
    rng: random.Random, requests: int, block_size: int = 32
) -> list[Prompt]:
    """System prompts with user tails, multi-turn continuations and exact repeats.

    About one prompt in six is cut to end exactly on a block boundary: that is
    where vLLM's "always recompute the last token" rule makes its hit one block
    smaller than what it holds, and kvroute must answer the same.
    """
    systems = [random_tokens(rng, n) for n in (70, 100, 150, 200)]
    sent: list[Prompt] = []
    for _ in range(requests):
        roll = rng.random()
        if sent and roll < 0.25:
            prompt = list(rng.choice(sent))  # the same prompt again
        elif sent and roll < 0.5:
            base = rng.choice(sent)  # the next turn of a conversation
            prompt = base + random_tokens(rng, rng.randint(20, 80))
            if len(prompt) > 700:
                prompt = rng.choice(systems) + random_tokens(rng, rng.randint(10, 90))
        else:
            prompt = rng.choice(systems) + random_tokens(rng, rng.randint(10, 90))
        if rng.random() < 0.17 and len(prompt) > 2 * block_size:
            prompt = prompt[: len(prompt) // block_size * block_size]
        sent.append(prompt)
    return sent


def grouped_workload(
    rng: random.Random, groups: int, per_group: int, prefix_tokens: int
) -> list[Prompt]:
    """``groups`` shared prefixes, ``per_group`` distinct tails each, interleaved at random."""
    prefixes = [random_tokens(rng, prefix_tokens) for _ in range(groups)]
    prompts = [
        prefix + random_tokens(rng, rng.randint(40, 90))
        for prefix in prefixes
        for _ in range(per_group)
    ]
    rng.shuffle(prompts)
    return prompts
