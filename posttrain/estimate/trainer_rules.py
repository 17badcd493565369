"""What each trainer puts through the model per micro-batch, and what its loss head keeps.

One `TrainerRules` per trainer (`TRAINERS`): the rows through the decoder, whether the LM head runs on
the target positions, the loss head's tensors, a scalar head trained beside the trunk, the rollout and
the no-grad passes besides the trained forward. memory.py and compute.py read these rules; every rule
restates what the trainer's code does (the function named in each docstring), and tests/estimate/test_estimate.py
checks the loss heads against the tensors autograd saves, tensor by tensor.

Shapes: B `--batch`, R rows and T row width through the decoder, N target positions (through the LM
head), d hidden, V vocabulary, b bytes of the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from posttrain.estimate.inputs import Architecture, Trainer, TrainingSetup
from posttrain.trainers.packed_groups import ROW_TOKENS

SFT_LOSS_CHUNK_ROWS = 1024  # chunked_cross_entropy's default chunk (the SFT loss)
LOGPROB_CHUNK_TOKENS = 256  # token_logprobs' DEFAULT_CHUNK_TOKENS (the DPO and RL losses)
INT64, FP32, BOOL = 8, 4, 1  # bytes of the index, float and flag vectors the heads keep

Layout = Literal["rows", "scored_pairs", "packed_pairs", "groups"]


@dataclass(frozen=True)
class LossHead:
    """The loss head's memory. `saved`: what autograd keeps from the head's forward until backward (what
    the tests compare with the saved tensors); `transient`: what the head holds on top at its peak."""

    saved: int
    transient: int

    @property
    def peak(self) -> int:
        return self.saved + self.transient


@dataclass(frozen=True)
class ScalarHead:
    """A Linear(d, 1) trained in full beside the trunk, with LoRA too (a fresh head must learn)."""

    bias: bool
    fp32: bool  # RM's score head is made in fp32 (new_score_head); PPO's value head takes the model dtype
    per_target: bool  # reads every target's predicting state (PPO's values), else each row's last state (RM)

    def params(self, hidden: int) -> int:
        return hidden + int(self.bias)

    def element_bytes(self, setup: TrainingSetup) -> int:
        return 4 if self.fp32 else setup.element_bytes


@dataclass(frozen=True)
class TrainerRules:
    """How one trainer runs a micro-batch through the model (see the module docstring)."""

    batch: str  # what --batch counts, for the CLI's help
    # rows: B rows; scored_pairs (rm): one packed row per pair, each sequence whole after the shared prompt, or
    # with no prompt 2B rows, chosen then rejected; packed_pairs (dpo): one packed row per pair (a group of two);
    # groups: one packed row per group of group_size samples
    layout: Layout
    lm_head: bool  # the target positions go through the LM head (RM scores with its own head instead)
    loss_head: Callable[[Architecture, TrainingSetup], LossHead]
    scalar_head: ScalarHead | None = None
    rollout: bool = False  # a rollout engine over the policy, with its KV pool
    reference_pass: bool = False  # with --reference, a live frozen reference scores each micro-batch (no grad)
    scoring_passes: int = 0  # other no-grad forwards of each micro-batch (PPO: old log-probs and values)


def rules(setup: TrainingSetup) -> TrainerRules:
    return TRAINERS[setup.trainer]


# ----------------------------------------------------------------------------- the rows


def sequences(setup: TrainingSetup) -> int:
    """Sequences in one micro-batch: B, or 2B for preference pairs (a chosen and a rejected completion each)."""
    return setup.batch * (2 if rules(setup).layout in ("scored_pairs", "packed_pairs") else 1)


def packed_groups(setup: TrainingSetup) -> tuple[int, int, int] | None:
    """(rows, completions per row, input tokens per completion) when each row packs a prompt with several
    completions, else None. A completion's last token is no input where nothing is predicted from it (dpo,
    grpo, ppo); rm reads its score there, so its sequences go in whole (and pack only with a prompt)."""
    layout = rules(setup).layout
    if layout == "packed_pairs":
        return setup.batch, 2, setup.completion_len - 1
    if layout == "scored_pairs" and setup.prompt_len > 0:
        return setup.batch, 2, setup.completion_len
    if layout == "groups":  # cut into rows of ROW_TOKENS as the RL update packs them (trainers/packed_groups.py)
        n, inputs = min(setup.group_size, setup.batch), setup.completion_len - 1
        per_row = n
        if setup.prompt_len + n * inputs > ROW_TOKENS and setup.prompt_len + inputs <= ROW_TOKENS:
            per_row = (ROW_TOKENS - setup.prompt_len) // inputs  # >= 1: a completion fits after the prompt
        return math.ceil(setup.batch / setup.group_size) * math.ceil(n / per_row), per_row, inputs
    return None


def trunk_tokens(setup: TrainingSetup) -> tuple[int, int]:
    """(rows, row width) of one micro-batch through the decoder.

    sft: B right-padded rows of seq_len. dpo (preference.logps.collate_pairs) and grpo, ppo
    (posttrain.trainers.packed_groups): each pair / group of group_size samples is ONE row, the prompt once and
    then every completion without its last token. rm (reward_model.pair_scores): each pair ONE row, the
    shared prompt once and then both sequences' rests whole; with no prompt the B chosen rows then the B
    rejected rows, right-padded to the longest of all 2B. One forward either way."""
    packed = packed_groups(setup)
    if packed is None:
        return sequences(setup), setup.seq_len
    rows, completions, inputs = packed
    return rows, setup.prompt_len + completions * inputs


def logit_tokens(setup: TrainingSetup) -> int:
    """Positions that go through the LM head: those with a target, the completion tokens of every
    sequence. None for rm, which never runs its LM head."""
    return sequences(setup) * setup.completion_len if rules(setup).lm_head else 0


# ----------------------------------------------------------------------------- the loss heads


def _target_rows(arch: Architecture, setup: TrainingSetup, n: int) -> int:
    """The (N, d) gathered states in the model dtype, as an LM-head matmul keeps them: only when its weight
    trains (full fine-tuning). With LoRA the head is frozen and its matmul keeps only the weight."""
    return n * arch.hidden * setup.element_bytes if setup.method == "full" else 0


def _logprob_scratch(arch: Architecture, n: int) -> int:
    """token_logprobs works on (256, V) fp32 pieces of the logits, two at a time (z - lse and its exp)."""
    return 2 * min(LOGPROB_CHUNK_TOKENS, n) * arch.vocab * FP32


def sft_head(arch: Architecture, setup: TrainingSetup) -> LossHead:
    """posttrain.trainers.sft.sft_loss_sum: chunked_cross_entropy over hidden[keep].

    Kept: the (R, T) bool target mask (hidden[keep]'s backward), the (N, d) target rows (the chunked loss
    saves them itself, frozen head or not), their int64 labels, fp32 valid flags and fp32 logsumexps. The
    (N, V) logits never exist, only two fp32 (chunk, V) blocks at a time; when the LM head trains its
    gradient accumulates in a (V, d) fp32 buffer, each chunk's (V, d) product in the dtype is another, and
    in half precision that product's fp32 cast a third."""
    rows, width = trunk_tokens(setup)
    b, d, V, n = setup.element_bytes, arch.hidden, arch.vocab, logit_tokens(setup)
    saved = rows * width * BOOL + n * (d * b + INT64 + FP32 + FP32)
    head_grad = V * d * (4 + b + (4 if b != 4 else 0)) if setup.method == "full" else 0
    return LossHead(saved, 2 * min(SFT_LOSS_CHUNK_ROWS, n) * V * FP32 + head_grad)


