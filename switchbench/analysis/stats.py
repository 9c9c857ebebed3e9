"""Statistics of expert selections: usage, its entropy and perplexity, dead experts, V x O co-occurrence, and
the tokens each expert prefers. Inputs are expert indices [N, k] of one router (one layer, head and side)."""

import math

import torch
from torch import Tensor


def usage(experts: Tensor, n_experts: int) -> Tensor:
    """How often each expert is selected: [E] counts over all N tokens and k choices."""
    return torch.bincount(experts.reshape(-1), minlength=n_experts)


def entropy(counts: Tensor) -> float:
    """Entropy (nats) of the usage distribution; 0 when one expert takes everything."""
    p = counts.double() / counts.sum()
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def perplexity(counts: Tensor) -> float:
    """exp(entropy): the number of equally used experts that would give the same entropy."""
    return math.exp(entropy(counts))


def dead_experts(counts: Tensor) -> list[int]:
    return [e for e, c in enumerate(counts.tolist()) if c == 0]


def cooccurrence(v_experts: Tensor, o_experts: Tensor, n_experts: int) -> Tensor:
    """[E, E] counts of (V expert, O expert) pairs chosen for the same token, one per pair of choices."""
    pairs = v_experts[:, :, None] * n_experts + o_experts[:, None, :]  # [N, k_v, k_o]
    return torch.bincount(pairs.reshape(-1), minlength=n_experts * n_experts).view(n_experts, n_experts)


def token_preferences(
    experts: Tensor, tokens: Tensor, n_experts: int, top: int = 5, min_count: int = 20
) -> list:
    """For each expert, the tokens most over-represented among its choices: (expert, token, lift, share, count)
    rows, best first. share = P(expert | token), the fraction of the token's occurrences that chose the expert;
    lift = share / P(expert), its ratio to the expert's rate over all tokens (1: no preference). Only lifts above
    1 of (expert, token) pairs seen at least min_count times are ranked: a rare pair's lift is noise."""
    vocab = int(tokens.max()) + 1 if tokens.numel() else 0
    k = experts.shape[1]
    pairs = experts * vocab + tokens[:, None].expand(-1, k)
    joint = torch.bincount(pairs.reshape(-1), minlength=n_experts * vocab).view(n_experts, vocab).double()
    seen = torch.bincount(tokens, minlength=vocab).double()
    share = joint / seen.clamp(min=1)
    lift = share / (joint.sum(1, keepdim=True) / len(tokens)).clamp(min=1e-12)
    lift = torch.where(joint >= max(min_count, 1), lift, torch.zeros(()))
    rows = []
    for e in range(n_experts):
        for token in lift[e].argsort(descending=True)[:top].tolist():
            if lift[e, token] > 1:
                rows.append((e, token, float(lift[e, token]), float(share[e, token]), int(joint[e, token])))
    return rows
