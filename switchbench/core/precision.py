"""The one precision policy of everything timed or trained: parameters and inputs in fp32, the computation under
``torch.autocast`` to the run's dtype (fp32: autocast off), as mixed-precision training runs. A whole model and
a single layer follow it alike, so their numbers compare."""

import torch


def autocast(device: str, dtype: torch.dtype, cache: bool = True) -> torch.autocast:
    """Autocast to ``dtype`` (off for fp32); ``cache`` False for a region captured in a CUDA graph, where the
    cast weights it would cache are freed with the graph's pool."""
    return torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32, cache_enabled=cache)


def autocast_dtype(device: str) -> torch.dtype | None:
    """The dtype autocast runs ``device``'s matmuls in where it is on there, else None: what an operator that
    casts its own inputs (the expert matmul, the shared projections) casts them to."""
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def describe(dtype_name: str) -> str:
    """How a run with ``--dtype dtype_name`` computes, for its metadata."""
    return "fp32" if dtype_name == "fp32" else f"fp32 parameters and inputs, autocast to {dtype_name}"


def full_precision(logits: torch.Tensor) -> torch.Tensor:
    """Logits in at least float32, so that under mixed precision a router's top-k and gates, or the language
    model's cross-entropy, are not rounded to bf16 or fp16 (float64 ones stay float64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))
