"""sigma-MoE MLP: N_E small ReLU MLPs of hidden size G, K of them chosen per token by a sigmoid router."""

import torch
from torch import Tensor, nn

from switchbench.core.precision import full_precision
from switchbench.models.config import ModelConfig
from switchbench.models.layers.initialization import init_equal_rows_, init_projection_
from switchbench.models.layers.observe import Observable
from switchbench.models.layers.projections import project
from switchbench.models.layers.router import entropy_regularizer, sigmoid_topk
from switchbench.ops.expert_matmul.op import expert_matmul, route


class SigmaMoE(Observable, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        E, G, d = cfg.mlp_experts, cfg.mlp_expert_size, cfg.d_model
        self.router = nn.Linear(d, E, bias=False)
        self.up = nn.Parameter(torch.empty(E, d, G))
        self.down = nn.Parameter(torch.empty(E, G, d))
        self.dropout = nn.Dropout(cfg.dropout)
        init_equal_rows_(self.router.weight, cfg.n_layers)
        init_projection_(self.up, d, cfg.n_layers)
        init_projection_(self.down, E * G, cfg.n_layers)  # N_E G: all experts' hidden units, as the authors

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | float]:
        # N tokens, E experts, K active, G expert size
        cfg = self.cfg
        B, t, d = x.shape
        x, logits = project(x, self.router, share_input=True)  # the router and the experts read x once
        logits = full_precision(logits).view(B * t, cfg.mlp_experts)  # [N, E]
        dropout = cfg.mlp_expert_dropout if self.training else 0.0
        scores, experts = sigmoid_topk(logits, cfg.mlp_k, dropout)  # [N, E], [N, K]
        routing = route(experts, cfg.mlp_experts)
        hidden = torch.relu(expert_matmul(x.reshape(B * t, 1, d), self.up, routing))  # [N, K, G]
        hidden = self.dropout(hidden)
        y = expert_matmul(hidden, self.down, routing, scores, 1).view(B, t, d)
        if self.observing:
            gates = scores.detach().gather(1, experts)
            self.record(experts=experts.view(B, t, -1), gates=gates.view(B, t, -1))
        if not cfg.mlp_entropy_reg:
            return y, 0.0
        return y, cfg.mlp_entropy_reg * entropy_regularizer(logits[None])
