"""Workloads as token-id requests, deterministic by seed (no tokenizer needed).

Token ids are drawn from [3, vocab) so they never hit a tiny model's special tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST_ID = 3


@dataclass(frozen=True)
class WorkloadRequest:
    prompt: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # offset from the start (trace replay); 0 for closed-loop runs
    group: str = ""  # what it shares a prefix with (for reports)
    session: str = ""  # conversation id (session affinity)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def shared_prefix(
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    vocab: int = 1000,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """SGLang's generated-shared-prefix benchmark: groups share a system prompt, questions differ.

    Requests are shuffled, so groups interleave as they would from many users.
    """
    rng = random.Random(seed)
    requests = []
    for g in range(num_groups):
        system = _tokens(rng, system_prompt_len, vocab)
        for _ in range(prompts_per_group):
            requests.append(
                WorkloadRequest(system + _tokens(rng, question_len, vocab), output_len, group=f"g{g}")
            )
    rng.shuffle(requests)
    return requests
