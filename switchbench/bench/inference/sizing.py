"""What serving a model holds and reads, counted from its declaration: the KV cache per token, the bytes one decoded
token reads (the floor of a decode step, where memory bandwidth bounds it), the largest batch a memory holds, and a
lower bound of a prefill's peak (to refuse a case before it runs, never to size one).

Conventions: the model runs in one dtype (weights and cache, as served); a decode step reads every weight once,
except the embedding (its B rows), XL's position projection (a decoder projects the distances once, into a table
it slices at every step) and expert weights: the experts its B tokens are expected to use where each token's slots
fall uniformly over the experts, n (1 - (1 - s / n)^B) of n experts with s slots a token (s at batch 1; at batch
16 a 262M SwitchAll reads two thirds more than its tokens' own experts would). It reads the whole cache of its
batch and, with XL positions, the projected distances of its window (one table per layer, shared by the batch).
"""

import functools

import torch

from switchbench.models import family as registry
from switchbench.models.config import ModelConfig
from switchbench.models.layers.kv_cache import elements_per_token
from switchbench.models.lm import LanguageModel, count_parameters

# The conventions above, as a run's metadata records them (decode --resume continues only a run counted alike)
BYTES_READ = "every weight once but the embedding's other rows and XL's position projection; experts expected of B tokens"


def kv_bytes_per_token(cfg: ModelConfig, width: int) -> int | None:
    """Bytes one token leaves in the cache of the whole stack (``width`` bytes per number); None: no decode path."""
    declared = cfg.family.kv_cache
    return None if declared is None else elements_per_token(declared(cfg), cfg.n_layers) * width


@functools.cache
def _meta_model(cfg: ModelConfig) -> LanguageModel:
    with torch.device("meta"):
        return LanguageModel(cfg)


def position_table_bytes(cfg: ModelConfig, distances: int, width: int) -> int:
    """XL: the projected encodings of ``distances`` distances, every layer (RoPE: none)."""
    if cfg.pos != "xl":
        return 0
    layers = _meta_model(cfg).stack.blocks
    return sum(block.attn.attention.pos_proj.out_features for block in layers) * distances * width


def _expert_cases(cfg: ModelConfig) -> dict[str, dict[tuple[int, int, int], int]]:
    """The expert weights of one layer by sub-layer ("attn", "mlp") and shape (experts, d_in, d_out) -> the slots
    one token fills. Kept apart by sub-layer: an attention's and an MLP's experts may share a shape (tiny SwitchAll:
    SwitchHead's V and the sigma-MoE's up are both 8 x 64 x 16, with 4 and 2 slots)."""
    return {
        part: {(c.n_experts, c.d_in, c.d_out): c.slots for c in owner.expert_matmuls(cfg, 1)}
        for part, owner in registry.expert_owners(cfg).items()
        if owner.expert_matmuls
    }


def weights_read(cfg: ModelConfig, batch: int) -> int:
    """Numbers of the weights one decode step of ``batch`` tokens reads (see the module's conventions)."""
    model, slots = _meta_model(cfg), _expert_cases(cfg)
    total = count_parameters(model) - model.stack.embedding.weight.numel() + batch * cfg.d_model
    if cfg.pos == "xl":
        total -= sum(count_parameters(block.attn.attention.pos_proj) for block in model.stack.blocks)
    unread = 0.0
    for block in model.stack.blocks:
        for part, cases in slots.items():
            for p in getattr(block, part).parameters():
                if p.dim() == 3 and tuple(p.shape) in cases:  # [experts, d_in, d_out]
                    n = p.shape[0]
                    unread += n * (1 - cases[tuple(p.shape)] / n) ** batch * p.shape[1] * p.shape[2]
    return total - round(unread)


def weight_bytes(cfg: ModelConfig, width: int) -> int:
    return count_parameters(_meta_model(cfg)) * width


def decode_bytes(cfg: ModelConfig, batch: int, context: int, width: int) -> int:
    """Bytes one decode step reads at ``context`` cached tokens: the weights, the batch's cache (its own entries
    included) and, with XL positions, the distances of its window."""
    keys = context + 1
    cache = batch * keys * kv_bytes_per_token(cfg, width)
    return weights_read(cfg, batch) * width + cache + position_table_bytes(cfg, keys, width)


def max_batch(cfg: ModelConfig, context: int, memory: int, width: int) -> int:
    """The most sequences of ``context`` tokens whose caches fit ``memory`` beside the weights (and XL's table), as
    a serving engine sizes its cache; activations are left out, so it is an upper bound."""
    free = memory - weight_bytes(cfg, width) - position_table_bytes(cfg, context, width)
    return max(0, free // (context * kv_bytes_per_token(cfg, width)))


def peak_bytes(cfg: ModelConfig, batch: int, capacity: int, chunk: int, width: int) -> int:
    """A lower bound of what a prefill in chunks of ``chunk`` tokens holds: the weights, the cache, XL's table, one
    chunk's attention scores (a few [B, H, chunk, capacity] maps where the explicit softmax runs) and its logits."""
    maps = 3 * batch * cfg.n_heads * chunk * capacity * width if cfg.pos == "xl" else 0
    logits = batch * chunk * cfg.vocab * 4
    cache = batch * capacity * kv_bytes_per_token(cfg, width)
    return weight_bytes(cfg, width) + cache + position_table_bytes(cfg, capacity, width) + maps + logits
