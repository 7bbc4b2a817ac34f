"""What a replica tells the router about its prefix hit, dated from the request's arrival:
the router read the index just before, so what changed in the cache while the request
queued at the replica is no fault of the index (docs/operations.md, the miss causes)."""

import time

from kvmesh.engine import LLMEngine, SamplingParams
from kvmesh.protos import pb
from kvmesh.replica.backend import prediction_facts
from kvmesh.router.index_trust.predictions import Prediction, miss_cause

BS = 16
PREFIX = [(5 * j) % 400 + 3 for j in range(2 * BS)]
OTHER = [(11 * j) % 400 + 7 for j in range(3 * BS)]
QUEUED_S = 0.5


def finished(engine: LLMEngine, request_id: str):
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


def test_a_block_evicted_while_the_request_queued_is_an_eviction_not_a_lie(qwen3_dir):
    """Six blocks, one sequence at a time: a request for a cached prefix waits behind one
    that grows into every block (evicting that prefix), then is admitted later than the
    lag tolerance: its miss is ``evicted`` (the index was right when the router read it)."""
    engine = LLMEngine(qwen3_dir, num_kv_blocks=6, block_size=BS, max_num_seqs=1, dtype="float32")
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    finished(engine, engine.add_request(PREFIX, once))  # the prefix: two cached blocks
    hog = engine.add_request(OTHER, SamplingParams(temperature=0, max_tokens=3 * BS, ignore_eos=True))
    engine.step()  # the hog runs; the next request arrives and queues behind it
    queued = engine.add_request(PREFIX + [9] * BS, once)
    finished(engine, hog)  # it took every block: the prefix was evicted
    time.sleep(QUEUED_S)
    out = finished(engine, queued)
    assert out.cached_tokens == 0
    request = pb.GenerateRequest(predicted_cached_blocks=2)
    complete = pb.Complete(usage=pb.Usage(cached_tokens=0), incarnation=1)
    prediction_facts(complete, out.prefix, request)
    assert complete.HasField("miss_evicted_age_ms") and complete.miss_evicted_age_ms == 0
    prediction = Prediction("r", 1, fleet_best=2, index=2, speculative=0, predicted=2)
    assert miss_cause(prediction, complete, BS, lag_tolerance_s=QUEUED_S / 2) == "evicted"
