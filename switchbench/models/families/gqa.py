"""GQA, grouped-query attention (Ainslie et al. 2023; Llama 2/3, Mistral): H query heads share n_kv_heads key and
value heads, each serving a group of H / n_kv_heads; MQA (Shazeer 2019) is n_kv_heads = 1.

With RoPE the heads go to scaled-dot-product attention's grouped path (``enable_gqa``), which reads each key head
for its group without copying it. Transformer-XL's relative positions, and the maps the routing analysis asks
for, need the explicit softmax: there the query heads of a group are stacked against their key head in one matmul
(no key or value head is repeated, as Llama's reference code repeats them: a decoder reads n_kv_heads heads of
cache, not H), and the positions are projected per query head, as the dense model does.

Presets are parameter-matched to the dense rows, as the paper matches its models: the K and V weights GQA saves,
2 d_model (H - n_kv_heads) d_head per layer, go to the MLP, d_ff + (H - n_kv_heads) d_head, so that attention plus
MLP weights per layer are equal.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from switchbench.models.config import ModelConfig, in_range
from switchbench.models.cost import Cost, layer_inputs, o_input, softmax_attention, symbols
from switchbench.models.families.dense import DenseAttention
from switchbench.models.family import Family, register
from switchbench.models.layers.kv_cache import CacheEntry


@dataclass(frozen=True)
class Options:
    n_kv_heads: int = field(
        default=1,
        metadata={"help": "key and value heads, each shared by n_heads / n_kv_heads query heads; 1: MQA"},
    )

    def __post_init__(self):
        in_range("n_kv_heads", self.n_kv_heads, 1)


def validate(cfg: ModelConfig) -> None:
    if cfg.n_heads % cfg.opts.n_kv_heads:
        raise ValueError(f"n_heads ({cfg.n_heads}) must be a multiple of n_kv_heads ({cfg.opts.n_kv_heads})")


class GroupedQueryAttention(DenseAttention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, n_kv_heads=cfg.opts.n_kv_heads)


def kv_cache(cfg: ModelConfig) -> tuple[CacheEntry, ...]:
    """The key and value heads only: what GQA is for."""
    Hk = cfg.opts.n_kv_heads
    return (CacheEntry("k", Hk, cfg.d_head, "shared keys"), CacheEntry("v", Hk, cfg.d_head, "shared values"))


def exact_cost(cfg: ModelConfig) -> Cost:
    """Q and O as dense; K and V of n_kv_heads heads over the window, kept once (SDPA's grouped path with RoPE, the
    grouped matmuls with XL); with XL, the dense model's position projection (one per query head) and extras."""
    H, dh, dm, T, C = symbols(cfg)
    S, Hk = C * T, cfg.opts.n_kv_heads
    projections = Cost(
        T * dm * H * dh + 2 * S * dm * Hk * dh + T * H * dh * dm, layer_inputs(cfg) + o_input(cfg)
    )
    if cfg.pos == "rope":
        return projections + softmax_attention(cfg, Hk)
    # Stacking a group's queries copies them when they are laid out token-major (several tokens): the copy is kept
    # in their stead, and beside them where the position term keeps the same queries (no extras)
    copied = T * H * dh if 1 < Hk < H and T > 1 and not cfg.xl_bias_and_scale else 0
    extras = 2 if cfg.xl_bias_and_scale else 0
    return projections + softmax_attention(cfg, Hk, extras, position_heads=H) + Cost(0, copied)


# Parameter-matched presets: the dense row, and its key-value heads (GQA; MQA has one)
KV_HEADS = {
    "c4-47m-transformer-h10": 2,
    "c4-262m-transformer-h16": 4,
    "wikitext103-45m-transformer-h10": 2,
    "wikitext103-244m-transformer-h16": 4,
    "tiny-transformer": 2,
    "tiny-transformer-rope": 2,
    "listops-transformer-h8": 2,
    "bytes-920k-transformer-h4": 2,
}


def matched(dense: ModelConfig, n_kv_heads: int) -> ModelConfig:
    """GQA with the attention + MLP weights per layer of ``dense``: the saved K, V weights go to the MLP."""
    d_ff = dense.d_ff + (dense.n_heads - n_kv_heads) * dense.d_head
    return dense.replace(model="gqa", d_ff=d_ff, options={"n_kv_heads": n_kv_heads})


def preset_name(dense_name: str, n_kv_heads: int) -> str:
    """c4-47m-transformer-h10 -> c4-47m-gqa-h10-kv2 (or c4-47m-mqa-h10 with one key-value head)."""
    if n_kv_heads == 1:
        return dense_name.replace("transformer", "mqa")
    return re.sub(r"transformer(-h\d+)?", lambda m: f"gqa{m.group(1) or ''}-kv{n_kv_heads}", dense_name)


def presets(declared: Mapping[str, ModelConfig]) -> dict[str, ModelConfig]:
    return {
        preset_name(name, kv): matched(declared[name], kv)
        for name, group in KV_HEADS.items()
        for kv in (group, 1)
    }


FAMILY = register(
    Family(
        name="gqa",
        label="GQA",
        attention=GroupedQueryAttention,
        exact_cost=exact_cost,
        kv_cache=kv_cache,
        options=Options,
        validate=validate,
        describe=lambda cfg: f"kv{cfg.opts.n_kv_heads}",
        reads=("xl_bias_and_scale",),
        presets=presets,
        roles={
            "47m": preset_name("c4-47m-transformer-h10", 2),
            "262m": preset_name("c4-262m-transformer-h16", 4),
            "45m-rope": preset_name("wikitext103-45m-transformer-h10", 2),
            "244m-rope": preset_name("wikitext103-244m-transformer-h16", 4),
            "tiny": preset_name("tiny-transformer", 2),
            "tiny-rope": preset_name("tiny-transformer-rope", 2),
            "listops": preset_name("listops-transformer-h8", 2),
            "bytes": preset_name("bytes-920k-transformer-h4", 2),
            # the paper's WikiText-103 47M dense row is the C4 one's configuration
            "quality": preset_name("c4-47m-transformer-h10", 2),
        },
    )
)
