"""Sigmoid top-k expert selection (SwitchHead, sigma-MoE) and its optional entropy regulariser."""

import math

import torch
from torch import Tensor

from switchbench.core.precision import full_precision
from switchbench.ops.expert_matmul.op import routing_method, top_k_by_rank


def sigmoid_topk(logits: Tensor, k: int, expert_dropout: float = 0.0) -> tuple[Tensor, Tensor]:
    """logits [..., E] -> (scores [..., E], experts [..., k]); a chosen expert's gate is its score, a sigmoid,
    not renormalised.

    Expert dropout (training only, by the caller) hides a random subset of experts from the selection.
    """
    scores = torch.sigmoid(logits)
    candidates = scores
    if expert_dropout > 0:
        candidates = scores.masked_fill(torch.rand_like(scores) < expert_dropout, float("-inf"))
    if candidates.shape[-1] > FEW_EXPERTS:
        return scores, candidates.topk(k, dim=-1, sorted=False).indices
    method = routing_method(candidates.device.type)
    if method in RANKED:
        return scores, RANKED[method](candidates, k)
    # ties to the lower id, as the ranks give them: top-k gives them to either (the higher on the CPU), and
    # under autocast bf16 scores tie often (0.1% of token-heads picked another expert than the count's)
    return scores, candidates.sort(dim=-1, descending=True, stable=True).indices[..., :k]


# Routing without sorts (--routing count, triton) ranks up to this many experts by comparing every pair. CUDA's
# top-k over rows of four experts (SwitchHead 262M) took 11.3 of the routing's 42.6 ms in a step at batch 64 on an
# H200 (gatherTopK); torch.topk stays the reference, and auto's choice, until a GPU has timed them
FEW_EXPERTS = 8


def top_by_rank(candidates: Tensor, k: int) -> Tensor:
    """The experts of the k largest of ``candidates`` [..., E], largest first, ties to the lower id: an expert's
    rank is how many are ahead of it (larger, or equal with a lower id). O(E^2) comparisons a row, a few
    elementwise kernels of static shape."""
    E = candidates.shape[-1]
    ids = torch.arange(E, device=candidates.device)
    # NaN (a diverged router) counts as the largest, as in torch.topk, so that the ranks stay a permutation
    candidates = candidates.nan_to_num(nan=math.inf, posinf=math.inf, neginf=-math.inf)
    mine, other = candidates[..., :, None], candidates[..., None, :]  # [..., E, E]: (expert, another)
    ahead = (other > mine) | ((other == mine) & (ids < ids[:, None]))
    rank = ahead.sum(-1)  # [..., E], a permutation of 0..E-1
    return (rank[..., None, :] == ids[:k, None]).to(torch.uint8).argmax(-1)  # [..., k]: the expert of rank r


# How each sort-free routing ranks few experts: in a few elementwise kernels, or in one Triton launch
RANKED = {"count": top_by_rank, "triton": top_k_by_rank}


def entropy_regularizer(logits: Tensor) -> Tensor:
    """Minus the entropy of the softmax of logits [B, N, E] averaged over N, then averaged over B.

    SwitchHead pools each sequence's tokens and heads (B sequences, N = tokens x heads); the sigma-MoE MLP pools
    the whole batch (B = 1).
    """
    log_p = torch.log_softmax(full_precision(logits), dim=-1)
    mean_log_p = torch.logsumexp(log_p, dim=1) - math.log(logits.shape[1])  # [B, E]
    return (mean_log_p.exp() * mean_log_p).sum(-1).mean()
