"""Where an engine step's host time goes, stage by stage.

A decode step on a GPU is short enough that the host's work (scheduling, building the step's
plan, launching, sampling, the outputs) decides its pace. Each stage is timed by wrapping the
function that does it, on a live engine, over the steps of a decode batch:

- ``schedule``: the scheduler picks the batch and its blocks;
- ``prepare``: the step's layout built on the host (token ids, positions, slot mapping, the
  backend's plan or the graph buffers' refill), everything in the forward call but the model;
- ``model``: the model's forward (on a GPU: launching it, unless a sync waits inside);
- ``logits``, ``sample``: the LM head and the sampler (queued on the device, no sync);
- ``land``: waiting for the sampled ids, the step's one sync (without async scheduling right
  after sampling; with it, the previous step's: the device time the host's work did not hide);
- ``outputs``: the rest of the step (appending tokens, detokenizing, block bookkeeping).
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections import defaultdict

from kvmesh.engine import LLMEngine, SamplingParams
from kvmesh.engine import model_runner as runner_module
from kvmesh.engine.launched import LaunchedStep

STAGES = ("schedule", "prepare", "model", "logits", "sample", "land", "outputs")


@contextlib.contextmanager
def decoding(engine: LLMEngine, batch: int, context: int, steps: int, temperature: float = 0.0):
    """``batch`` requests of ``context`` random tokens, every one prefilled, with at least
    ``steps`` decode steps left; aborted and drained at the end, so the engine is idle again."""
    rng = random.Random(batch)
    params = SamplingParams(temperature=temperature, max_tokens=steps + 4, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(3, engine.vocab_size) for _ in range(context)], params)
    try:
        while not all(r.num_completion_tokens for r in engine.requests.values()):
            engine.step()
        yield
    finally:
        for rid in list(engine.requests):
            engine.abort(rid)
        while engine.has_unfinished_requests():
            engine.step()


def step_stages(engine: LLMEngine, batch: int, context: int, steps: int, temperature: float = 0.0) -> dict:
    """Median milliseconds per stage of a decode step of ``batch`` rows at ``context``
    tokens (greedy, or sampled at ``temperature``), and the step's total."""
    with decoding(engine, batch, context, steps, temperature):
        rows = _timed_stages(engine, steps)
    return {
        "batch": batch,
        "context": context,
        "temperature": temperature,
        **{
            f"{stage}_ms": round(statistics.median(r[stage] for r in rows) * 1e3, 3)
            for stage in (*STAGES, "step")
        },
    }


def _timed_stages(engine: LLMEngine, steps: int) -> list[dict]:
    """Each of ``steps`` steps' seconds by stage, the engine's functions wrapped meanwhile."""
    spent: dict[str, float] = defaultdict(float)
    runner, scheduler = engine.runner, engine.scheduler
    originals = {
        "schedule": (scheduler, "schedule"),
        "forward": (runner, "_forward_layout"),
        "model": (runner.model, "forward"),
        "logits": (runner.model, "compute_logits"),
        "sample": (runner_module, "draw"),
        "land": (LaunchedStep, "land"),
    }
    saved = {name: getattr(owner, attr) for name, (owner, attr) in originals.items()}
    own = {name for name, (owner, attr) in originals.items() if attr in vars(owner)}  # else the class's

    def timed(name, fn):
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - started

        return call

    for name, (owner, attr) in originals.items():
        setattr(owner, attr, timed(name, saved[name]))
    rows = []
    try:
        for _ in range(steps):
            spent.clear()
            started = time.perf_counter()
            engine.step()
            total = time.perf_counter() - started
            rows.append(
                {
                    "schedule": spent["schedule"],
                    # the forward call less the model and LM head inside it
                    "prepare": spent["forward"] - spent["model"] - spent["logits"],
                    "model": spent["model"],
                    "logits": spent["logits"],
                    "sample": spent["sample"],
                    "land": spent["land"],
                    "outputs": total - spent["schedule"] - spent["forward"] - spent["sample"] - spent["land"],
                    "step": total,
                }
            )
    finally:
        for name, (owner, attr) in originals.items():
            if name in own:
                setattr(owner, attr, saved[name])
            else:
                delattr(owner, attr)
    return rows