def dpo_head(arch: Architecture, setup: TrainingSetup) -> LossHead:
    """posttrain.trainers.preference.logps.pair_logps over packed pairs: packed_forward (as rl_head, without a
    value head), then each completion's sum over its (B, L) row.

    Kept: what rl_head keeps without a value head; the sums and the chosen / rejected split keep nothing.
    The peak is the start of backward, which writes the (N, V) gradient in one piece, unless a live reference
    (--reference: DPOConfig.reference=live) runs: it scores the same pairs without grad AFTER the policy's
    forward, while all of the above is kept, and holds its final hidden states (R, T, d) and its own (N, V)
    fp32 logits. With the default reference=precompute the table of reference log-probs is made before the
    first step: nothing here. (Pairs whose rows do not share a prompt take 2B padded rows instead: not
    modelled.)"""
    rows, width = trunk_tokens(setup)
    n = logit_tokens(setup)
    logits = n * arch.vocab * FP32
    saved = _target_rows(arch, setup, n) + logits + n * (INT64 + INT64 + FP32 + BOOL + 2 * INT64)
    reference = rows * width * arch.hidden * setup.element_bytes + logits if setup.reference else 0
    return LossHead(saved, max(logits, reference) + _logprob_scratch(arch, n))


def rm_head(arch: Architecture, setup: TrainingSetup) -> LossHead:
    """posttrain.trainers.reward_model.RewardModel: each sequence's last real state, cast to fp32, times the
    fp32 score head. No LM head, no logits.

    Kept: the (2B, d) fp32 states (the head's input, for its weight's gradient) and the index that picks them:
    index_select's int64 (2B,) over packed rows (RewardModel.packed), or the advanced index's two over 2B
    rows (forward). Nothing larger exists at backward."""
    indices = 1 if packed_groups(setup) is not None else 2
    return LossHead(sequences(setup) * (indices * INT64 + arch.hidden * FP32), 0)


