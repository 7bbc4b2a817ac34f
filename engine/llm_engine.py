"""LLMEngine: requests in, token/text deltas out, one ``step()`` at a time.

    engine = LLMEngine("path/to/model", num_kv_blocks=512, max_num_seqs=32)
    outputs = engine.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))

``step()`` schedules a batch, runs one forward, samples, applies stops and returns one
``RequestOutput`` delta per request that produced something. The block ledger's KV events
and counters are handed out for the index publisher (``drain_kv_events``, ``stats``).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.detokenizer import IncrementalDetokenizer, token_decoder
from kvmesh.engine.launched import LaunchedStep
from kvmesh.engine.model_runner import ModelRunner
from kvmesh.engine.models.loader import decoder_spec, load_hf_config
from kvmesh.engine.protocol import EngineStats, HostTierStats, TokenLogprob
from kvmesh.engine.request import Request, RequestOutput, Status
from kvmesh.engine.sampler import FailedPick, Pick
from kvmesh.engine.scheduler import Scheduler
from kvmesh.engine.step_costs import StepCostFit, step_features
from kvmesh.kvcache import BlockManager, KVEvent, namespace_seed
from kvmesh.kvcache.host_pool import HostPool
from kvmesh.serving.model_info import model_id_of
from kvmesh.serving.model_lock import reading_model
from kvmesh.serving.sampling_params import SamplingParams, check_vocabulary

log = logging.getLogger(__name__)
Prompt = str | SequenceABC[int]
# Steps in a row whose forward failed for each request alone: then the engine is broken (a
# device that stays unusable, as CUDA is after a device-side assert), not a request.
BROKEN_AFTER_FAILED_STEPS = 3


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int
    num_host_cached_tokens: int = 0  # of the cached, those restored from the host tier
    logprobs: list[TokenLogprob] | None = None  # of token_ids, when asked
    prompt_logprobs: list[TokenLogprob] | None = None  # of prompt tokens 2.., when asked


@dataclass
class _InFlight:
    """A batch launched and not yet landed, with what its cost is measured against."""

    step: LaunchedStep
    features: tuple[int, int, int]
    started: float


class LLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        model_id: str | None = None,
        tokenizer_dir: str | Path | None = None,
        **config,
    ):
        self.config = EngineConfig.from_kwargs(**config)
        self.model_dir = str(model_dir)
        with reading_model(model_dir):  # no download swaps the folder while it loads
            self._load(model_dir, model_id, tokenizer_dir)
        self.hash_seed = namespace_seed(self.model_id, self.block_size)
        host = self.runner.host_kv
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            self.block_size,
            seed=self.hash_seed,
            host=HostPool(host.num_blocks, self.block_size) if host else None,
        )
        self.scheduler = Scheduler(
            self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens
        )
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self.step_costs = StepCostFit()
        self.clock = time.perf_counter  # what step costs are measured with
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self.num_failed_requests = 0
        self.failed_steps = 0  # steps in a row whose forward failed for every request
        self.broken: str | None = None  # why this engine can no longer step, once it cannot
        self.async_scheduling = (
            self.runner.device.type == "cuda"
            if self.config.async_scheduling is None
            else self.config.async_scheduling
        )
        self._in_flight: _InFlight | None = None  # the launched batch not yet landed
        self._landed_at = 0.0

    def _load(self, model_dir: str | Path, model_id: str | None, tokenizer_dir: str | Path | None) -> None:
        """Everything read from the model folder: config, weights, tokenizer, eos ids."""
        hf_config = load_hf_config(model_dir)
        spec = decoder_spec(hf_config)
        self.vocab_size = spec.vocab_size
        self.max_model_len = self.config.max_model_len or spec.max_position_embeddings
        if self.max_model_len > spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings "
                f"({spec.max_position_embeddings})"
            )
        self.model_id = model_id_of(model_dir, model_id)
        self.runner = ModelRunner(self.model_dir, self.config, hf_config, spec, self.max_model_len)
        self.block_size = self.runner.block_size
        self.tokenizer = _load_tokenizer(Path(tokenizer_dir or model_dir))
        self._decode = token_decoder(self.tokenizer) if self.tokenizer is not None else None
        self.eos_token_ids = _eos_token_ids(Path(model_dir), hf_config, self.tokenizer)

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt, or validated ids of a token-id prompt."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"model folder {self.model_dir!r} has no tokenizer; send token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        request = self.prepare_request(prompt, params, request_id)
        self.submit(request)
        return request.request_id

    def prepare_request(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None
    ) -> Request:
        params = params or SamplingParams()
        params.validate()
        if params.n != 1:
            raise ValueError(
                "the engine runs one sequence per request: submit n requests (the front end does)"
            )
        check_vocabulary(params, self.vocab_size)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len ({self.max_model_len})"
            )
        blocks = -(-(len(ids) + params.max_tokens) // self.block_size)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"request needs {blocks} KV blocks, the pool has {self.block_manager.num_blocks}"
            )
        generator = None  # without a seed of its own it draws from the batch's generator
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        detok = None
        if self.tokenizer is not None:
            # A continued stream's detokenizer replays the output already sent, so the text it
            # releases next is what the first attempt's would have (held-back text included).
            sent = params.continued_tokens
            detok = IncrementalDetokenizer(self._decode, ids[: len(ids) - sent], params.stop)
            for token in ids[len(ids) - sent :]:
                detok.push(token)
        if params.stop and detok is None:
            raise ValueError("stop strings need a tokenizer")
        return Request(request_id, ids, self.block_size, params, generator, stop_ids, detok)

    def submit(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        self._prompt_tokens += request.num_prompt_tokens

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output comes from the next ``step``."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, "abort")
        self._pending.append(request.output(request.detokenizer.flush() if request.detokenizer else ""))
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests to step, outputs to hand out, or a launched batch to land."""
        return bool(self.requests or self._pending or self._in_flight)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """One scheduled batch computed. A request that fails in it (its sampling, its
        detokenizing, or a forward that fails with it alone) ends with finish reason
        "error"; the others go on as if it had not been there.

        With async scheduling the batch is launched before the previous one lands, so this
        step returns the previous batch's outputs while the device computes this one."""
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        if self.runner.host_kv is not None:  # blocks leaving the pool and coming back, before the step
            self.runner.host_kv.run(self.block_manager.drain_transfers())
        launched = self._launch(scheduled) if self.async_scheduling else None
        if self._in_flight is not None:  # taken first: a landing that fails is not retried
            flight, self._in_flight = self._in_flight, None
            try:
                self._land(flight, outputs)
            except Exception:
                self._requeue(flight)
                raise
        scheduled = [r for r in scheduled if r.status is Status.RUNNING]  # some may end as it lands
        if launched is not None:
            for row, request in enumerate(launched.step.requests):
                if request.status is Status.RUNNING:
                    request.expect_token(row)
            self.scheduler.step_done(scheduled)
            self._in_flight = launched
        elif scheduled:
            self._compute(scheduled, outputs)
        if self.config.check_invariants:
            self.block_manager.check_invariants()
        return outputs

    def _compute(self, scheduled: list[Request], outputs: list[RequestOutput]) -> None:
        """Run the batch and read its tokens before returning (without async scheduling, or
        for a batch with prompt log-probabilities to record)."""
        features, started = step_features(scheduled), self.clock()
        picks = self._run(scheduled)
        self.step_costs.observe(*features, self.clock() - started)
        for request, pick in zip(scheduled, picks, strict=True):
            if isinstance(pick, FailedPick):  # nothing it computed in this step is kept
                outputs.append(self._fail(request, pick))
        self.scheduler.step_done([r for r in scheduled if r.status is Status.RUNNING])
        for request, pick in zip(scheduled, picks, strict=True):
            if pick is not None and not isinstance(pick, FailedPick):
                self._emit(request, pick, outputs)

    def _launch(self, scheduled: list[Request]) -> _InFlight | None:
        """Launch the batch without waiting for it; None where it must run the other way (a
        prompt whose log-probabilities are recorded as it goes, or a launch that failed: then
        it runs again, after the previous batch lands, with the failure handling of ``_run``)."""
        if not scheduled or any(r.wants_prompt_logprobs for r in scheduled):
            return None
        features, started = step_features(scheduled), self.clock()
        try:
            step = self.runner.launch(scheduled, self._in_flight.step if self._in_flight else None)
        except Exception as exc:
            log.warning(
                "launching a step failed, running it once the last one lands", extra={"error": str(exc)}
            )
            return None
        return _InFlight(step, features, started)

    def _land(self, flight: _InFlight, outputs: list[RequestOutput]) -> None:
        """Read a launched batch's tokens and hand them out. Its cost is the wall time from
        its launch, or the previous landing if later, to now: what it added to the run."""
        picks = flight.step.land()
        now = self.clock()
        if any(r.status is not Status.FINISHED for r in flight.step.requests):  # else nobody waited
            self.step_costs.observe(*flight.features, now - max(flight.started, self._landed_at))
        self._landed_at = now
        self.failed_steps = 0
        for request, pick in zip(flight.step.requests, picks, strict=True):
            if request.status is Status.FINISHED:
                continue  # it ended while the batch ran (aborted): its token is nobody's
            if isinstance(pick, FailedPick):
                outputs.append(self._fail(request, pick))
            else:
                self._emit(request, pick, outputs)

    def _requeue(self, flight: _InFlight) -> None:
        """A launched batch whose tokens are lost (its landing failed, as a device error
        makes it): its requests drop the places held for them and wait to be recomputed from
        the tokens they have, so the engine's state stays whole for whoever steps it next."""
        for request in flight.step.requests:
            request.forget_pending()
            if request.status is Status.RUNNING:
                self.scheduler.running.remove(request)
                self.scheduler.preempt(request)

    def _emit(self, request: Request, pick: Pick, outputs: list[RequestOutput]) -> None:
        """Append a request's sampled token and its output (or its own failure) to ``outputs``."""
        try:
            text = self._append_token(request, *pick)
        except Exception as exc:  # its detokenizer or stop check: its own failure
            outputs.append(self._fail(request, FailedPick(f"output failed: {exc}")))
            return
        outputs.append(request.output(text))
        if request.status is Status.FINISHED:
            del self.requests[request.request_id]

    def _run(self, scheduled: list[Request]) -> list[Pick | FailedPick | None]:
        """The step's picks. A forward that fails for the batch runs again for each request
        alone, so only a request that fails by itself fails (rewriting the same KV slots
        with the same values); when every one fails, the fault is the engine's."""
        try:
            picks = self.runner.run(scheduled)
        except Exception as exc:
            log.warning(
                "engine step failed, running its requests one by one",
                extra={"error": str(exc), "requests": len(scheduled)},
            )
            picks = [self._run_alone(r) for r in scheduled]
            if all(isinstance(p, FailedPick) for p in picks):
                self.note_failed_step(exc)
                return [FailedPick(f"engine step failed: {exc}", engine_fault=True) for _ in scheduled]
        self.failed_steps = 0
        return picks

    def _run_alone(self, request: Request) -> Pick | FailedPick | None:
        try:
            return self.runner.run([request])[0]
        except Exception as exc:
            return FailedPick(f"step failed: {exc}")

    def note_failed_step(self, exc: Exception) -> None:
        """A step failed for every request: the engine is broken after a device error, or
        after ``BROKEN_AFTER_FAILED_STEPS`` such steps in a row."""
        self.failed_steps += 1
        device_error = isinstance(exc, getattr(torch, "AcceleratorError", ()))
        if device_error or self.failed_steps >= BROKEN_AFTER_FAILED_STEPS:
            self.broken = f"{'device error' if device_error else f'{self.failed_steps} steps failed'}: {exc}"

    def _fail(self, request: Request, failure: FailedPick) -> RequestOutput:
        """End a failed request now: its blocks are freed, nothing it computed is reused."""
        self.requests.pop(request.request_id, None)
        request.error, request.engine_fault = str(failure), failure.engine_fault
        self.scheduler.finish(request, "error")
        self.num_failed_requests += 1
        if not failure.engine_fault:
            log.warning(
                "request failed alone", extra={"request_id": request.request_id, "error": str(failure)}
            )
        return request.output()

    def _append_token(self, request: Request, token: int, logprob: TokenLogprob | None = None) -> str:
        """Append a sampled token, apply every stop rule; returns the text it releases."""
        request.add_token(token, logprob)
        self._generation_tokens += 1
        text, stop_string = request.detokenizer.push(token) if request.detokenizer else ("", False)
        reason = None
        if stop_string or token in request.stop_ids:
            reason = "stop"
        elif request.num_completion_tokens >= request.params.max_tokens or len(request) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            if request.detokenizer and not stop_string:
                text += request.detokenizer.flush()
            self.scheduler.finish(request, reason)
        return text

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Run prompts to completion; one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        batch = [self.prepare_request(p, sp, None) for p, sp in zip(prompts, sampling_params, strict=True)]
        for request in batch:
            self.submit(request)
        texts = {r.request_id: [] for r in batch}
        done = 0
        bar = _progress(len(batch), use_tqdm)
        while done < len(batch):
            for out in self.step():
                if out.request_id in texts:
                    texts[out.request_id].append(out.new_text)
                    if out.finished:
                        done += 1
                        bar.update(1)
        bar.close()
        return [
            CompletionOutput(
                request_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                token_ids=r.completion_token_ids,
                text="".join(texts[r.request_id]),
                finish_reason=r.finish_reason or "",
                num_cached_tokens=r.cached_prompt_tokens or 0,
                num_host_cached_tokens=r.host_cached_prompt_tokens,
                logprobs=r.logprobs if r.params.logprobs is not None else None,
                prompt_logprobs=r.prompt_logprobs if r.params.prompt_logprobs is not None else None,
            )
            for r in batch
        ]

    # ------------------------------------------------------------------ for the index publisher

    def drain_kv_events(self) -> list[KVEvent]:
        return self.block_manager.drain_events()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            num_failed_requests=self.num_failed_requests,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            kv=self.block_manager.stats(),
            step_costs=self.step_costs.costs(),
            step_cost_samples=self.step_costs.steps,
            graph_capture_seconds=capture.seconds if (capture := self.runner.graph_capture) else 0.0,
            graph_capture_bytes=capture.bytes if capture else 0,
            graph_replays=self.runner.graphs.replays if self.runner.graphs else 0,
            host=self._host_stats(),
        )

    def _host_stats(self) -> HostTierStats | None:
        host, pool = self.runner.host_kv, self.block_manager.host
        if host is None:
            return None
        return HostTierStats(
            num_blocks=pool.num_blocks,
            num_used_blocks=pool.num_used_blocks,
            bytes=host.nbytes,
            offloaded_blocks=host.offloaded,
            restored_blocks=host.restored,
            restore_seconds=host.restore_seconds,
            hit_tokens=self.block_manager.host_hit_tokens,
            restore_block_s=host.restore_cost.block_seconds(),
        )

    def reset_prefix_cache(self) -> None:
        """Cold cache (for experiments); refuses while requests hold blocks."""
        self.block_manager.reset()


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req", disable=not enabled)


def _load_tokenizer(model_dir: Path):
    if not any(
        (model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def _eos_token_ids(model_dir: Path, hf_config, tokenizer) -> frozenset[int]:
    """eos ids from generation_config.json, config.json and the tokenizer, like transformers."""
    ids: list = [getattr(hf_config, "eos_token_id", None)]
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        ids.append(json.loads(gen.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        ids.append(tokenizer.eos_token_id)
    flat = itertools.chain.from_iterable(i if isinstance(i, list) else [i] for i in ids)
    return frozenset(i for i in flat if i is not None)
