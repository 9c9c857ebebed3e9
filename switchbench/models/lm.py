"""Pre-LayerNorm Transformer stacks: a language model that carries XL memory across chunks, and a sequence
classifier (no causal mask) for ListOps. Any registered attention family composes with either MLP."""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from switchbench.core.precision import full_precision
from switchbench.models.config import ModelConfig
from switchbench.models.layers.kv_cache import KVCache, caches_inputs
from switchbench.models.layers.mlp import DenseMLP
from switchbench.models.layers.sigma_moe import SigmaMoE
from switchbench.models.layers.window import make_window, next_memory, with_memory

MLPS = {"dense": DenseMLP, "sigma_moe": SigmaMoE}


@dataclass(frozen=True)
class State:
    """What a stack carries from one call to the next: each layer's cached inputs and the position reached."""

    mems: tuple[Tensor | None, ...]
    offset: int = 0


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_attn, self.ln_mlp = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = cfg.family.attention(cfg)
        self.mlp = MLPS[cfg.mlp](cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, mem, window):
        """-> (output, this layer's window inputs before its LayerNorm, auxiliary loss).

        The memory is cached before the LayerNorm and normalised with the current one, as the authors do: the
        same in evaluation, but in training the LayerNorm also learns through the memory positions.
        """
        y, aux_attn = self.attn(self.ln_attn(x), None if mem is None else self.ln_attn(mem), window)
        window_inputs = with_memory(mem, x)
        x = x + self.dropout(y)
        y, aux_mlp = self.mlp(self.ln_mlp(x))
        return x + self.dropout(y), window_inputs, aux_attn + aux_mlp

    def decode(self, x: Tensor, cache: KVCache, layer: int, window) -> Tensor:
        """The block on the current tokens x [B, t, d_model], their entries written to ``cache`` (inference: no
        dropout, no auxiliary loss). The inputs are cached after the LayerNorm: in evaluation the same as
        normalising cached raw inputs at every step, as :meth:`forward` does."""
        h = self.ln_attn(x)
        if caches_inputs(cache.entries):  # the layer re-projects its cached inputs (Transformer-XL)
            (inputs,) = cache.write(layer, (h[:, None],))
            mem = inputs[:, 0, : -x.shape[1]]
            y, _ = self.attn(h, mem if mem.shape[1] else None, window)
        else:
            entries = cache.write(layer, self.attn.cache_entries(h, window.q_pos))
            y = self.attn.attend_cached(h, entries, window)
        # The residual stream stays in the weights' dtype: an expert matmul weighs by full-precision gates, so with
        # bf16 weights (as served, no autocast) its output is float32
        x = x + y.to(x.dtype)
        return x + self.mlp(self.ln_mlp(x))[0].to(x.dtype)


