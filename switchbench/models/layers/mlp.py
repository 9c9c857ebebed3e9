"""The dense two-layer ReLU MLP, with dropout on its hidden layer in training."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from switchbench.models.config import ModelConfig
from switchbench.models.layers.initialization import init_projection_

# On CUDA the hidden layer is computed in a multiple of this many units: the paper's widths (4110, 4188, 2053) give
# rows that are not 16 bytes long in bf16, and cuBLAS then runs the MLP's GEMMs on Ampere kernels for 2-element
# alignment. An H200's profile at 262M, batch 64 (eager, e3dd1c0): six such kernels a layer (the MLP's forward and
# backward GEMMs, by their count), 114 of dense's 145 ms of GEMMs, about 260 TFLOP/s for the MLP's FLOPs, where the
# 1024-wide projections ran Hopper kernels at about 480
CUDA_ROW_ELEMENTS = 8


class DenseMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        init_projection_(self.up.weight, cfg.d_model, cfg.n_layers)
        init_projection_(self.down.weight, cfg.d_ff, cfg.n_layers)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> tuple[Tensor, float]:
        up, down = self.up.weight, self.down.weight
        pad = padding(up.shape[0], x.device)
        if pad:  # zero units: ReLU(0) times a zero column adds nothing, and their rows' gradients are dropped
            up, down = F.pad(up, (0, 0, 0, pad)), F.pad(down, (0, pad))
        return F.linear(self.dropout(torch.relu(F.linear(x, up))), down), 0.0


def padding(d_ff: int, device: torch.device) -> int:
    """Zero hidden units that make ``d_ff`` a multiple of CUDA_ROW_ELEMENTS on CUDA (none elsewhere: the counters
    and the exact memory counts run on the CPU and see the MLP as configured)."""
    return -d_ff % CUDA_ROW_ELEMENTS if device.type == "cuda" else 0
