"""The authors' initialisation: std = sqrt(2 / L) / sqrt(fan_in) for every projection and router."""

import math

import torch
from torch import Tensor


@torch.no_grad()
def init_projection_(weight: Tensor, fan_in: int, n_layers: int) -> Tensor:
    """Normal init scaled for an L-layer residual stack.

    Routers are projections too (fan_in d_model); the attention output passes fan_in = H * d_head and the sigma-MoE
    output experts N_E * G.
    """
    if weight.is_meta:  # no values to draw: counting and sizing build models on meta, where a draw costs 1 ms
        return weight
    return weight.normal_(0.0, math.sqrt(2.0 / n_layers) / math.sqrt(fan_in))


@torch.no_grad()
def init_equal_rows_(weight: Tensor, n_layers: int) -> Tensor:
    """The sigma-MoE router [experts, d_model]: rows rescaled to one L2 norm, then to the drawn overall std."""
    if weight.is_meta:
        return weight
    init_projection_(weight, weight.shape[-1], n_layers)
    std = weight.std()
    weight.div_(weight.norm(dim=-1, keepdim=True))
    return weight.mul_(std / weight.std())
