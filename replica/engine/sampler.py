"""Token selection for one step, in vLLM V1's order.

1. Log-probabilities for the requests that ask for them, from the raw logits (before
   temperature, penalties and filters: vLLM V1's default, "raw_logprobs").
2. Logit adjustments: ``min_tokens`` (EOS and stop token ids forbidden until then),
   ``logit_bias``, then the repetition, frequency and presence penalties.
3. Greedy rows take the argmax; the rest are divided by their temperature, filtered by
   ``min_p``, top-k and top-p, and drawn all at once (``_race``): a request with a seed
   draws from its own ``torch.Generator``, so it gets the same tokens whatever else shares
   its batch; the rest share the engine's generator.
Only rows that need a stage pay for it.

A request whose own stage fails (its adjustments raise, or they leave no token to pick, as
``min_tokens`` does when every token is a stop id) gets a ``FailedPick`` in its row
instead of a token: it ends alone and every other row is picked as it would have been.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvmesh.replica.models.transfer import to_device
from kvmesh.serving.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvmesh.replica.engine.request import Request


class FailedPick(Exception):
    """A request that failed in a step, in its row where its pick would be: it ends alone, the
    rest of the batch goes on.
    ``engine_fault``: the step failed for every request, so the engine is at fault, not it."""

    def __init__(self, message: str, engine_fault: bool = False):
        super().__init__(message)
        self.engine_fault = engine_fault


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability, its rank (1: the most likely), and, best first, the ``k``
    most likely alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


def logprobs_of(log_probs: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """Row i of ``log_probs`` ([rows, vocab]) scored for ``token_ids[i]``, with its top ``k``."""
    ids = to_device(token_ids, torch.long, log_probs.device)
    chosen = log_probs.gather(1, ids[:, None])
    ranks = ((log_probs > chosen).sum(dim=-1) + 1).tolist()
    top_values, top_ids = log_probs.topk(k, dim=-1) if k else (log_probs[:, :0], log_probs[:, :0].long())
    return [
        TokenLogprob(t, lp, rank, tuple(zip(i, v, strict=True)))
        for t, lp, rank, i, v in zip(
            token_ids, chosen[:, 0].tolist(), ranks, top_ids.tolist(), top_values.tolist(), strict=True
        )
    ]


@dataclass
class RowAdjustments:
    """What one request's row changes in a step's logits, gathered on the host: the ids
    ``min_tokens`` forbids, its logit bias, and, for the penalties, its prompt's distinct
    tokens (on the device, found once a request) and its output so far, tallied."""

    params: SamplingParams
    banned: list[int]
    bias: dict[int, float]
    prompt_ids: torch.Tensor | None  # distinct prompt tokens, for the repetition penalty
    output_counts: dict[int, int]  # output token -> times sampled


def row_adjustments(request: Request, device: torch.device) -> RowAdjustments:
    """A request's part of a step's adjustments (its own failure stays its own)."""
    p = request.params
    below_min = p.min_tokens and request.num_completion_tokens < p.min_tokens
    prompt_ids = None
    if p.repetition_penalty != 1.0:
        prompt_ids = request.sampling_tensors.get("prompt_ids")
        if prompt_ids is None:
            prompt_ids = to_device(sorted(set(request.prompt_token_ids)), torch.long, device)
            request.sampling_tensors["prompt_ids"] = prompt_ids
    counts = {}
    if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
        counts = _output_counts(request)
    return RowAdjustments(p, sorted(request.stop_ids) if below_min else [], p.logit_bias, prompt_ids, counts)


def _output_counts(request: Request) -> dict[int, int]:
    """Its output tokens' tally, brought up to date with the tokens since the last step."""
    counts, tallied = request.sampling_tensors.get("output_counts", ({}, 0))
    for token in request.completion_token_ids[tallied:]:
        counts[token] = counts.get(token, 0) + 1
    request.sampling_tensors["output_counts"] = (counts, request.num_completion_tokens)
    return counts


