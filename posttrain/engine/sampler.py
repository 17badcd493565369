"""The batched sampler: one step's logits -> one token (and its logprob) per row, under each row's
`SamplingParams` (posttrain/engine/sampling_params.py).

Order of operations, per row (each step reads the previous step's output):

1. penalties, on the raw logits:
   - repetition (HF / vLLM): for every token seen in prompt + output so far, a positive logit is
     divided by `repetition_penalty`, a negative one multiplied by it;
   - frequency and presence (OpenAI / vLLM), output tokens only:
     `logit -= frequency_penalty * count + presence_penalty * (count > 0)`.
2. min_tokens: while fewer than `min_tokens` tokens have been generated, `stop_token_ids` and the
   EOS ids get logit -inf. With `ignore_eos=True` EOS does not end the sequence, so it is not
   masked either (it is an ordinary token then); `stop_token_ids` still are.
3. temperature: `logits / temperature`; temperature 0 means greedy and divides by 1.
4. the logprob distribution: `log_softmax` of the result over the FULL vocabulary.
5. filters: top-k, then top-p (on the top-k-renormalised distribution, as HF and vLLM do), then
   min-p. They only decide which tokens may be drawn.
6. the draw: from the filtered, renormalised distribution; `argmax` of step 3 when temperature is 0.

Logprobs (the paragraph the README quotes):

    The logprob reported for a sampled token is log_softmax(z / T)[token], where z are the logits
    after repetition / presence / frequency penalties and the min_tokens mask, and T is the request's
    temperature (T = 1 when temperature is 0, i.e. greedy requests report log_softmax(z)). It is
    taken over the full vocabulary, BEFORE top-k / top-p / min-p truncation, so it is the policy's
    own temperature-scaled distribution: exactly what an RL trainer recomputes from a forward pass
    with the same temperature. Truncation changes which tokens can be drawn, not the number
    reported; the sampling distribution is the renormalised truncation of it. Penalties and the
    min_tokens mask are part of the reported distribution, so a trainer that recomputes
    log_softmax(logits / T) sees the same numbers only when no penalty is set and min_tokens is 0.
    Top logprobs (`logprobs=k`) come from the same distribution.

Randomness: each row's draw uses exactly one uniform number, which inverts the CDF of its
filtered distribution. A seeded request has its own `torch.Generator` (`make_generator`) and its
uniform comes from there; unseeded rows share torch's default generator. Everything else is
row-local arithmetic (a softmax per row, fixed-size block sums, per-row top-k / top-p), so a seeded
row's tokens depend only on its logits, its params, its history and its seed, not on the other
rows in the batch (checked bitwise on CPU in the tests). On a GPU a reduction kernel may order
its sums differently for another batch shape; a token can then only change when the uniform
lands within fp32 rounding of a CDF step, and the logits of a batched forward pass are not
batch-invariant in the first place.

On CPU, a batch whose rows all draw without filters (no top-k / top-p / min-p, no greedy row) does
steps 4 and 6 in one pass over each row in C (posttrain/kernels/sampler.c, where the
kernels are built): the same inversion with the same uniforms, over exp(z - max) unnormalised, and the
logprob as z - max - log(sum) (within 1e-6 of log_softmax in fp64). It sums in another order than the
PyTorch draw, so the two can pick different tokens only where a uniform falls within rounding of a CDF
step (about 1 row in 200 at 49152 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from posttrain import kernels
from posttrain.engine.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator for a seeded request. It draws one number per step, so a CPU
    generator (the default) is right even when the logits are on a GPU: no kernel launch per
    seeded row. For n > 1, seed child i with `seed + i` (vLLM's convention) so the samples differ.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # any Python int; torch wants 64 bits
    return generator


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence at this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    eos_token_ids: set[int] = field(default_factory=set)

    def banned_token_ids(self) -> list[int]:
        """Token ids masked at this step because min_tokens has not been reached yet."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return []
        banned = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            banned |= self.eos_token_ids
        return sorted(banned)


@dataclass
class SampleOutput:
    """One step's draw. `top_logprobs` is None unless some row asked for `logprobs=k>0`; then it
    holds one list per row ([] for rows that did not ask), most likely first."""

    token_ids: torch.Tensor  # (S,) int64
    logprobs: torch.Tensor  # (S,) fp32, log_softmax(z / T)[token], see the module docstring
    top_logprobs: list[list[tuple[int, float]]] | None = None