def rl_head(arch: Architecture, setup: TrainingSetup) -> LossHead:
    """posttrain.trainers.packed_groups.packed_forward: index_select of the N predicting states, the LM head,
    token_logprobs, and the scatter of the (N,) results into (B, L).

    Kept: index_select's int64 index; the (N, d) states when the LM head trains or a value head reads them
    (PPO: its Linear keeps its input whatever the method); the (N, V) fp32 logits; int64 labels, fp32
    logsumexps, bool valid flags; to_padded's two int64 indices (sample, position; the values' scatter
    shares them). The entropy metric runs without grad. Peak: the (N, V) gradient written in one piece at
    the start of backward. The reference and old-logprob passes run before the update: nothing of theirs
    is alive here."""
    n = logit_tokens(setup)
    value_head = rules(setup).scalar_head is not None
    states = n * arch.hidden * setup.element_bytes if value_head else _target_rows(arch, setup, n)
    logits = n * arch.vocab * FP32
    saved = states + logits + n * (INT64 + INT64 + FP32 + BOOL + 2 * INT64)
    return LossHead(saved, logits + _logprob_scratch(arch, n))


def loss_head(arch: Architecture, setup: TrainingSetup) -> LossHead:
    return rules(setup).loss_head(arch, setup)


PAIRS = "preference pairs (a chosen and a rejected row each)"
SAMPLES = "samples (completions), --group-size of them to one packed row"
TRAINERS: dict[Trainer, TrainerRules] = {
    "sft": TrainerRules("sequences", "rows", True, sft_head),
    "dpo": TrainerRules(PAIRS, "packed_pairs", True, dpo_head, reference_pass=True),
    "rm": TrainerRules(PAIRS, "scored_pairs", False, rm_head, ScalarHead(bias=False, fp32=True, per_target=False)),
    "grpo": TrainerRules(SAMPLES, "groups", True, rl_head, rollout=True, reference_pass=True),
    "ppo": TrainerRules(
        SAMPLES,
        "groups",
        True,
        rl_head,
        ScalarHead(bias=True, fp32=False, per_target=True),
        rollout=True,
        reference_pass=True,
        scoring_passes=1,
    ),
}
