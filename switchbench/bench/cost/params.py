"""Parameter counts of a configuration, split the way the paper matches them: per layer, attention + MLP."""

from functools import cache

import torch

from switchbench.bench.command import (
    add_config_args,
    add_json,
    config_from_args,
    config_label,
    describe,
    emit,
    format_table,
)
from switchbench.models.config import ModelConfig
from switchbench.models.layers.attention_xl import UNMATCHED
from switchbench.models.lm import LanguageModel, count_parameters
from switchbench.models.presets import PRESETS


@cache
def parameter_counts(cfg: ModelConfig) -> dict:
    """Counts of a language model of ``cfg``, built on the meta device (no memory) with one layer: every layer is
    built alike, and building 100,000 took five minutes."""
    try:
        with torch.device("meta"):
            model = LanguageModel(cfg.replace(causal=True, n_layers=1))
    except RuntimeError as error:  # a weight past 2**63 bytes: torch cannot size even its meta tensor
        if "overflow" not in str(error):
            raise
        raise ValueError("a weight of this configuration passes 2**63 bytes: torch cannot size it") from None
    block = model.stack.blocks[0]
    # XL biases and logit scales are learned but not among the weights the paper matches
    unmatched = sum(p.numel() for n, p in block.attn.named_parameters() if n.rsplit(".", 1)[-1] in UNMATCHED)
    attention, mlp = count_parameters(block.attn) - unmatched, count_parameters(block.mlp)
    return {
        "total": count_parameters(model) + (cfg.n_layers - 1) * count_parameters(block),
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


def register(commands) -> None:
    presets = commands.add_parser("presets", help="the named configurations and their key hyperparameters")
    add_json(presets)
    presets.set_defaults(run=_run_presets)
    params = commands.add_parser("params", help="parameter counts of a preset or of any configuration")
    add_config_args(params)
    add_json(params)
    params.set_defaults(run=_run_params)


def _run_presets(args) -> None:
    emit([_preset_row(name, cfg) for name, cfg in PRESETS.items()], args.json)


def _run_params(args) -> None:
    cfg = config_from_args(args)
    counts = parameter_counts(cfg)
    if args.json:
        emit({"preset": args.preset, "config": cfg.to_dict(), **counts}, True)
        return
    per_layer = counts["per_layer"]
    rows = [
        {"what": "total", "parameters": counts["total"]},
        {"what": "embedding", "parameters": counts["embedding"]},
        {"what": "output head", "parameters": counts["head"]},
        {"what": f"per layer (x{counts['layers']}): attention", "parameters": per_layer["attention"]},
        {"what": "per layer: MLP", "parameters": per_layer["mlp"]},
        {"what": "per layer: attention + MLP", "parameters": per_layer["attention_plus_mlp"]},
        {"what": "per layer: LayerNorms", "parameters": per_layer["layer_norms"]},
        {"what": "per layer: XL biases u, v and logit scale", "parameters": per_layer["xl_bias_and_scale"]},
    ]
    print(f"{config_label(args.preset, cfg)}: {describe(cfg)}")
    print(format_table(rows))


def _preset_row(name: str, cfg: ModelConfig) -> dict:
    counts = parameter_counts(cfg)
    mlp = f"{cfg.mlp_experts}x{cfg.mlp_expert_size} K{cfg.mlp_k}" if cfg.mlp == "sigma_moe" else cfg.d_ff
    return {
        "preset": name,
        "model": cfg.model,
        "pos": cfg.pos,
        "d_model": cfg.d_model,
        "layers": cfg.n_layers,
        "heads": f"{cfg.n_heads}x{cfg.d_head}",
        "experts": cfg.family.describe(cfg),
        "mlp": mlp,
        "T": cfg.T,
        "C": 1 + cfg.context_blocks,
        "params": counts["total"],
        "layer_params": counts["per_layer"]["attention_plus_mlp"],
    }