# ---------------------------------------------------------------------------------------------
# Pure tensor functions: each is one step of the pipeline above, testable on its own.
# ---------------------------------------------------------------------------------------------


def _flat_indices(logits: torch.Tensor, token_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token ids as indices into logits.view(-1), padded to one length, and which
    entries are real. Padding repeats the row's first id, so a value computed from the logit a
    pad points at is the value the real entry writes there; an empty row pads with id 0, so
    its writes must be the old values. Ids outside [0, V) are dropped: they cannot be
    generated, so there is nothing to penalise (as in HF). Returns (R, L) int64, (R, L) bool."""
    vocab_size = logits.shape[-1]
    rows = [[t for t in ids if 0 <= t < vocab_size] for ids in token_ids]
    length = max(1, max(len(ids) for ids in rows))
    padded = [ids + [ids[0] if ids else 0] * (length - len(ids)) for ids in rows]
    valid = [[True] * len(ids) + [False] * (length - len(ids)) for ids in rows]
    offsets = torch.arange(len(rows), device=logits.device)[:, None] * vocab_size  # (R, 1)
    index = torch.tensor(padded, dtype=torch.long, device=logits.device) + offsets  # (R, L)
    return index, torch.tensor(valid, dtype=torch.bool, device=logits.device)


def apply_penalties_(
    logits: torch.Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """In place: repetition penalty on tokens seen in prompt or output (HF / vLLM), then
    presence and frequency penalties on output tokens (OpenAI / vLLM):
    `z = (z / r if z > 0 else z * r) - presence * (count > 0) - frequency * count`.
    Works on the seen ids only, O(R * L) rather than O(R * V). A row with penalties 1, 0, 0 (or
    no ids) is left exactly as it was. logits (R, V) contiguous, penalties (R,). Returns logits."""
    flat = logits.view(-1)  # (R * V,)

    # Repeated ids (and pads) write identical values, so the order of writes is moot.
    seen, seen_valid = _flat_indices(logits, [p + o for p, o in zip(prompt_token_ids, output_token_ids)])
    old = flat[seen]  # (R, L)
    rep = repetition_penalty[:, None]  # (R, 1)
    repeated = torch.where(old < 0, old * rep, old / rep)  # 0 stays 0
    flat[seen] = torch.where(seen_valid[:, :1], repeated, old)  # (R, L), empty rows unchanged

    out, out_valid = _flat_indices(logits, output_token_ids)
    old = flat[out]  # (R, Lo)
    flat[out] = torch.where(out_valid[:, :1], old - presence_penalty[:, None], old)  # once per id
    # once per occurrence, pads add nothing: count * frequency in all
    flat.index_put_((out.view(-1),), (-frequency_penalty[:, None] * out_valid).view(-1), accumulate=True)
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """`apply_penalties_` on a copy. logits (R, V) -> (R, V)."""
    return apply_penalties_(
        logits.contiguous().clone(),
        prompt_token_ids,
        output_token_ids,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
    )


# Row sums over a long vocabulary go through fixed blocks of columns.
SUM_BLOCK = 1024


def _block_sums(weights: torch.Tensor) -> torch.Tensor:
    """Sums over consecutive blocks of columns (the last may be short). Every output is summed
    the same way whatever the number of rows; a plain row sum is not (with one row, torch splits
    a long sum across threads), and a seeded row must not depend on its batch.
    weights (R, V) -> (R, ceil(V / block))."""
    rows, vocab_size = weights.shape
    block = min(SUM_BLOCK, vocab_size)
    full_blocks = vocab_size // block
    sums = weights[:, : full_blocks * block].reshape(rows, full_blocks, block).sum(-1)  # (R, B)
    if vocab_size % block:
        tail = weights[:, full_blocks * block :].sum(-1, keepdim=True)  # (R, 1)
        sums = torch.cat([sums, tail], dim=1)
    return sums


# Each filter keeps the tokens whose logit is >= a per-row threshold. The sampler zeroes the
# draw weights below each threshold in turn; the `apply_*` forms are the same rules as
# logits -> logits, for callers and for tests against HF's warpers.


def _rows_where(mask: torch.Tensor) -> torch.Tensor | None:
    """Row indices where mask (R,) is true; None when it is true everywhere (use all rows)."""
    return None if bool(mask.all()) else mask.nonzero().squeeze(1)


def top_k_threshold(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Each row's k-th largest logit; -inf where k <= 0 or k >= V (off). Ties with the k-th are
    kept, as in HF. logits (R, V), top_k (R,) int -> (R, 1)."""
    vocab_size = logits.shape[-1]
    threshold = torch.full((logits.shape[0], 1), float("-inf"), device=logits.device)  # (R, 1)
    active = (top_k > 0) & (top_k < vocab_size)  # (R,)
    if not bool(active.any()):
        return threshold
    rows = _rows_where(active)
    sub, k = (logits, top_k) if rows is None else (logits[rows], top_k[rows])  # (A, V), (A,)
    kth = sub.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # (A, 1)
    if rows is None:
        return kth
    threshold[rows] = kth
    return threshold


# Top-p needs the tokens in probability order, but a full sort of a 49k vocabulary is many
# times slower than a top-256. Most rows reach mass p within their first few hundred tokens, so
# order that many and widen only the rows that do not.
_TOP_P_CANDIDATES = (256, 4096, 16384)


def top_p_threshold(logits: torch.Tensor, top_p: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Smallest logit of the nucleus: a token is kept when the probability mass of the tokens
    ranked above it is < p, so the shortest prefix with mass >= p survives (always the top
    token). The distribution is `weights` normalised (default softmax(logits)); the sampler
    passes the probabilities it already has, zeroed where top-k removed tokens, which is the
    renormalised distribution HF and vLLM apply top-p to. -inf where p >= 1 (off).
    logits (R, V), top_p (R,) in (0, 1], weights (R, V) >= 0 -> (R, 1)."""
    vocab_size = logits.shape[-1]
    threshold = torch.full((logits.shape[0], 1), float("-inf"), device=logits.device)  # (R, 1)
    active = top_p < 1  # (R,)
    if not bool(active.any()):
        return threshold
    pending = _rows_where(active)  # (A,) rows still to resolve; None = all of them
    logits, top_p = (logits, top_p) if pending is None else (logits[pending], top_p[pending])
    weights = (
        torch.softmax(logits, dim=-1) if weights is None else (weights if pending is None else weights[pending])
    )  # (A, V)
    pending = torch.arange(logits.shape[0], device=logits.device) if pending is None else pending
    total = _block_sums(weights).sum(dim=-1, keepdim=True)  # (A, 1)
    mass_wanted = top_p[:, None] * total  # (A, 1)
    unresolved = torch.arange(len(pending), device=logits.device)  # (U,) into the A rows
    for width in (*[w for w in _TOP_P_CANDIDATES if w < vocab_size], vocab_size):
        candidates, order = weights[unresolved].topk(width, dim=-1)  # (U, W), most likely first
        mass_through = candidates.cumsum(dim=-1)  # (U, W), mass of ranks <= i
        mass_above = torch.nn.functional.pad(mass_through[:, :-1], (1, 0))  # (U, W), ranks < i
        wanted = mass_wanted[unresolved]  # (U, 1)
        keep_count = (mass_above < wanted).sum(dim=-1, keepdim=True)  # (U, 1), >= 1
        last_kept = order.gather(1, keep_count - 1)  # (U, 1), token id
        # A row whose first `width` tokens already hold mass >= p keeps none past them.
        done = ((mass_through[:, -1:] >= wanted) | (width == vocab_size))[:, 0]  # (U,)
        threshold[pending[unresolved[done]]] = logits[unresolved[done]].gather(1, last_kept[done])
        unresolved = unresolved[~done]
        if unresolved.numel() == 0:
            break
    return threshold


def min_p_threshold(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Probability >= min_p * top probability, in logit space: max_logit + log(min_p);
    -inf where min_p is 0. logits (R, V), min_p (R,) -> (R, 1)."""
    return logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]


def _mask_below(logits: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """logits (R, V), top_k (R,) int (0 / -1 = off) -> (R, V), -inf outside each row's top k."""
    return _mask_below(logits, top_k_threshold(logits, top_k))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits (R, V), top_p (R,) -> (R, V), -inf outside each row's nucleus."""
    return _mask_below(logits, top_p_threshold(logits, top_p))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits (R, V), min_p (R,) -> (R, V), -inf where p < min_p * max p."""
    return _mask_below(logits, min_p_threshold(logits, min_p))


# The draw inverts the CDF in two levels: per-block sums, pick a block, then a token inside it.
# A full cumsum over (R, V) costs a pass as slow as the softmax; block sums are a few times cheaper.


def sample_from_weights(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one index per row with probability proportional to `weights` (>= 0, unnormalised,
    some > 0), by inverting the CDF at `uniforms` in [0, 1). Zero-weight tokens are never drawn.
    weights (R, V) fp32, uniforms (R,) -> (R,) int64."""
    vocab_size = weights.shape[-1]
    block = min(SUM_BLOCK, vocab_size)
    # The search runs in fp64 on small tensors: finer than fp32's 2^-24 steps in the uniforms.
    block_cdf = _block_sums(weights).double().cumsum(-1)  # (R, B)
    total = block_cdf[:, -1:]  # (R, 1)
    target = uniforms.double()[:, None] * total  # (R, 1)
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))  # < total
    chosen_block = torch.searchsorted(block_cdf, target, right=True)  # (R, 1), has weight > 0
    mass_before = torch.where(
        chosen_block > 0, block_cdf.gather(1, (chosen_block - 1).clamp(min=0)), torch.zeros_like(target)
    )  # (R, 1)
    columns = chosen_block * block + torch.arange(block, device=weights.device)  # (R, blk)
    inside = columns < vocab_size  # (R, blk), the last block may be short
    block_weights = weights.gather(1, columns.clamp(max=vocab_size - 1)) * inside  # (R, blk)
    inside_cdf = block_weights.double().cumsum(-1)  # (R, blk)
    # Block sums and this cumsum round differently; keep the offset strictly inside the block.
    inside_total = inside_cdf[:, -1:]
    offset = torch.minimum(target - mass_before, torch.nextafter(inside_total, torch.zeros_like(inside_total)))
    position = torch.searchsorted(inside_cdf, offset, right=True)  # (R, 1)
    return (chosen_block * block + position).squeeze(1)  # (R,)


