"""``kvmesh bench kvcache``: kvmesh's block ledger against the nano-vllm algorithm, same run.

Both ledgers replay the same seeded operation trace in the same process; each case is
timed ``repeats`` times and the median is reported, as ops/s and as a ratio. The two must
also agree on every prefix hit, so the speed-up is for the same work.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvmesh.bench.measure.common import environment, median_seconds, progress, target, write_result
from kvmesh.bench.reference_ledger import ReferenceBlockManager, compute_hash
from kvmesh.kvcache import BlockManager, Sequence, block_hashes

BLOCK_SIZE = 16
HASH_BLOCK_SIZE = 256


@dataclass(frozen=True)
class Request:
    tokens: list[int]
    decode_tokens: int
    hold: bool  # stays resident until memory pressure pushes it out (else finishes at once)


def mixed_trace(num_blocks: int, rng: random.Random) -> list[Request]:
    """Shared-prefix groups with unique suffixes and a short decode; fills and churns the pool."""
    prefixes = [[rng.randrange(50_000) for _ in range(16 * BLOCK_SIZE)] for _ in range(32)]
    n_requests = max(300, 3 * num_blocks // 40)
    return [
        Request(
            tokens=rng.choice(prefixes) + [rng.randrange(50_000) for _ in range(rng.randrange(100, 500))],
            decode_tokens=16,
            hold=rng.random() < 0.5,
        )
        for _ in range(n_requests)
    ]


def rehit_trace(num_blocks: int, rng: random.Random) -> list[Request]:
    """Few long prefixes requested again and again after they were freed (cached-free hits)."""
    prefixes = [[rng.randrange(50_000) for _ in range(64 * BLOCK_SIZE)] for _ in range(64)]
    n_requests = 200
    return [
        Request(
            tokens=rng.choice(prefixes) + [rng.randrange(50_000) for _ in range(20)],
            decode_tokens=4,
            hold=False,
        )
        for _ in range(n_requests)
    ]


def _kvmesh_computed(bm: BlockManager, seq: Sequence) -> None:
    """kvmesh hashes a block once its KV is computed, and ships events every step."""
    seq.num_computed_tokens = len(seq)
    bm.hash_blocks(seq)
    bm.drain_events()


def _reference_computed(bm: ReferenceBlockManager, seq: Sequence) -> None:
    """The article's ledger hashed eagerly inside allocate/may_append: nothing left to do."""


LEDGERS = {
    "kvmesh": (BlockManager, _kvmesh_computed),
    "reference": (ReferenceBlockManager, _reference_computed),
}


def replay(trace: list[Request], num_blocks: int, ledger: str) -> tuple[int, int]:
    """Run the trace on one ledger; returns (ledger calls, prefix hit tokens).

    Admission frees the oldest held sequences until the new one fits, like a scheduler
    finishing requests under memory pressure.
    """
    make, computed = LEDGERS[ledger]
    bm = make(num_blocks, BLOCK_SIZE)
    live: deque[Sequence] = deque()
    ops = hits = 0
    for req in trace:
        seq = Sequence(req.tokens, BLOCK_SIZE)
        while (n := bm.can_allocate(seq)) < 0:
            bm.deallocate(live.popleft())
            ops += 2
        bm.allocate(seq, n)
        computed(bm, seq)
        ops += 3
        hits += seq.num_cached_tokens
        for t in range(req.decode_tokens):
            seq.append_token(t)
            while not bm.can_append(seq):
                bm.deallocate(live.popleft())
                ops += 2
            bm.may_append(seq)
            computed(bm, seq)
            ops += 3
        if req.hold:
            live.append(seq)
        else:
            bm.deallocate(seq)
            ops += 1
    return ops, hits


def bench_ledger(name: str, trace: list[Request], num_blocks: int, repeats: int) -> dict:
    ops, hits = replay(trace, num_blocks, "kvmesh")
    ref_ops, ref_hits = replay(trace, num_blocks, "reference")
    if (ops, hits) != (ref_ops, ref_hits):
        raise RuntimeError(
            f"{name}: ledgers disagree (ops {ops} vs {ref_ops}, hit tokens {hits} vs {ref_hits})"
        )
    ours = median_seconds(lambda: replay(trace, num_blocks, "kvmesh"), repeats)
    base = median_seconds(lambda: replay(trace, num_blocks, "reference"), repeats)
    query = sum(len(r.tokens) for r in trace)
    return {
        "case": name,
        "num_blocks": num_blocks,
        "requests": len(trace),
        "ops": ops,
        "prefix_hit_tokens": hits,
        "prefix_hit_rate": round(hits / query, 4),
        "kvmesh_ops_per_s": round(ops / ours),
        "baseline_ops_per_s": round(ops / base),
        "speedup": round(base / ours, 2),
    }


