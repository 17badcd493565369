"""Token-level distillation divergences between a student and a teacher over one vocabulary.

Every function takes logits of the same shape (..., V), student first, and returns the divergence
per position (...), in float32 (float64 for float64 logits); the caller masks and reduces. Logits
are divided by `temperature` before the softmax, as in TRL's GKDTrainer.

    forward_kl(s, t)        KL(p_T || p_S) = sum_v p_T (log p_T - log p_S)   mean-seeking (SFT on soft labels)
    reverse_kl(s, t)        KL(p_S || p_T) = sum_v p_S (log p_S - log p_T)   mode-seeking
    generalized_jsd(s, t, beta)
                            beta KL(p_T || M) + (1 - beta) KL(p_S || M),  M = beta p_T + (1 - beta) p_S

`generalized_jsd` is TRL's definition (GKD, Agarwal et al. 2024, arXiv:2306.13649, eq. 1, as in
`trl.experimental.gkd.GKDTrainer.generalized_jsd_loss`), including its two end points: beta = 0 is
the forward KL and beta = 1 the reverse KL. Those are *definitions*, not limits: the mixture
formula itself goes to 0 at both ends (JSD_beta ~ beta * KL(p_T || p_S) as beta -> 0 and
~ (1 - beta) * KL(p_S || p_T) as beta -> 1), so dividing by beta (or 1 - beta) recovers them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

DivergenceFn = Callable[..., Tensor]


def _log_probs(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ: teacher and student must share a vocabulary"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    work = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    student = F.log_softmax(student_logits.to(work) / temperature, dim=-1)  # (..., V)
    teacher = F.log_softmax(teacher_logits.to(work) / temperature, dim=-1)  # (..., V)
    return student, teacher


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(p || q) over the last dim from log-probabilities; 0 * log 0 counts as 0."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)  # (...)


def forward_kl(student_logits: Tensor, teacher_logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """KL(p_teacher || p_student) per position: (..., V) x2 -> (...)."""
    student, teacher = _log_probs(student_logits, teacher_logits, temperature)
    return _kl(teacher, student)


def reverse_kl(student_logits: Tensor, teacher_logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """KL(p_student || p_teacher) per position: (..., V) x2 -> (...)."""
    student, teacher = _log_probs(student_logits, teacher_logits, temperature)
    return _kl(student, teacher)


def generalized_jsd(
    student_logits: Tensor, teacher_logits: Tensor, *, beta: float = 0.5, temperature: float = 1.0
) -> Tensor:
    """Generalised Jensen-Shannon divergence per position (see the module docstring): (..., V) x2 -> (...)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    student, teacher = _log_probs(student_logits, teacher_logits, temperature)
    if beta == 0.0:
        return _kl(teacher, student)
    if beta == 1.0:
        return _kl(student, teacher)
    # log M = logsumexp(log p_T + log beta, log p_S + log(1 - beta)), stable for tiny probabilities
    mixture = torch.logaddexp(teacher + math.log(beta), student + math.log1p(-beta))  # (..., V)
    return beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)


DISTILL_LOSSES: dict[str, DivergenceFn] = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "jsd": generalized_jsd,
}
