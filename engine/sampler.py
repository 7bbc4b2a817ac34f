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

Everything a step draws stays on the device (``Drawn``) until the step lands, so a step can
be launched before the last one's tokens are known (async scheduling): a row whose last
token is still being sampled by that step counts it in its penalties on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvmesh.engine.models.transfer import rows_of, to_device
from kvmesh.engine.protocol import TokenLogprob
from kvmesh.serving.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvmesh.engine.request import Request


class FailedPick(Exception):
    """A request that failed in a step, in its row where its pick would be: it ends alone, the
    rest of the batch goes on.
    ``engine_fault``: the step failed for every request, so the engine is at fault, not it."""

    def __init__(self, message: str, engine_fault: bool = False):
        super().__init__(message)
        self.engine_fault = engine_fault


def score(
    log_probs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row i of ``log_probs`` ([rows, vocab]) scored for ``token_ids[i]``, on the device: the
    token's log-probability, its rank, and the top ``k`` values and ids, best first."""
    chosen = log_probs.gather(1, token_ids[:, None])[:, 0]
    ranks = (log_probs > chosen[:, None]).sum(dim=-1) + 1
    top_values, top_ids = log_probs.topk(k, dim=-1)
    return chosen, ranks, top_values, top_ids


def token_logprobs(token_ids: list[int], scores: list[list], ks: list[int]) -> list[TokenLogprob]:
    """``score``'s results read back to the host (as lists), each row cut to its own ``k``."""
    chosen, ranks, top_values, top_ids = scores
    return [
        TokenLogprob(t, chosen[j], ranks[j], tuple(zip(top_ids[j][:k], top_values[j][:k], strict=True)))
        for j, (t, k) in enumerate(zip(token_ids, ks, strict=True))
    ]


def logprobs_of(log_probs: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """Row i of ``log_probs`` ([rows, vocab]) scored for ``token_ids[i]``, with its top ``k``."""
    scores = score(log_probs, to_device(token_ids, torch.long, log_probs.device), k)
    return token_logprobs(token_ids, [t.tolist() for t in scores], [k] * len(token_ids))


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
    """Its output tokens' tally, brought up to date with the tokens landed since the last
    step (a token still pending is counted on the device, ``adjust_logits``)."""
    counts, tallied = request.sampling_tensors.get("output_counts", ({}, 0))
    landed = request.num_completion_tokens - (request.pending_row is not None)
    for token in request.completion_token_ids[tallied:landed]:
        counts[token] = counts.get(token, 0) + 1
    request.sampling_tensors["output_counts"] = (counts, landed)
    return counts


# Rows whose last output token is still being sampled by a launched step, and those tokens
# (on the device).
PendingTokens = tuple[list[int], torch.Tensor]


def adjust_logits(
    logits: torch.Tensor, rows: dict[int, RowAdjustments], pending: PendingTokens | None = None
) -> torch.Tensor:
    """Logits ([rows, vocab]) after min_tokens, logit bias, then the repetition, frequency and
    presence penalties (vLLM's formulas), for the rows ``rows`` names, all at once, in place.
    Only the entries a rule names are read and written, never the whole matrix. ``pending``
    tokens count as output of their rows, without a host sync."""
    device, dtype, vocab = logits.device, logits.dtype, logits.shape[-1]

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

    def penalized(values: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
        return torch.where(values > 0, values / penalty, values * penalty)

    banned_rows, banned_ids, _ = pairs({i: r.banned for i, r in rows.items()})
    logits[banned_rows, banned_ids] = float("-inf")
    bias_rows, bias_ids, bias = pairs({i: r.bias for i, r in rows.items()})
    logits.index_put_((bias_rows, bias_ids), bias, accumulate=True)
    out_rows, out_ids, counts = pairs({i: r.output_counts for i, r in rows.items()})
    repetition = per_row("repetition_penalty", 1.0)
    frequency, presence = per_row("frequency_penalty", 0.0), per_row("presence_penalty", 0.0)
    repeated = [i for i, r in rows.items() if r.prompt_ids is not None]
    prompt_rows = prompt_ids = out_ids[:0]
    if repeated:
        lengths = [rows[j].prompt_ids.numel() for j in repeated]
        prompt_rows = torch.repeat_interleave(
            to_device(repeated, torch.long, device),
            to_device(lengths, torch.long, device),
            output_size=sum(lengths),
        )
        prompt_ids = torch.cat([rows[j].prompt_ids for j in repeated])
        # Every output entry too: a penalty of 1 leaves its value as it was (no mask, so no
        # sync); a token seen twice (prompt and output) gets the same value written twice.
        at_rows, at_ids = torch.cat([prompt_rows, out_rows]), torch.cat([prompt_ids, out_ids])
        logits[at_rows, at_ids] = penalized(logits[at_rows, at_ids], repetition[at_rows])
    logits.index_put_(
        (out_rows, out_ids), -(frequency[out_rows] * counts + presence[out_rows]), accumulate=True
    )
    if pending is not None and pending[0]:
        # One more output token a row (so no two writes meet): penalized for repetition if
        # its row had not seen it, charged its presence if its row had not output it yet.
        at_rows, at_ids = to_device(pending[0], torch.long, device), pending[1]
        keys = at_rows * vocab + at_ids
        output = torch.isin(keys, out_rows * vocab + out_ids)
        seen = output | torch.isin(keys, prompt_rows * vocab + prompt_ids)
        values = logits[at_rows, at_ids]
        values = torch.where(seen, values, penalized(values, repetition[at_rows]))
        logits[at_rows, at_ids] = values - frequency[at_rows] - torch.where(output, 0.0, presence[at_rows])
    return logits


Pick = tuple[int, TokenLogprob | None]  # a sampled token and, where asked, its log-probability


@dataclass
class Drawn:
    """What one step drew, on the device until the step lands (``launched.LaunchedStep``)."""

    tokens: torch.Tensor  # a token a row (meaningless in a failed row)
    failed: dict[int, FailedPick]  # rows whose own stage failed on the host
    held: list[int]  # rows min_tokens holds back: they fail if it left them no token
    held_ok: torch.Tensor  # whether each of those had a token left
    scored: list[int]  # rows that asked for log-probabilities
    ks: list[int]  # how many alternatives each of them asked for
    scores: tuple[torch.Tensor, ...]  # ``score``'s results for those rows

    def read(self, values: list[list]) -> list[Pick | FailedPick]:
        """Each row's pick or failure, from ``[tokens, held_ok, *scores]`` read back as lists."""
        tokens, held_ok, *scores = values
        failed = dict(self.failed)
        for row, ok in zip(self.held, held_ok, strict=True):
            if not ok:
                failed.setdefault(
                    row, FailedPick("no token is left to sample: min_tokens rules out every token id")
                )
        scored = {}
        if self.scored:
            found = token_logprobs([tokens[i] for i in self.scored], scores, self.ks)
            scored = dict(zip(self.scored, found, strict=True))
        return [failed.get(i) or (tokens[i], scored.get(i)) for i in range(len(tokens))]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.tokens, self.held_ok, *self.scores]


def draw(
    logits: torch.Tensor,
    requests: list[Request],
    generator: torch.Generator | None = None,
    previous_tokens: torch.Tensor | None = None,
) -> Drawn:
    """The rows' tokens, and the log-probabilities of those that ask, all on the device: no
    host sync. Rows without a seed of their own draw from ``generator``. A request whose last
    token is pending (``pending_row``) reads it from ``previous_tokens`` for its penalties.
    ``logits`` are consumed (adjusted in place)."""
    failed: dict[int, FailedPick] = {}
    scored = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    raw = rows_of(logits, scored).log_softmax(dim=-1) if scored else None
    adjusted = [i for i, r in enumerate(requests) if r.params.adjusts_logits]
    held: list[int] = []
    if adjusted:
        parts = {i: _isolated(failed, i, row_adjustments, requests[i], logits.device) for i in adjusted}
        parts = {i: part for i, part in parts.items() if i not in failed}
        pending = None
        if previous_tokens is not None:
            waiting = [i for i in parts if requests[i].pending_row is not None]
            sources = to_device([requests[i].pending_row for i in waiting], torch.long, logits.device)
            pending = (waiting, previous_tokens[sources])
        adjust_logits(logits, parts, pending)
        held = [i for i, part in parts.items() if part.banned]
    # A row min_tokens left without a token fails when the step lands (its draw below picks
    # nothing real, and asserts nothing on the device).
    held_ok = torch.isfinite(rows_of(logits, held)).any(dim=-1) if held else torch.ones(0, dtype=torch.bool)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, r in enumerate(requests) if not r.params.greedy and i not in failed]
    if rows:
        probs = _filtered_probs(rows_of(logits, rows), [requests[i].params for i in rows])
        drawn = _race(probs, [requests[i].generator for i in rows], generator)
        tokens.index_copy_(0, to_device(rows, torch.long, tokens.device), drawn)
    ks = [requests[i].params.logprobs for i in scored]
    scores = score(raw, rows_of(tokens, scored), max(ks)) if scored else ()
    return Drawn(tokens, failed, held, held_ok, scored, ks, scores)


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