# ---------------------------------------------------------------------------------------------
# The batched sampler.
# ---------------------------------------------------------------------------------------------


class SamplingWorkspace:
    """Reusable scratch buffers for `sample`. An (S, V) fp32 tensor is 100 MB at S=512, V=49152;
    allocating it fresh each step costs more than the arithmetic on CPU (page faults), so the
    engine keeps one workspace and passes it to every call. Buffers only grow."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        numel = shape[0] * shape[1]
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.device != device:
            buffer = torch.empty(numel, dtype=torch.float32, device=device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)


def sample(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    workspace: SamplingWorkspace | None = None,
    native_kernels: bool = True,
) -> SampleOutput:
    """Draw one token per row: steps 1-6 of the module docstring, vectorised over rows.
    logits (S, V) fp32, one `SamplingRow` per row; `logits` is not modified. Pass the same
    `workspace` every step to avoid re-allocating (S, V) buffers. `native_kernels`: the plain draw may take
    posttrain.kernels' one-pass sampler (EngineConfig.cpu_kernels)."""
    if len(rows) != logits.shape[0]:
        raise ValueError(f"sample: {logits.shape[0]} rows of logits but {len(rows)} SamplingRows")
    logits = logits.float()
    device = logits.device
    workspace = workspace or SamplingWorkspace()
    scaled = _scaled_logits(logits, rows, workspace)  # (S, V), steps 1-3
    greedy = [j for j, row in enumerate(rows) if row.params.is_greedy]
    filtered = [j for j, row in enumerate(rows) if row.params.has_filters and not row.params.is_greedy]
    if native_kernels and not greedy and not filtered and kernels.samples_on_cpu(scaled):
        # Steps 4 and 6 in one pass over each row in C (sampler.c): the same inversion of the CDF with the
        # same uniforms, without writing the (S, V) softmax.
        token_ids, logprobs = kernels.sample_rows(scaled, _uniforms(rows, device), SUM_BLOCK)
        return SampleOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=_top_logprobs(scaled, rows))
    probs = workspace.get("probs", tuple(scaled.shape), device)  # (S, V)
    torch.ops.aten._softmax.out(scaled, -1, False, out=probs)  # step 4, exponentiated

    if len(greedy) == len(rows):  # no draw, no random numbers used
        token_ids = scaled.max(dim=-1).indices  # (S,), first max like argmax, and faster on CPU
    else:
        uniforms = _uniforms(rows, device)  # (S,) fp64
        every_row_filtered = len(filtered) == len(rows)
        if filtered:  # step 5: zero the draw weights of the tokens the filters remove
            index = torch.tensor(filtered, device=device)
            # Filtering leaves the kept tokens' probabilities as they are and the drawn token
            # is always kept, so zeroing inside `probs` itself keeps the logprobs below right.
            weights = probs if every_row_filtered else probs[index]  # (F, V)
            _zero_filtered_(
                weights, scaled if every_row_filtered else scaled[index], [rows[j].params for j in filtered]
            )
        token_ids = sample_from_weights(probs, uniforms)  # (S,), step 6
        if filtered and not every_row_filtered:  # redraw with the same uniforms: one per row
            token_ids[index] = sample_from_weights(weights, uniforms[index])
        if greedy:
            index = torch.tensor(greedy, device=device)
            token_ids[index] = scaled[index].max(dim=-1).indices

    # log(softmax) at the drawn token. Drawn tokens have probability far above fp32's normal
    # range (1e-38), so this matches log_softmax to rounding.
    logprobs = probs.gather(1, token_ids[:, None]).squeeze(1).log()  # (S,)
    return SampleOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=_top_logprobs(scaled, rows))


