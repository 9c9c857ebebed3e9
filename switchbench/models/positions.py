"""The position scheme of a configuration: Transformer-XL relative positions or RoPE."""

from torch import nn

from .attention_rope import RoPEAttention
from .attention_xl import XLAttention
from .config import ModelConfig


def positional_attention(cfg: ModelConfig, n_kv_heads: int) -> nn.Module:
    """The softmax attention of ``cfg.pos`` for keys with ``n_kv_heads`` heads.

    With ``xl_bias_and_scale``, as in the authors' models: the dense XL attention learns u, v and its logit scale,
    MoA learns its temperature, SwitchHead keeps a fixed scale and no biases.
    """
    if cfg.pos == "xl":
        extras = cfg.xl_bias_and_scale
        return XLAttention(
            cfg.d_model,
            n_kv_heads,
            cfg.d_head,
            cfg.n_layers,
            cfg.n_heads,
            global_biases=extras and cfg.attention == "dense",
            learned_scale=extras and cfg.attention in ("dense", "moa"),
        )
    return RoPEAttention()