def _baseline_block_hashes(tokens: list[int], block_size: int) -> list[int]:
    out, h = [], -1
    for i in range(len(tokens) // block_size):
        h = compute_hash(tokens[i * block_size : (i + 1) * block_size], h)
        out.append(h)
    return out


def bench_hashing(num_tokens: int, repeats: int) -> dict:
    rng = np.random.default_rng(num_tokens)
    arr = rng.integers(0, 150_000, num_tokens).astype("<u4")
    tokens = arr.tolist()
    calls = max(20, 200_000 // num_tokens)

    def per_call(fn: Callable[[], object]) -> float:
        return median_seconds(lambda: [fn() for _ in range(calls)], repeats) / calls * 1e6

    from_numpy = per_call(lambda: block_hashes(arr, HASH_BLOCK_SIZE, 0))
    from_list = per_call(lambda: block_hashes(tokens, HASH_BLOCK_SIZE, 0))
    baseline = per_call(lambda: _baseline_block_hashes(tokens, HASH_BLOCK_SIZE))
    return {
        "case": f"hash_{num_tokens}_tokens",
        "num_tokens": num_tokens,
        "block_size": HASH_BLOCK_SIZE,
        "numpy_us": round(from_numpy, 1),
        "list_us": round(from_list, 1),
        "baseline_us": round(baseline, 1),
        "speedup_list": round(baseline / from_list, 2),
    }


def main(out: str, repeats: int, quick: bool = False) -> int:
    rng = random.Random(0)
    sizes = [1024, 4096] if quick else [1024, 16_384, 131_072]
    rehit_blocks = 16_384 if quick else 131_072
    cases = []
    for num_blocks in sizes:
        cases.append(bench_ledger(f"mixed_{num_blocks}", mixed_trace(num_blocks, rng), num_blocks, repeats))
        progress(f"done: {cases[-1]['case']}")
    cases.append(bench_ledger(f"rehit_{rehit_blocks}", rehit_trace(rehit_blocks, rng), rehit_blocks, repeats))
    progress(f"done: {cases[-1]['case']}")
    hashing = [bench_hashing(n, repeats) for n in (4096, 32_768)]
    for h in hashing:
        progress(f"done: {h['case']}")

    by_case = {c["case"]: c for c in cases}
    h32 = hashing[-1]
    targets = [
        target(f"rehit_{rehit_blocks} speedup", by_case[f"rehit_{rehit_blocks}"]["speedup"], ">=", 20),
        target("block_hashes 32k tokens from numpy (us)", h32["numpy_us"], "<=", 60),
        target("block_hashes 32k tokens from list (us)", h32["list_us"], "<=", 400),
        target("block_hashes 32k tokens speedup vs baseline", h32["speedup_list"], ">=", 3),
    ]
    if not quick:
        targets.insert(0, target("mixed_16384 speedup", by_case["mixed_16384"]["speedup"], ">=", 1.5))
    result = {
        "benchmark": "kvcache",
        "block_size": BLOCK_SIZE,
        "repeats": repeats,
        "statistic": "median",
        "quick": quick,
        "environment": environment(numpy=np.__version__),
        "ledger": cases,
        "hashing": hashing,
        "targets": targets,
    }
    _print_table(result)
    write_result(out, result)
    return 0


def _print_table(result: dict) -> None:
    print(
        f"\n{'case':<16}{'blocks':>8}{'ops':>9}{'hit rate':>10}{'kvmesh ops/s':>14}{'baseline ops/s':>16}{'ratio':>8}"
    )
    for c in result["ledger"]:
        print(
            f"{c['case']:<16}{c['num_blocks']:>8}{c['ops']:>9}{c['prefix_hit_rate']:>10.3f}"
            f"{c['kvmesh_ops_per_s']:>14,}{c['baseline_ops_per_s']:>16,}{c['speedup']:>7.1f}x"
        )
    print(f"\n{'hashing (block 256)':<22}{'numpy us':>10}{'list us':>10}{'baseline us':>13}{'ratio':>8}")
    for h in result["hashing"]:
        print(
            f"{h['case']:<22}{h['numpy_us']:>10}{h['list_us']:>10}{h['baseline_us']:>13}{h['speedup_list']:>7.1f}x"
        )
