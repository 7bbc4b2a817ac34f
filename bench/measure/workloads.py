"""Workloads as token-id requests, deterministic by seed (no tokenizer needed).

A prompt is a list of *segments*: (key, length) pairs whose tokens are a fixed pseudo-
random stream per key. Equal keys give equal tokens, so sharing is exactly what the
workload says it is, and nothing is materialized until a request is sent or simulated
(100k requests of 10k tokens would not fit in memory as Python lists).
Token ids are drawn from [3, vocab) so they never hit a tiny model's special tokens.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import random
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvmesh.kvcache import block_hashes

FIRST_ID = 3
DEFAULT_VOCAB = 1000
MOONCAKE_BLOCK = 512
# A gzipped copy of ../shared/data/mooncake/synthetic_trace.jsonl (see MOONCAKE_TRACE.md).
MOONCAKE_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl.gz"

Segment = tuple[int, int]  # (key, length)


_CHUNK = 512


# Shared prefixes are read again and again; a request's own tokens once: a small cache holds
# the first (16,384 chunks of 2 KB: 32 MB).
@functools.lru_cache(maxsize=16384)
def _chunk(key: int, index: int, vocab: int) -> np.ndarray:
    ids = np.random.default_rng([key, index]).integers(FIRST_ID, vocab, size=_CHUNK, dtype=np.int64)
    ids = ids.astype(np.uint32)
    ids.flags.writeable = False  # shared by every caller
    return ids


def segment_tokens(segment: Segment, vocab: int = DEFAULT_VOCAB) -> np.ndarray:
    """The first ``length`` tokens of the key's stream (a shorter segment is a prefix of a longer one)."""
    key, length = segment
    chunks = [_chunk(key, i, vocab) for i in range(-(-length // _CHUNK))]
    return np.concatenate(chunks)[:length] if len(chunks) > 1 else chunks[0][:length]


def _key(*parts: object) -> int:
    """A 63-bit segment key from its identity (stable across runs and processes)."""
    return xxhash.xxh64_intdigest("|".join(map(str, parts)).encode()) >> 1


@dataclass(frozen=True)
class WorkloadRequest:
    segments: tuple[Segment, ...]
    max_tokens: int
    arrival_s: float = 0.0  # offset from the start (open loop); 0 for closed-loop runs
    group: str = ""  # what it shares a prefix with (for reports)
    session: str = ""  # conversation id (session affinity)
    answer: Segment | None = None  # the tokens a simulated engine generates (multi-turn history)
    model: str = ""  # the model it names (a mix of models; "": the server's only one)
    vocab: int = field(default=DEFAULT_VOCAB, repr=False)

    @property
    def prompt_len(self) -> int:
        return sum(n for _, n in self.segments)

    def tokens(self) -> list[int]:
        return np.concatenate([segment_tokens(s, self.vocab) for s in self.segments]).tolist()

    def token_array(self) -> array:
        """``tokens()`` as 4 bytes a token (what the simulator keeps for a request in flight)."""
        ids = np.concatenate([segment_tokens(s, self.vocab) for s in self.segments])
        return array("I", ids.tobytes())

    def answer_tokens(self) -> list[int]:
        return segment_tokens(self.answer, self.vocab).tolist() if self.answer else []


def poisson_arrivals(requests: list[WorkloadRequest], rate: float, seed: int = 0) -> list[WorkloadRequest]:
    """The same requests (in order) with Poisson arrival times at ``rate`` per second."""
    return list(iter_poisson_arrivals(requests, rate, seed))


def iter_poisson_arrivals(
    requests: Iterable[WorkloadRequest], rate: float, seed: int = 0
) -> Iterator[WorkloadRequest]:
    """``poisson_arrivals`` as a stream: each request timed as it is read."""
    return _timed(requests, _poisson_times(rate, random.Random(seed)))


# A burst's requests follow each other this far apart on average (a few ms for a burst).
BURST_GAP_S = 0.001


def bursty_arrivals(
    requests: list[WorkloadRequest], rate: float, seed: int = 0, mean_burst: float = 4.0
) -> list[WorkloadRequest]:
    """The same requests (in order) arriving in bursts, ``rate`` per second on average: what a
    load generator's Poisson run looks like at a server when its workers send together."""
    return list(iter_bursty_arrivals(requests, rate, seed, mean_burst))


def iter_bursty_arrivals(
    requests: Iterable[WorkloadRequest], rate: float, seed: int = 0, mean_burst: float = 4.0
) -> Iterator[WorkloadRequest]:
    """``bursty_arrivals`` as a stream. A compound Poisson process: bursts start at Poisson
    rate ``rate / mean_burst``, each a geometric number of requests (mean ``mean_burst``)
    ``BURST_GAP_S`` apart on average; a burst never overtakes the one before it."""
    if mean_burst < 1:
        raise ValueError(f"mean_burst must be at least 1, got {mean_burst}")
    return _timed(requests, _burst_times(rate, random.Random(seed), mean_burst))


ARRIVALS = {"poisson": iter_poisson_arrivals, "bursty": iter_bursty_arrivals}


def _timed(requests: Iterable[WorkloadRequest], times: Iterator[float]) -> Iterator[WorkloadRequest]:
    for r, t in zip(requests, times, strict=False):  # the times never end
        yield _with(r, arrival_s=t)


def _poisson_times(rate: float, rng: random.Random) -> Iterator[float]:
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        yield t


def _burst_times(rate: float, rng: random.Random, mean_burst: float) -> Iterator[float]:
    last = 0.0
    for start in _poisson_times(rate / mean_burst, rng):
        offset = 0.0
        for _ in range(_geometric(rng, mean_burst)):
            last = max(last, start + offset)
            yield last
            offset += rng.expovariate(1 / BURST_GAP_S)


def _geometric(rng: random.Random, mean: float) -> int:
    """1, 2, ... with P(k) = (1 - p)^(k - 1) p, p = 1 / mean."""
    if mean == 1:
        return 1
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1 - 1 / mean))


def _with(r: WorkloadRequest, **changes) -> WorkloadRequest:
    from dataclasses import replace

    return replace(r, **changes)


def with_new_content(r: WorkloadRequest, salt: int) -> WorkloadRequest:
    """The same request shape with other tokens (every segment re-keyed by ``salt``): copies
    of a workload that share within a copy as the original does, never across copies."""
    segments = tuple((_key(key, salt), n) for key, n in r.segments)
    answer = (_key(r.answer[0], salt), r.answer[1]) if r.answer else None
    return _with(r, segments=segments, answer=answer, group=f"{r.group}~{salt}")


def shared_prefix(**kwargs: Any) -> list[WorkloadRequest]:
    """SGLang's generated-shared-prefix benchmark as a list (``iter_shared_prefix``'s
    parameters)."""
    return list(iter_shared_prefix(**kwargs))


def iter_shared_prefix(
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    vocab: int = DEFAULT_VOCAB,
    seed: int = 0,
    zipf: float | None = None,
) -> Iterator[WorkloadRequest]:
    """SGLang's generated-shared-prefix benchmark: groups share a system prompt, questions
    differ. Requests are shuffled so groups interleave; with ``zipf`` = s, each request's
    group is drawn with Zipf(s) popularity instead (same total): a hot-spot test. Made as
    they are read: what is kept is one small integer per request (its group)."""
    rng = np.random.default_rng(seed)
    total = num_groups * prompts_per_group
    if zipf is None:
        order = rng.permutation(np.repeat(np.arange(num_groups, dtype=np.int32), prompts_per_group))
    else:
        weights = 1 / np.arange(1, num_groups + 1, dtype=np.float64) ** zipf
        order = rng.choice(num_groups, size=total, p=weights / weights.sum()).astype(np.int32)
    asked = np.zeros(num_groups, dtype=np.int64)  # questions each group has had so far
    for g in order.tolist():
        system = (_key("sys", seed, g), system_prompt_len)
        question = (_key("q", seed, g, int(asked[g])), question_len)
        asked[g] += 1
        yield WorkloadRequest((system, question), output_len, group=f"g{g}", vocab=vocab)


def new_prefix_rounds(
    rounds: int,
    rate: float,
    seed_of: Callable[[int], int],
    arrivals: Callable[..., list[WorkloadRequest]] = poisson_arrivals,
    gap_s: float = 5.0,
) -> list[WorkloadRequest]:
    """The peers bench's shared-prefix cell (8 new prefixes of 512 tokens x 15 questions of 64,
    16 tokens out) ``rounds`` times, ``gap_s`` apart, as a long-lived router meets it: round k's
    prompts and arrival times seeded ``seed_of(k)``, timed by ``arrivals(requests, rate, seed)``."""
    requests: list[WorkloadRequest] = []
    start = 0.0
    for k in range(rounds):
        one = shared_prefix(
            num_groups=8,
            prompts_per_group=15,
            system_prompt_len=512,
            question_len=64,
            output_len=16,
            seed=seed_of(k),
        )
        requests += [_with(r, arrival_s=r.arrival_s + start) for r in arrivals(one, rate, seed=seed_of(k))]
        start = requests[-1].arrival_s + gap_s
    return requests


def no_sharing(
    num_requests: int = 1024,
    prompt_len: int = 2176,
    output_len: int = 256,
    vocab: int = DEFAULT_VOCAB,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """The control: nothing is shared, so routing can only balance load."""
    return [
        WorkloadRequest(((_key("solo", seed, i), prompt_len),), output_len, group=f"r{i}", vocab=vocab)
        for i in range(num_requests)
    ]


def multi_turn(
    num_sessions: int = 64,
    turns: int = 6,
    system_prompt_len: int = 512,
    user_len: int = 128,
    answer_len: int = 128,
    think_s: float = 10.0,
    session_rate: float = 1.0,
    vocab: int = DEFAULT_VOCAB,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Conversations: each turn's prompt is the whole history (system, users, answers) plus
    a new user message. Sessions start at Poisson ``session_rate``; turns ``think_s`` apart."""
    rng = random.Random(seed)
    requests, start = [], 0.0
    for s in range(num_sessions):
        start += rng.expovariate(session_rate)
        history: list[Segment] = [(_key("sys", seed, s % 8), system_prompt_len)]  # 8 shared system prompts
        for t in range(turns):
            history.append((_key("user", seed, s, t), user_len))
            answer = (_key("answer", seed, s, t), answer_len)
            at = start + t * think_s * rng.uniform(0.5, 1.5)
            requests.append(
                WorkloadRequest(
                    tuple(history), answer_len, at, group=f"s{s}", session=f"s{s}", answer=answer, vocab=vocab
                )
            )
            history.append(answer)
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def mooncake(path: str | Path = MOONCAKE_TRACE, **kwargs: Any) -> list[WorkloadRequest]:
    """A Mooncake trace as a list in time order (``iter_mooncake``'s parameters)."""
    return sorted(iter_mooncake(path, **kwargs), key=lambda r: r.arrival_s)


def iter_mooncake(
    path: str | Path = MOONCAKE_TRACE,
    speedup: float = 1.0,
    limit: int | None = None,
    copies: int = 1,
    vocab: int = DEFAULT_VOCAB,
    block_tokens: int = MOONCAKE_BLOCK,
) -> Iterator[WorkloadRequest]:
    """Replay a Mooncake trace (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids`` of 512-token blocks): each hash id becomes one fixed 512-token segment (the
    last one cut to the input length), so prompts share exactly what the trace shares.
    ``speedup`` divides the timestamps. Read line by line as consumed (a stream in time
    order needs the trace in time order, as Mooncake's are). ``copies`` > 1 plays the trace again after itself that many times, each
    copy with its own hash ids (new content, the same sharing pattern): a longer run from
    a short trace. ``limit`` caps the requests of all copies together. ``block_tokens`` < 512
    shrinks every block (and the input lengths with them) to fit a small machine: the
    sharing stays the trace's."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace {str(path)!r} does not exist")
    if speedup <= 0 or copies <= 0 or not 0 < block_tokens <= MOONCAKE_BLOCK:
        raise ValueError(
            f"speedup and copies must be positive and block_tokens in [1, {MOONCAKE_BLOCK}], "
            f"got {speedup}, {copies} and {block_tokens}"
        )
    span_ms, id_space = _trace_extent(path) if copies > 1 else (0.0, 0)
    made = 0
    for copy in range(copies):
        for n, row in enumerate(_trace_rows(path)):
            if limit is not None and made >= limit:
                return
            ids, length = [h + copy * id_space for h in row["hash_ids"]], row["input_length"]
            if not ids or length <= 0 or length > len(ids) * MOONCAKE_BLOCK:
                raise ValueError(f"{path.name}:{n + 1}: input_length {length} does not fit {len(ids)} blocks")
            last = length - MOONCAKE_BLOCK * (len(ids) - 1)  # the last block's share of the input
            segments = [(_key("mooncake", h), block_tokens) for h in ids[:-1]]
            segments.append((_key("mooncake", ids[-1]), max(1, last * block_tokens // MOONCAKE_BLOCK)))
            arrival_ms = row["timestamp"] + copy * span_ms
            yield WorkloadRequest(
                tuple(segments),
                max(1, row["output_length"]),
                arrival_ms / 1000 / speedup,
                group=f"h{ids[0]}",
                vocab=vocab,
            )
            made += 1


def _trace_rows(path: Path) -> Iterator[dict]:
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as f:
        for line in f:
            yield json.loads(line)


def _trace_extent(path: Path) -> tuple[float, int]:
    """(how long a copy lasts in ms: the trace's span plus one mean gap, ids one copy uses)."""
    first = last = None
    rows = top = 0
    for row in _trace_rows(path):
        first = row["timestamp"] if first is None else first
        last = row["timestamp"]
        top = max(top, *row["hash_ids"]) if row["hash_ids"] else top
        rows += 1
    span = (last - first) if rows else 0.0
    return span + (span / max(1, rows - 1)), top + 1


def conversations(requests: Sequence[WorkloadRequest]) -> list[list[WorkloadRequest]]:
    """``multi_turn``'s requests grouped by session, turns in order (for closed-loop chat)."""
    by_session: dict[str, list[WorkloadRequest]] = {}
    for r in sorted(requests, key=lambda r: r.arrival_s):
        by_session.setdefault(r.session, []).append(r)
    return list(by_session.values())


def infinite_cache_hit_rate(requests: Sequence[WorkloadRequest], block_size: int) -> float:
    """The ceiling: prefix hits of an infinite cache replayed in arrival order (prompt and
    generated blocks become hittable after each request; a prompt's last block never hits)."""
    seen: set[int] = set()
    hit = total = 0
    for r in sorted(requests, key=lambda r: r.arrival_s):
        tokens = r.tokens()
        hashes = block_hashes(tokens, block_size, 0)
        lookable = (len(tokens) - 1) // block_size
        depth = 0
        while depth < lookable and hashes[depth] in seen:
            depth += 1
        hit += depth * block_size
        total += len(tokens)
        seen.update(block_hashes(tokens + r.answer_tokens(), block_size, 0))
    return hit / total if total else 0.0


WORKLOADS = {
    "shared_prefix": shared_prefix,
    "no_sharing": no_sharing,
    "multi_turn": multi_turn,
    "zipf": lambda **kw: shared_prefix(zipf=kw.pop("zipf", 1.1), **kw),
    "mooncake": mooncake,
}


STREAMS = {
    "shared_prefix": iter_shared_prefix,
    "zipf": lambda **kw: iter_shared_prefix(zipf=kw.pop("zipf", 1.1), **kw),
}


def make_workload(name: str, **kwargs) -> list[WorkloadRequest]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name](**kwargs)


def make_stream(name: str, **kwargs) -> Iterator[WorkloadRequest]:
    """A generated workload as a stream in its order (made as read where it can be; the
    others are built whole first)."""
    if name in STREAMS:
        return STREAMS[name](**kwargs)
    return iter(make_workload(name, **kwargs))