def adjust_logits(logits: torch.Tensor, rows: dict[int, RowAdjustments]) -> torch.Tensor:
    """Logits ([rows, vocab]) after min_tokens, logit bias, then the repetition, frequency and
    presence penalties (vLLM's formulas), for the rows ``rows`` names, all at once, in place.
    Only the entries a rule names are read and written, never the whole matrix."""
    device, dtype = logits.device, logits.dtype

    def pairs(entries: dict[int, list | dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, ids) of every entry's tokens as index tensors, and a dict entry's values."""
        at_rows, at_ids, values = [], [], []
        for row, entry in entries.items():
            for token in entry:
                at_rows.append(row)
                at_ids.append(token)
                if isinstance(entry, dict):
                    values.append(entry[token])
        return (
            to_device(at_rows, torch.long, device),
            to_device(at_ids, torch.long, device),
            to_device(values, dtype, device),
        )

    def per_row(name: str, default: float) -> torch.Tensor:
        values = [getattr(rows[i].params, name) if i in rows else default for i in range(len(logits))]
        return to_device(values, dtype, device)

    banned_rows, banned_ids, _ = pairs({i: r.banned for i, r in rows.items()})
    logits[banned_rows, banned_ids] = float("-inf")
    bias_rows, bias_ids, bias = pairs({i: r.bias for i, r in rows.items()})
    logits.index_put_((bias_rows, bias_ids), bias, accumulate=True)
    out_rows, out_ids, counts = pairs({i: r.output_counts for i, r in rows.items()})
    repeated = [i for i, r in rows.items() if r.prompt_ids is not None]
    if repeated:  # a token seen twice (prompt and output) gets the same value written twice
        lengths = [rows[j].prompt_ids.numel() for j in repeated]
        prompt_rows = torch.repeat_interleave(
            to_device(repeated, torch.long, device),
            to_device(lengths, torch.long, device),
            output_size=sum(lengths),
        )
        repetition = per_row("repetition_penalty", 1.0)
        keep = repetition[out_rows] != 1.0
        at_rows = torch.cat([prompt_rows, out_rows[keep]])
        at_ids = torch.cat([*(rows[j].prompt_ids for j in repeated), out_ids[keep]])
        penalty, values = repetition[at_rows], logits[at_rows, at_ids]
        logits[at_rows, at_ids] = torch.where(values > 0, values / penalty, values * penalty)
    penalties = (
        per_row("frequency_penalty", 0.0)[out_rows] * counts + per_row("presence_penalty", 0.0)[out_rows]
    )
    return logits.index_put_((out_rows, out_ids), -penalties, accumulate=True)


Pick = tuple[int, TokenLogprob | None]  # a sampled token and, where asked, its log-probability


def sample(
    logits: torch.Tensor, requests: list[Request], generator: torch.Generator | None = None
) -> list[Pick | FailedPick]:
    """One pick per row of ``logits`` ([rows, vocab], float32), or the row's own failure;
    rows without a seed of their own draw from ``generator``."""
    failed: dict[int, FailedPick] = {}
    wants = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    raw = logits[wants].log_softmax(dim=-1) if wants else None
    token_list = draw(logits, requests, failed, generator).tolist()
    scored: list[TokenLogprob | None] = [None] * len(requests)
    if raw is not None:
        for j, i in enumerate(wants):
            if i not in failed:
                k = requests[i].params.logprobs
                found = _isolated(failed, i, logprobs_of, raw[j : j + 1], [token_list[i]], k)
                scored[i] = found[0] if found else None
    return [failed.get(i) or (token_list[i], scored[i]) for i in range(len(requests))]


def drawn_on_device(params: SamplingParams) -> bool:
    """Whether a request's tokens are drawn with no host sync (async scheduling needs that):
    no log-probabilities to read back, no adjustment that reads its tokens so far."""
    return params.logprobs is None and params.prompt_logprobs is None and not params.adjusts_logits


def draw(
    logits: torch.Tensor,
    requests: list[Request],
    failed: dict[int, FailedPick],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The rows' tokens, on the device; a row whose own stage fails is recorded in ``failed``
    (its entry in the result is then meaningless). Rows without a seed of their own draw from
    ``generator``. ``logits`` are consumed (adjusted in place). Syncs with the host only for
    rows that ``min_tokens`` holds back (to fail one left with no token)."""
    adjusted = [i for i, r in enumerate(requests) if r.params.adjusts_logits]
    if adjusted:
        parts = {i: _isolated(failed, i, row_adjustments, requests[i], logits.device) for i in adjusted}
        parts = {i: part for i, part in parts.items() if i not in failed}
        adjust_logits(logits, parts)
        _fail_rows_without_tokens(logits, [i for i, part in parts.items() if part.banned], failed)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, r in enumerate(requests) if not r.params.greedy and i not in failed]
    if rows:
        probs = _filtered_probs(logits[rows], [requests[i].params for i in rows])
        drawn = _race(probs, [requests[i].generator for i in rows], generator)
        tokens.index_copy_(0, to_device(rows, torch.long, tokens.device), drawn)
    return tokens


def _race(probs: torch.Tensor, generators: list[torch.Generator | None], shared: torch.Generator | None):
    """One token per row drawn from ``probs``, all rows at once: the token whose probability
    over an exponential draw is largest is a draw from the distribution (the Gumbel-max
    trick in its exponential form, as vLLM samples). A row with its own generator (a request
    with a seed) draws its noise from it, so a seed gives the same tokens whatever shares the
    batch; the rest share ``shared``."""
    uniform = torch.empty_like(probs).uniform_(generator=shared)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row].uniform_(generator=generator)
    # -log(u) is an exponential draw; u is kept off 0, where a row's only allowed token would
    # score 0 like the ruled-out ones and argmax would take the first of those.
    return probs.div_(uniform.clamp_(min=torch.finfo(uniform.dtype).tiny).log_().neg_()).argmax(dim=-1)


def _isolated(failed: dict[int, FailedPick], row: int, fn, *args, **kwargs):
    """``fn(*args)``, or None with the row's failure recorded when it raises."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # this request's stage failed: the batch goes on without it
        failed[row] = FailedPick(f"sampling failed: {exc}")
        return None


def _fail_rows_without_tokens(logits: torch.Tensor, rows: list[int], failed: dict) -> None:
    """Rows whose adjustments ruled out every token have nothing to pick (a multinomial over
    them fails, and on CUDA that is a device-side assert that poisons the context)."""
    if not rows:
        return
    has_token = torch.isfinite(logits[rows]).any(dim=-1).tolist()
    for i, ok in zip(rows, has_token, strict=True):
        if not ok:
            failed[i] = FailedPick("no token is left to sample: min_tokens rules out every token id")


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of temperature-scaled logits after per-row min-p, top-k and top-p filtering."""
    device = logits.device
    temperature = to_device([p.temperature for p in params], torch.float32, device)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    if any(p.min_p > 0 for p in params):  # decided on the host: no device sync
        min_p = to_device([p.min_p for p in params], torch.float32, device)
        probs = logits.softmax(dim=-1)
        too_unlikely = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(too_unlikely, float("-inf"))
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in top_ks) or any(p.top_p < 1 for p in params):
        top_k = to_device(top_ks, torch.long, device)
        top_p = to_device([p.top_p for p in params], torch.float32, device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        drop = rank >= top_k[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest head whose mass reaches top_p: drop a token once the mass
        # before it already does (the first token always stays).
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(dim=-1)
