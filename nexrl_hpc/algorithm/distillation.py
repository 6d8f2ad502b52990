"""On-policy distillation: per-token advantages from a teacher's log-probs of the student's samples.

The student samples as in RL; a frozen teacher scores every sampled token. ``log pi_student(y_t) -
log pi_teacher(y_t)`` is a one-sample estimate of the reverse KL at that token, so its negative is a
dense, per-token advantage: the policy-gradient step raises the tokens the teacher likes more than
the student does and lowers the others, on the student's own outputs. The task reward's advantage
can be mixed in (``reward_coef``).
"""

from __future__ import annotations

import torch

from nexrl_hpc.config.schema import OPDConfig


def distillation_advantages(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    reward_advantages: torch.Tensor,
    kl_coef: float,
    reward_coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``-kl_coef * (log pi_s - log pi_t) + reward_coef * A_reward`` per response token, 0 off the mask.

    All inputs are ``[rows, response_len]``; ``reward_advantages`` is the processor's (a sequence's
    advantage broadcast over its tokens). Returns the advantages and the reverse-KL statistics.
    """
    mask = response_mask.to(torch.float32)
    reverse_kl = (student_log_probs.float() - teacher_log_probs.float()) * mask
    advantages = (-kl_coef * reverse_kl + reward_coef * reward_advantages.float()) * mask
    tokens = mask.sum().clamp(min=1.0)
    rows = mask.sum(-1) > 0
    per_sequence = reverse_kl.sum(-1)
    stats = {
        "train/opd_reverse_kl": float(reverse_kl.sum() / tokens),  # per token
        "train/opd_reverse_kl_seq": float(per_sequence[rows].mean()) if rows.any() else 0.0,
        "train/opd_teacher_log_prob": float((teacher_log_probs.float() * mask).sum() / tokens),
        "train/opd_advantage_mean": float(advantages.sum() / tokens),
    }
    return advantages, stats


def use_teacher_log_probs(
    tensors: dict[str, torch.Tensor], teacher_log_probs: torch.Tensor, opd: OPDConfig
) -> dict[str, float]:
    """The batch's advantages become the distillation advantages (``algorithm.opd``) of its old
    log-probs against the teacher's; returns the reverse-KL statistics."""
    tensors["advantages"], metrics = distillation_advantages(
        tensors["old_log_probs"],
        teacher_log_probs,
        tensors["response_mask"],
        tensors["advantages"],
        opd["kl_coef"],
        opd["reward_coef"],
    )
    return metrics