class Stack(nn.Module):
    """Embedding, L blocks, the final LayerNorm and (training only) dropout before the output layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab, cfg.d_model)
        nn.init.normal_(self.embedding.weight, std=cfg.d_model**-0.5)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_out = nn.LayerNorm(cfg.d_model)

    def forward(self, tokens: Tensor, state: State | None = None) -> tuple[Tensor, State, Tensor | float]:
        # B batch, t tokens
        cfg = self.cfg
        t = tokens.shape[1]
        state = state or State((None,) * cfg.n_layers)
        mem_len = 0 if state.mems[0] is None else state.mems[0].shape[1]
        window = make_window(state.offset, mem_len, t, cfg.T, cfg.context_blocks, cfg.causal, tokens.device)
        x = self.dropout(self.embedding(tokens))  # [B, t, d_model]
        mems, aux = [], 0.0
        end = state.offset + t
        for block, mem in zip(self.blocks, state.mems, strict=True):
            x, inputs, aux_block = block(x, mem, window)
            mems.append(next_memory(inputs, end, cfg.T, cfg.context_blocks) if cfg.causal else None)
            aux = aux + aux_block
        return self.dropout(self.ln_out(x)), State(tuple(mems), end), aux

    def window(self, length: int) -> int:
        """Of the first ``length`` tokens, how many the next one attends to: the cached chunks and the unfinished
        one (as the XL memory keeps them)."""
        return min(length, self.cfg.context_blocks * self.cfg.T + length % self.cfg.T)

    def decode(self, tokens: Tensor, cache: KVCache) -> Tensor:
        """The next t tokens [B, t] after those in ``cache`` -> final hidden states [B, t, d_model]; the cache
        gains them. Token by token or chunk by chunk, the outputs are the full forward's (tests/test_decode.py)."""
        cfg = self.cfg
        t = tokens.shape[1]
        window = make_window(
            cache.length, cache.length - cache.start, t, cfg.T, cfg.context_blocks, True, tokens.device
        )
        # One token that sees every key the cache keeps (a cache keeping its window) needs no mask, so that
        # scaled-dot-product attention may take its fused kernels
        sees_all = t == 1 and cache.length - cache.start <= self.window(cache.length)
        window = replace(window, mask=None if sees_all else window.mask, tables=cache.tables)
        x = self.embedding(tokens)
        for layer, block in enumerate(self.blocks):
            x = block.decode(x, cache, layer, window)
        cache.advance(t)
        return self.ln_out(x)


@dataclass(frozen=True)
class LMOutput:
    logits: Tensor  # [B, t, vocab]
    state: State
    aux_loss: Tensor | float  # weighted sum of the routers' auxiliary losses

    def loss(self, targets: Tensor) -> Tensor:
        """Cross-entropy against targets [B, t], plus the auxiliary losses."""
        # in at least float32: under autocast the logits come in bf16, and float64 ones stay float64
        return F.cross_entropy(full_precision(self.logits.flatten(0, 1)), targets.flatten()) + self.aux_loss


class LanguageModel(nn.Module):
    """Decoder-only LM with an untied output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not cfg.causal:
            raise ValueError("causal must be True for a language model")
        self.cfg = cfg
        self.stack = Stack(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        nn.init.normal_(self.head.weight, std=cfg.d_model**-0.5)

    def forward(self, tokens: Tensor, state: State | None = None) -> LMOutput:
        h, state, aux = self.stack(tokens, state)
        return LMOutput(self.head(h), state, aux)

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype | None = None) -> KVCache:
        """An empty cache for ``batch`` sequences of up to ``capacity`` tokens, in the weights' dtype unless
        given; a ValueError if the family declares no decode path."""
        cfg = self.cfg
        if cfg.family.kv_cache is None:
            raise ValueError(f"{cfg.family.label} has no decode path (its family declares no kv_cache)")
        weight = self.head.weight
        entries, dtype = cfg.family.kv_cache(cfg), dtype or weight.dtype
        return KVCache(entries, cfg.n_layers, batch, capacity, weight.device, dtype, self.stack.window)

    def decode(self, tokens: Tensor, cache: KVCache) -> Tensor:
        """Logits [B, t, vocab] of the next t tokens after those in ``cache`` (prefill: many; decode: one)."""
        return self.head(self.stack.decode(tokens, cache))


class SequenceClassifier(nn.Module):
    """Bidirectional stack, mean-pooled over positions, then a linear classifier."""

    def __init__(self, cfg: ModelConfig, n_classes: int):
        super().__init__()
        if cfg.causal:
            raise ValueError("causal must be False for a sequence classifier")
        self.cfg = cfg
        self.stack = Stack(cfg)
        self.head = nn.Linear(cfg.d_model, n_classes, bias=False)
        nn.init.normal_(self.head.weight, std=cfg.d_model**-0.5)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor | float]:
        """tokens [B, t] -> (class logits [B, n_classes], auxiliary loss)."""
        h, _, aux = self.stack(tokens)
        return self.head(h.mean(dim=1)), aux


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
