"""A family defined outside the package, registered through the ``switchbench.families`` entry-point group: shared
query-key attention (the Reformer's shared-QK), each head's queries and keys one projection. Small on purpose: what
matters is that every command takes it with no change to switchbench."""

from torch import nn

from switchbench.models.config import ModelConfig
from switchbench.models.cost import Cost, o_input, softmax_attention, symbols
from switchbench.models.family import Family, register
from switchbench.models.layers.initialization import init_projection_
from switchbench.models.layers.observe import Observable
from switchbench.models.layers.positions import positional_attention
from switchbench.models.layers.window import with_memory


class SharedQKAttention(Observable, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_head
        inner = cfg.n_heads * cfg.d_head
        self.qk, self.v = nn.Linear(cfg.d_model, inner, bias=False), nn.Linear(cfg.d_model, inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        for proj in (self.qk, self.v, self.o):
            init_projection_(proj.weight, proj.in_features, cfg.n_layers)
        self.attention = positional_attention(cfg, cfg.n_heads)

    def forward(self, x, mem, window):
        B, t, _ = x.shape
        xs = with_memory(mem, x)
        k = self.qk(xs).view(B, -1, self.n_heads, self.d_head).transpose(1, 2)  # [B, H, S, D]
        q = k[:, :, -t:]  # the current tokens' keys are their queries
        v = self.v(xs).view(B, -1, self.n_heads, self.d_head).transpose(1, 2)
        out, maps = self.attention(q, k, v, window, self.observing)
        self.record(maps=maps)
        return self.o(out.transpose(1, 2).contiguous().view(B, t, -1)), 0.0


def exact_cost(cfg: ModelConfig) -> Cost:
    """QK and V over the S = C T window tokens, O over the T current ones; only the window's inputs are kept (no
    projection reads the current tokens alone)."""
    H, dh, dm, T, C = symbols(cfg)
    projections = Cost(2 * C * T * dm * H * dh + T * H * dh * dm, C * T * dm + o_input(cfg))
    return projections + softmax_attention(cfg, H)


def matched(dense: ModelConfig) -> ModelConfig:
    """The dense row's weights per layer: the saved K projection goes to the MLP."""
    return dense.replace(model="shared_qk", d_ff=dense.d_ff + dense.n_heads * dense.d_head // 2)


FAMILY = register(
    Family(
        name="shared_qk",
        label="shared QK",
        attention=SharedQKAttention,
        exact_cost=exact_cost,
        presets=lambda declared: {
            name.replace("transformer", "sharedqk"): matched(declared[name])
            for name in ("tiny-transformer", "tiny-transformer-rope", "listops-transformer-h8")
        },
        roles={"tiny": "tiny-sharedqk", "tiny-rope": "tiny-sharedqk-rope", "listops": "listops-sharedqk-h8"},
    )
)
