"""Parameter counts of a configuration, split the way the paper matches them: per layer, attention + MLP."""

from functools import cache

import torch

from switchbench.models.attention_xl import UNMATCHED
from switchbench.models.config import ModelConfig
from switchbench.models.lm import LanguageModel, count_parameters


@cache
def parameter_counts(cfg: ModelConfig) -> dict:
    """Counts of a language model of ``cfg``, built on the meta device (no memory, any size)."""
    with torch.device("meta"):
        model = LanguageModel(cfg.replace(causal=True))
    block = model.stack.blocks[0]
    # XL biases and logit scales are learned but not among the weights the paper matches
    unmatched = sum(p.numel() for n, p in block.attn.named_parameters() if n.rsplit(".", 1)[-1] in UNMATCHED)
    attention, mlp = count_parameters(block.attn) - unmatched, count_parameters(block.mlp)
    return {
        "total": count_parameters(model),
        "embedding": count_parameters(model.stack.embedding),
        "head": count_parameters(model.head),
        "layers": cfg.n_layers,
        "per_layer": {
            "attention": attention,
            "mlp": mlp,
            "attention_plus_mlp": attention + mlp,
            "layer_norms": count_parameters(block.ln_attn) + count_parameters(block.ln_mlp),
            "xl_bias_and_scale": unmatched,
        },
    }
