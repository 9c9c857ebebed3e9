"""The position scheme of a configuration: Transformer-XL relative positions or RoPE."""

from torch import nn

from switchbench.models.config import ModelConfig
from switchbench.models.layers.attention_rope import RoPEAttention
from switchbench.models.layers.attention_xl import XLAttention
from switchbench.ops.attention import choice as attention_choice


def positional_attention(
    cfg: ModelConfig, n_kv_heads: int, global_biases: bool = False, learned_scale: bool = False
) -> nn.Module:
    """The softmax attention of ``cfg.pos`` for keys with ``n_kv_heads`` heads.

    ``global_biases`` (Transformer-XL's u, v) and ``learned_scale`` are the family's XL extras, as the authors'
    models have them (dense: both; MoA: its temperature; SwitchHead: neither); ``xl_bias_and_scale`` False turns
    them off for every family.
    """
    attention_choice.check_width(cfg.d_head, f"a {cfg.model} model")
    if cfg.pos == "xl":
        extras = cfg.xl_bias_and_scale
        return XLAttention(
            cfg.d_model,
            n_kv_heads,
            cfg.d_head,
            cfg.n_layers,
            cfg.n_heads,
            global_biases=extras and global_biases,
            learned_scale=extras and learned_scale,
        )
    return RoPEAttention()
