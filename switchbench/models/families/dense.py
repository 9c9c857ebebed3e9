"""Dense multi-head attention, the baseline of every comparison (the paper's Transformer-XL and RoPE models): per-head
Q, K, V projections and one output projection; the layer, its exact cost, the paper's convention and its presets."""

from torch import Tensor, nn

from switchbench.models.config import ModelConfig
from switchbench.models.cost import Cost, layer_inputs, o_input, printed_xl, softmax_attention, symbols
from switchbench.models.family import BYTES, Family, register
from switchbench.models.layers.initialization import init_projection_
from switchbench.models.layers.kv_cache import CacheEntry, keys_values
from switchbench.models.layers.observe import Observable
from switchbench.models.layers.positions import positional_attention
from switchbench.models.layers.window import Window, with_memory


class DenseAttention(Observable, nn.Module):
    """H query heads over ``n_kv_heads`` key and value heads (H unless given), each shared by a group of
    H / n_kv_heads query heads: dense attention, and the layer grouped-query attention specializes."""

    def __init__(self, cfg: ModelConfig, n_kv_heads: int | None = None):
        super().__init__()
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_head
        self.n_kv_heads = cfg.n_heads if n_kv_heads is None else n_kv_heads
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.d_head, bias=False)
        self.k, self.v = (nn.Linear(cfg.d_model, self.n_kv_heads * cfg.d_head, bias=False) for _ in range(2))
        self.o = nn.Linear(cfg.n_heads * cfg.d_head, cfg.d_model, bias=False)
        for proj in (self.q, self.k, self.v, self.o):
            init_projection_(proj.weight, proj.in_features, cfg.n_layers)
        self.attention = positional_attention(cfg, cfg.n_heads, global_biases=True, learned_scale=True)

    def forward(self, x: Tensor, mem: Tensor | None, window: Window) -> tuple[Tensor, float]:
        return self.attend_cached(x, self.cache_entries(with_memory(mem, x), window.k_pos), window), 0.0

    def cache_entries(self, xs: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """What the source tokens xs [B, L, d_model] at ``positions`` [L] leave in a cache: K and V [B, Hk, L, D],
        Hk = n_kv_heads heads."""
        return keys_values(self.k, self.v, self.attention, xs, positions, self.n_kv_heads, self.d_head)

    def attend_cached(self, x: Tensor, entries: tuple[Tensor, Tensor], window: Window) -> Tensor:
        """The current tokens x [B, t, d_model] attend to the cached keys and values of the window."""
        # B batch, t current tokens, H query heads, D d_head
        B, t, _ = x.shape
        q = self.q(x).view(B, t, self.n_heads, self.d_head).transpose(1, 2)  # [B, H, t, D]
        # each query head reads its group's key head, none repeated (a decoder reads Hk heads of cache)
        out, maps = self.attention(q, *entries, window, self.observing, keys_ready=True)  # [B, H, t, D]
        self.record(maps=maps)
        return self.o(out.transpose(1, 2).contiguous().view(B, t, -1))


def kv_cache(cfg: ModelConfig) -> tuple[CacheEntry, ...]:
    return (
        CacheEntry("k", cfg.n_heads, cfg.d_head, "keys"),
        CacheEntry("v", cfg.n_heads, cfg.d_head, "values"),
    )


def exact_cost(cfg: ModelConfig) -> Cost:
    """Q over the T current tokens, K and V over the S = C T window, O; the XL extras keep two more queries."""
    H, dh, dm, T, C = symbols(cfg)
    S = C * T
    projections = Cost((T + 2 * S) * dm * H * dh + T * H * dh * dm, layer_inputs(cfg) + o_input(cfg))
    kept = 2 if cfg.pos == "xl" and cfg.xl_bias_and_scale else 0  # q + u and q + v
    return projections + softmax_attention(cfg, H, kept)


def paper_dense(H: int, d_head: int, d_model: int, T: int, C: int, xl: bool) -> Cost:
    """The convention behind the paper's Tables 1, 2, 3 and 7: MACs = 2 H dh T^2 C + 4 dm H dh T
    [+ 2 H dm T dh C for XL]; mem = 2 H T^2 C + 4 H dh T [+ 2 H T dh C for XL]."""
    macs = 2 * H * d_head * T * T * C + 4 * d_model * H * d_head * T
    mem = 2 * H * T * T * C + 4 * H * d_head * T
    if xl:
        macs += 2 * H * d_model * T * d_head * C
        mem += 2 * H * T * d_head * C
    return Cost(macs, mem)


def paper_cost(cfg: ModelConfig, C: int | None = None) -> Cost:
    """The published tables' convention for ``cfg``; ``C`` overrides 1 + context_blocks."""
    H, dh, dm, T, C_cfg = symbols(cfg)
    return paper_dense(H, dh, dm, T, C_cfg if C is None else C, cfg.pos == "xl")


def printed_cost(cfg: ModelConfig) -> Cost | None:
    return printed_xl(*symbols(cfg)) if cfg.pos == "xl" else None


FAMILY = register(
    Family(
        name="transformer",
        label="dense",
        attention=DenseAttention,
        exact_cost=exact_cost,
        kv_cache=kv_cache,
        attention_name="dense",
        reads=("xl_bias_and_scale",),
        paper_cost=paper_cost,
        printed_cost=printed_cost,
        presets=lambda declared: {
            "bytes-920k-transformer-h4": ModelConfig(
                **BYTES, model="transformer", n_heads=4, d_head=32, d_ff=512
            )
        },
        roles={
            "47m": "c4-47m-transformer-h10",
            "262m": "c4-262m-transformer-h16",
            "45m-rope": "wikitext103-45m-transformer-h10",
            "244m-rope": "wikitext103-244m-transformer-h16",
            "tiny": "tiny-transformer",
            "tiny-rope": "tiny-transformer-rope",
            "listops": "listops-transformer-h8",
            "bytes": "bytes-920k-transformer-h4",
            "quality": "wikitext103-47m-transformer-h10",
        },
    )
)
