"""The position scheme of a configuration: Transformer-XL relative positions or RoPE."""

from torch import nn

from .attention_rope import RoPEAttention
from .attention_xl import XLAttention
from .config import ModelConfig


def positional_attention(cfg: ModelConfig, n_kv_heads: int) -> nn.Module:
    """The softmax attention of ``cfg.pos`` for keys with ``n_kv_heads`` heads."""
    if cfg.pos == "xl":
        return XLAttention(cfg.d_model, n_kv_heads, cfg.d_head, cfg.n_layers)
    return RoPEAttention()
