"""Sigmoid top-k expert selection (SwitchHead, sigma-MoE) and its optional entropy regulariser."""

import math

import torch
from torch import Tensor


def sigmoid_topk(logits: Tensor, k: int, expert_dropout: float = 0.0) -> tuple[Tensor, Tensor]:
    """logits [..., E] -> (scores [..., E], experts [..., k]); a chosen expert's gate is its score, a sigmoid,
    not renormalised.

    Expert dropout (training only, by the caller) hides a random subset of experts from the selection.
    """
    scores = torch.sigmoid(logits)
    candidates = scores
    if expert_dropout > 0:
        candidates = scores.masked_fill(torch.rand_like(scores) < expert_dropout, float("-inf"))
    return scores, candidates.topk(k, dim=-1, sorted=False).indices


def full_precision(logits: Tensor) -> Tensor:
    """Router logits in at least float32, so that under mixed precision the top-k and the gates are not rounded
    to bf16 or fp16."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def entropy_regularizer(logits: Tensor) -> Tensor:
    """Minus the entropy of the softmax of logits [B, N, E] averaged over N, then averaged over B.

    SwitchHead pools each sequence's tokens and heads (B sequences, N = tokens x heads); the sigma-MoE MLP pools
    the whole batch (B = 1).
    """
    log_p = torch.log_softmax(full_precision(logits), dim=-1)
    mean_log_p = torch.logsumexp(log_p, dim=1) - math.log(logits.shape[1])  # [B, E]
    return (mean_log_p.exp() * mean_log_p).sum(-1).mean()
