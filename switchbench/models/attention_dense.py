"""Dense multi-head attention: per-head Q, K, V projections and one output projection."""

from torch import Tensor, nn

from switchbench.models.config import ModelConfig
from switchbench.models.initialization import init_projection_
from switchbench.models.observe import Observable
from switchbench.models.positions import positional_attention
from switchbench.models.window import Window, with_memory


class DenseAttention(Observable, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_head
        inner = cfg.n_heads * cfg.d_head
        self.q, self.k, self.v = (nn.Linear(cfg.d_model, inner, bias=False) for _ in range(3))
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        for proj in (self.q, self.k, self.v, self.o):
            init_projection_(proj.weight, proj.in_features, cfg.n_layers)
        self.attention = positional_attention(cfg, cfg.n_heads, global_biases=True, learned_scale=True)

    def forward(self, x: Tensor, mem: Tensor | None, window: Window) -> tuple[Tensor, float]:
        # B batch, t current tokens, S memory + current tokens, H heads, D d_head
        B, t, _ = x.shape
        xs = x if mem is None else with_memory(mem, x)  # [B, S, d_model]
        q = self.q(x).view(B, t, self.n_heads, self.d_head).transpose(1, 2)  # [B, H, t, D]
        k = self.k(xs).view(B, -1, self.n_heads, self.d_head).transpose(1, 2)  # [B, H, S, D]
        v = self.v(xs).view(B, -1, self.n_heads, self.d_head).transpose(1, 2)  # [B, H, S, D]
        out, maps = self.attention(q, k, v, window, self.observing)  # [B, H, t, D]
        self.record(maps=maps)
        return self.o(out.transpose(1, 2).contiguous().view(B, t, -1)), 0.0
