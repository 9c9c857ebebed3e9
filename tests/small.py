"""Small models for the sequence and decoding tests: two layers of d_model 32, chunks of T tokens, any family."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from switchbench.models.config import ModelConfig
from switchbench.models.lm import LanguageModel
from switchbench.ops.attention.choice import NO_FLOAT64_ON_CUDA

T = 8
SEQ = 2 * T + 3
TIGHT = dict(rtol=1e-10, atol=1e-10)
# (pos, context_blocks) of a sweep over windows; the fast loop's: XL over two chunks of memory, RoPE over one
# (docs/layout.md)
WINDOWS = [
    pytest.param("xl", 1, marks=pytest.mark.slow),
    ("xl", 2),
    pytest.param("rope", 0, marks=pytest.mark.slow),
    ("rope", 1),
]
# Where a Triton kernel runs: the GPU, else the CPU in Triton's interpreter (conftest.py)
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The backends that refuse float64 on a GPU (choice.NO_FLOAT64_ON_CUDA): there their checks run them in float32
# against the float64 reference, within FP32
FP32 = dict(rtol=1e-4, atol=1e-5)


def checked_dtype(backend: str, device: str = TRITON_DEVICE) -> torch.dtype:
    """The dtype a check runs ``backend`` in: float64, but float32 for a Triton backend on a GPU."""
    return torch.float32 if backend in NO_FLOAT64_ON_CUDA and device == "cuda" else torch.float64


def within(backend: str, device: str = TRITON_DEVICE) -> dict:
    """The tolerance of ``backend``'s check against float64: TIGHT, or FP32 where it runs in float32."""
    return FP32 if checked_dtype(backend, device) == torch.float32 else TIGHT


def small_cfg(model: str, pos: str = "xl", **changes) -> ModelConfig:
    base = dict(
        model=model,
        pos=pos,
        d_model=32,
        n_layers=2,
        n_heads=2,
        d_head=8,
        d_ff=48,
        n_experts=4,
        k=2,
        T=T,
        context_blocks=1 if pos == "xl" else 0,
        vocab=50,
        mlp_experts=4,
        mlp_expert_size=8,
        mlp_k=2,
    )
    return ModelConfig(**(base | changes))


def make_lm(cfg: ModelConfig, seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(cfg).double().eval()


def random_tokens(cfg: ModelConfig, length: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(cfg.vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


COPIES = ("aten.clone", "aten.copy_", "aten._to_copy")


class _Copies(TorchDispatchMode):
    def __init__(self, shapes: list):
        super().__init__()
        self.shapes = shapes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(COPIES):
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counted_copies():
    """The shapes of the tensors copied (cloned, copied into another, converted) inside the block, in order:
    what torch dispatches, the backward included when it runs inside."""
    shapes = []
    with _Copies(shapes):
        yield shapes
