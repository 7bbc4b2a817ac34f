"""A request inside the engine: its Sequence plus sampling state, stops and output cursor."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.kvcache import Sequence
from kvmesh.serving.sampling import SamplingParams

if TYPE_CHECKING:  # the simulator schedules these without torch
    import torch

    from kvmesh.replica.detokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta; ``finished`` on the last one)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


class Request(Sequence):
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        block_size: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        stop_ids: frozenset[int],
        detokenizer: IncrementalDetokenizer | None,
    ):
        super().__init__(prompt_token_ids, block_size)
        self.request_id = request_id
        self.params = params
        self.generator = generator
        self.stop_ids = stop_ids  # eos (unless ignore_eos) and the request's stop token ids
        self.detokenizer = detokenizer
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.cached_prompt_tokens: int | None = None  # prefix hit at first admission
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()
        self.emitted_tokens = 0  # completion tokens already handed out

    def output(self, new_text: str = "") -> RequestOutput:
        new_ids = self.completion_token_ids[self.emitted_tokens :]
        self.emitted_tokens = self.num_completion_tokens
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=self.status is Status.FINISHED,
            finish_reason=self.finish_reason,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_completion_tokens,
            cached_tokens=self.cached_prompt_tokens or 0,
        )
