"""What a decoder keeps per token to decode the next one, and the cache that keeps it.

A family declares its cache as :class:`CacheEntry` rows: what one source token leaves in one layer (projected keys
and values per head, values after the expert mix, one shared key and value head, or the layer's inputs as
Transformer-XL caches them). The cache is allocated once for the longest sequence it will hold, as gpt-fast's
static cache is: each step writes its tokens in place and attention reads views, so decoding copies nothing it
already holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from switchbench.models.layers.projections import project

# The kind of the one entry of a family that caches its layers' inputs and re-projects them at every step
INPUTS = "inputs"


@dataclass(frozen=True)
class CacheEntry:
    name: str  # k, v, or INPUTS
    heads: int
    width: int
    what: str  # in words, for tables: "keys", "values after the expert mix", ...

    @property
    def per_token(self) -> int:
        """Numbers one token leaves in one layer."""
        return self.heads * self.width


def elements_per_token(entries: tuple[CacheEntry, ...], n_layers: int) -> int:
    """Numbers one token leaves in the cache of a whole stack: the exact count behind bytes per token."""
    return n_layers * sum(e.per_token for e in entries)


def keys_values(
    k: nn.Module, v: nn.Module, attention: nn.Module, xs: Tensor, positions: Tensor, heads: int, d_head: int
) -> tuple[Tensor, Tensor]:
    """K and V [B, heads, L, d_head] of the source tokens xs [B, L, d_model] at ``positions`` [L] through the
    projections ``k`` and ``v``, the keys as ``attention`` reads them (RoPE: rotated): what a token caches in the
    families with one K and one V projection per head. Both read xs once (:func:`project`)."""
    B = xs.shape[0]
    keys, values = (y.view(B, -1, heads, d_head).transpose(1, 2) for y in project(xs, k, v))
    return attention.keys(keys, positions), values


def caches_inputs(entries: tuple[CacheEntry, ...]) -> bool:
    return len(entries) == 1 and entries[0].name == INPUTS


class KVCache:
    """Each layer's entries [B, heads, capacity, width], allocated once; ``length`` tokens written so far, of which
    those from ``start`` on are still in the attention window (older ones are never read again)."""

    def __init__(
        self,
        entries: tuple[CacheEntry, ...],
        n_layers: int,
        batch: int,
        capacity: int,
        device,
        dtype: torch.dtype,
        window: Callable[[int], int] = lambda length: length,
    ):
        """``window(length)``: how many of the first ``length`` tokens the next token attends to (default all)."""
        self.entries, self.capacity, self.window = entries, capacity, window
        self.layers = [
            tuple(torch.zeros(batch, e.heads, capacity, e.width, device=device, dtype=dtype) for e in entries)
            for _ in range(n_layers)
        ]
        self.length = self.start = 0
        # What layers compute once per sequence and keep (the window's ``tables``): XL's projected distances
        self.tables: dict = {"capacity": capacity}

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds, all layers and entries (its allocation)."""
        return sum(b.numel() * b.element_size() for layer in self.layers for b in layer)

    def write(self, layer: int, new: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """Store ``new`` [B, heads, t, width] (one per entry) after the cached tokens of ``layer``; -> views of every
        token in the window, the new ones last."""
        t = new[0].shape[2]
        end = self.length + t
        if end > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} tokens; {end} asked")
        for buffer, values in zip(self.layers[layer], new, strict=True):
            buffer[:, :, self.length : end] = values
        return tuple(buffer[:, :, self.start : end] for buffer in self.layers[layer])

    def rewind(self, length: int) -> None:
        """Forget every token after the first ``length`` (a benchmark decodes the same step again)."""
        self._at(length)

    def advance(self, t: int) -> None:
        """After every layer wrote ``t`` tokens."""
        self._at(self.length + t)

    def _at(self, length: int) -> None:
        self.length, self.start = length, max(0, length - self.window(length))