def _uniforms(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row, the only randomness in a draw: from the row's own
    generator when it has one (so its draws do not depend on the batch), else from torch's
    default generator. fp64, so the draw resolves probabilities far below fp32's 2^-24. (S,)"""
    seeded = [j for j, row in enumerate(rows) if row.generator is not None]
    if not seeded:
        return torch.rand(len(rows), dtype=torch.float64, device=device)
    uniforms = torch.empty(len(rows), dtype=torch.float64, device=device)
    unseeded = [j for j, row in enumerate(rows) if row.generator is None]
    if unseeded:
        uniforms[torch.tensor(unseeded, device=device)] = torch.rand(len(unseeded), dtype=torch.float64, device=device)
    draws = [
        torch.rand(1, dtype=torch.float64, generator=rows[j].generator, device=rows[j].generator.device) for j in seeded
    ]
    uniforms[torch.tensor(seeded, device=device)] = torch.cat(draws).to(device)
    return uniforms


def _zero_filtered_(weights: torch.Tensor, logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Step 5 in place: zero the weights of the tokens top-k, then top-p, then min-p remove.
    weights (F, V) the probabilities, logits (F, V) the scaled logits they came from."""
    device = logits.device
    if any(p.top_k > 0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=device)
        weights.masked_fill_(logits < top_k_threshold(logits, top_k), 0.0)
    if any(p.top_p < 1 for p in params):  # on what top-k kept, renormalised
        top_p = torch.tensor([p.top_p for p in params], device=device)
        weights.masked_fill_(logits < top_p_threshold(logits, top_p, weights), 0.0)
    if any(p.min_p > 0 for p in params):  # relative to the top token, which every filter keeps
        min_p = torch.tensor([p.min_p for p in params], device=device)
        weights.masked_fill_(logits < min_p_threshold(logits, min_p), 0.0)


def _scaled_logits(logits: torch.Tensor, rows: list[SamplingRow], workspace: SamplingWorkspace) -> torch.Tensor:
    """Steps 1-3: penalties, min_tokens mask, temperature. Returns `logits` itself when there is
    nothing to do (temperature 1 or greedy, no penalty, no mask), else a workspace buffer."""
    device = logits.device
    vocab_size = logits.shape[-1]
    temperatures = [row.params.temperature or 1.0 for row in rows]  # greedy divides by 1
    any_penalty = any(row.params.has_penalties for row in rows)
    banned = [(j, token) for j, row in enumerate(rows) for token in row.banned_token_ids() if token < vocab_size]
    same_temperature = all(t == temperatures[0] for t in temperatures)
    unit_temperature = same_temperature and temperatures[0] == 1.0
    if unit_temperature and not any_penalty and not banned:
        return logits

    scaled = workspace.get("scaled", tuple(logits.shape), device)  # (S, V)
    divisor = (
        temperatures[0] if same_temperature else torch.tensor(temperatures, device=device)[:, None]
    )  # scalar or (S, 1)
    if any_penalty:  # penalties come before temperature
        scaled.copy_(logits)
        params = [row.params for row in rows]  # rows without penalties have the neutral 1, 0, 0
        apply_penalties_(
            scaled,
            [row.prompt_token_ids if row.params.has_penalties else [] for row in rows],
            [row.output_token_ids if row.params.has_penalties else [] for row in rows],
            *(
                torch.tensor([getattr(p, name) for p in params], device=device)
                for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")
            ),
        )
        if not unit_temperature:
            scaled.div_(divisor)
    else:
        torch.div(logits, divisor, out=scaled)
    if banned:
        row_index, token_index = zip(*banned)
        scaled[torch.tensor(row_index, device=device), torch.tensor(token_index, device=device)] = float("-inf")
    return scaled


def _top_logprobs(scaled: torch.Tensor, rows: list[SamplingRow]) -> list[list[tuple[int, float]]] | None:
    """The k most likely tokens of log_softmax(scaled) for rows with logprobs=k > 0."""
    asking = [j for j, row in enumerate(rows) if row.params.num_top_logprobs]
    if not asking:
        return None
    ks = [min(rows[j].params.num_top_logprobs, scaled.shape[-1]) for j in asking]
    index = torch.tensor(asking, device=scaled.device)
    values, ids = torch.log_softmax(scaled[index], dim=-1).topk(max(ks), dim=-1)  # (A, kmax)
    values, ids = values.tolist(), ids.tolist()
    result: list[list[tuple[int, float]]] = [[] for _ in rows]
    for a, (j, k) in enumerate(zip(asking, ks)):
        result[j] = list(zip(ids[a][:k], values[a][:k]))
    return result


# ---------------------------------------------------------------------------------------------
# The pieces of `sample` for callers that draw by their own rule (speculative decoding's acceptance
# test, posttrain/engine/speculative): the same distributions, without the draw.
# ---------------------------------------------------------------------------------------------


def draw_probabilities(
    logits: torch.Tensor, rows: list[SamplingRow], workspace: SamplingWorkspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-5 of the module docstring. Returns (scaled (S, V): the logits whose log_softmax is the reported
    logprob distribution, possibly a `workspace` buffer; probs (S, V): the distribution `sample` draws each row
    from, normalised: softmax(scaled) with the filtered tokens removed, or for greedy rows all mass on the
    token `sample` would pick). logits (S, V) is not modified."""
    if len(rows) != logits.shape[0]:
        raise ValueError(f"draw_probabilities: {logits.shape[0]} rows of logits but {len(rows)} SamplingRows")
    scaled = _scaled_logits(logits.float(), rows, workspace or SamplingWorkspace())  # (S, V)
    probs = torch.softmax(scaled, dim=-1)  # (S, V)
    device = scaled.device
    filtered = [j for j, row in enumerate(rows) if row.params.has_filters and not row.params.is_greedy]
    if filtered:
        index = torch.tensor(filtered, device=device)
        weights = probs[index]  # (F, V), a copy
        _zero_filtered_(weights, scaled[index], [rows[j].params for j in filtered])
        probs[index] = weights / weights.sum(dim=-1, keepdim=True)
    greedy = [j for j, row in enumerate(rows) if row.params.is_greedy]
    if greedy:
        index = torch.tensor(greedy, device=device)
        chosen = scaled[index].max(dim=-1).indices  # (G,), the token `sample` picks
        probs[index] = 0.0
        probs[index, chosen] = 1.0
    return scaled, probs


def reported_logprobs(
    scaled: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor
) -> tuple[torch.Tensor, list[list[tuple[int, float]]] | None]:
    """The logprobs `sample` reports for tokens drawn by another rule: log_softmax(scaled)[token] per row, and
    the top logprobs of rows with logprobs=k > 0. scaled (S, V) from `draw_probabilities`, token_ids (S,)."""
    logprobs = torch.log_softmax(scaled, dim=-1).gather(1, token_ids[:, None]).squeeze(1)  # (S,)
    return logprobs, _top_logprobs(scaled, rows)
