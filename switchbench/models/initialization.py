"""The authors' initialisation: std = sqrt(2 / L) / sqrt(fan_in) for every projection and router."""

import math

import torch
from torch import Tensor


@torch.no_grad()
def init_projection_(weight: Tensor, fan_in: int, n_layers: int) -> Tensor:
    """Normal init scaled for an L-layer residual stack; the output projection passes fan_in = H * d_head."""
    return weight.normal_(0.0, math.sqrt(2.0 / n_layers) / math.sqrt(fan_in))


@torch.no_grad()
def init_router_(weight: Tensor, n_layers: int) -> Tensor:
    """Router weight [experts, d_model]: every expert's row rescaled to the same L2 norm, overall std kept."""
    init_projection_(weight, weight.shape[-1], n_layers)
    norm = weight.std() * math.sqrt(weight.shape[-1])
    return weight.mul_(norm / weight.norm(dim=-1, keepdim=True))
