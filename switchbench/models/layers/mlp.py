"""The dense two-layer ReLU MLP, with dropout on its hidden layer in training."""

import torch
from torch import Tensor, nn

from switchbench.models.config import ModelConfig
from switchbench.models.layers.initialization import init_projection_


class DenseMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        init_projection_(self.up.weight, cfg.d_model, cfg.n_layers)
        init_projection_(self.down.weight, cfg.d_ff, cfg.n_layers)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> tuple[Tensor, float]:
        return self.down(self.dropout(torch.relu(self.up(x)))), 0.0
