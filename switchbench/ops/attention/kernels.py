"""Softmax attention of query heads over (possibly fewer) key heads, with an optional position term by distance
(:class:`~switchbench.ops.attention.relative.RelativeBias`), by four kernels that compute the same function:

- ``explicit``: the logits, the position term, the mask, a softmax and the product with V, one operator each. The
  reference, and the only kernel that has the attention maps.
- ``sdpa``: PyTorch's scaled-dot-product attention. Without a position term (RoPE) a flash kernel takes the boolean
  mask; with one (Transformer-XL's) the memory-efficient kernel takes the term spread over [t, S], -inf where
  masked, as an additive float mask and returns its gradient. Heads are zero-padded to a multiple of 8 channels,
  the fused kernels' condition.
- ``flex``: FlexAttention, the position term read by distance inside the kernel by a ``score_mod``, the causal
  window as a block mask so that fully masked blocks are skipped. Compiled on CUDA (eager, it materialises the
  scores); torch has no FlexAttention backward on the CPU.
- ``triton``: flash attention in Triton that reads the position term by distance and writes its gradient there
  (:mod:`~switchbench.ops.attention.flash`), grouped heads read by their query heads; CUDA, or the CPU in Triton's
  interpreter.

Grouped heads (GQA's groups, MoA's one shared key head) are read by their query heads, not repeated, except by
SDPA in training (:func:`_fused_sdpa`).
"""

import functools
import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from switchbench.core.compiling import allow_recompilations
from switchbench.ops.attention.choice import NO_FLOAT64_ON_CUDA, as_named, resolve
from switchbench.ops.attention.relative import RelativeBias


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: RelativeBias | None = None,
    scale: float | None = None,
    return_maps: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """q [B, H, t, D] over k, v [B, Hk, S, D] (Hk divides H) -> ([B, H, t, D], maps [B, H, t, S] or None).

    ``mask`` [t, S]: True where query i may read key j (None: every key). ``bias``, a position term by distance
    for each query head, is added to the logits after ``scale`` (default 1/sqrt(D)) multiplies q k^T. The kernel
    is the choice in force (:mod:`~switchbench.ops.attention.choice`), resolved for this call.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    backend = resolve(q.device.type, bias is not None, return_maps)
    if q.is_cuda and q.dtype == torch.float64 and backend in NO_FLOAT64_ON_CUDA:
        raise ValueError(
            f"{as_named('--attention')} takes no float64 on a GPU ({NO_FLOAT64_ON_CUDA[backend]}): use float32 or "
            "bf16, or another backend"
        )
    if backend == "explicit":
        return explicit(q, k, v, mask, bias, scale, return_maps)
    kernel = {"sdpa": sdpa, "flex": flex, "triton": fused}[backend]
    return kernel(q, k, v, mask, bias, scale), None


def grouped_matmul(a: Tensor, b: Tensor) -> Tensor:
    """a [B, H, t, X] @ b [B, Hk, X, Y] -> [B, H, t, Y], query head h against key head h // (H / Hk): GQA's groups
    (one key head broadcasts, as MoA's), with no key or value head repeated for its group."""
    B, H, t, X = a.shape
    Hk = b.shape[1]
    if Hk in (1, H):
        return a @ b
    return (a.reshape(B, Hk, H // Hk * t, X) @ b).view(B, H, t, -1)


def explicit(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: RelativeBias | None,
    scale: float,
    return_maps: bool,
) -> tuple[Tensor, Tensor | None]:
    """Logits, masked softmax and the product with V, each one operator (a scale of 1 costs none)."""
    logits = grouped_matmul(q, k.transpose(-1, -2))
    if scale != 1.0:
        logits = logits * scale
    if bias is not None:
        logits = logits + bias.shifted()
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    att = logits.softmax(dim=-1)
    return grouped_matmul(att, v), att.detach() if return_maps else None


def sdpa_width(d_head: int) -> int:
    """The head width scaled-dot-product attention runs at: d_head rounded up to a multiple of 8."""
    return -(-d_head // 8) * 8


def sdpa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: RelativeBias | None, scale: float
) -> Tensor:
    """Scaled-dot-product attention on heads zero-padded to a multiple of 8 channels: with a mask and any other
    width the fused GPU kernels refuse them and SDPA falls back to its math kernel."""
    if bias is not None:
        mask = bias.masked(mask)
    return _padded(lambda q, k, v: _fused_sdpa(q, k, v, mask, scale), sdpa_width(q.shape[-1]), q, k, v)


def _fused_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """SDPA on grouped heads as they are, except in a call with a mask that will be differentiated: there the key
    and value heads are repeated for their groups first. On CUDA only cuDNN's fused kernel takes grouped heads
    beside a mask, and on an H200 (47M, batch 64, eager) SDPA made dense's step faster than the explicit kernel's
    (124 ms against 148) and the grouped families' slower: GQA 164 against 144, MoA 153 against 117, GQA's layer
    holding 2.3 times dense's memory through its backward. Where cuDNN refuses too, SDPA's math kernel runs in
    fp32 (MoA's tiny step did). Repeated heads take dense's path, for a copy of K and V and a sum of their
    gradients. Decoding needs no backward and keeps the grouped heads, which read the cache once; so does the
    CPU."""
    if _grouped(q, k) and mask is not None and _cuda_training(q, k, v, mask):
        k, v = (_repeated(x, q.shape[1]) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=_grouped(q, k))


def _repeated(x: Tensor, heads: int) -> Tensor:
    """x [B, Hk, S, D] -> [B, heads, S, D], each head repeated for its group (a broadcast, then one copy)."""
    B, Hk, S, D = x.shape
    return x[:, :, None].expand(B, Hk, heads // Hk, S, D).reshape(B, heads, S, D)


def _cuda_training(q: Tensor, *others: Tensor) -> bool:
    """A CUDA call that will be differentiated. The CPU's fused kernel takes no grouped heads at all, and there
    the exact memory count and the saved tensors it is checked against are the grouped ones."""
    return q.is_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, *others))


def _grouped(q: Tensor, k: Tensor) -> bool:
    """Whether fewer key heads than query heads: a Python bool, which SDPA and FlexAttention require, also where a
    torch.jit trace (fvcore's counter) makes the sizes tensors."""
    return bool(k.shape[1] != q.shape[1])


def _padded(kernel, width: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``kernel(q, k, v)`` on heads zero-padded to ``width`` channels. Zero channels add nothing to q k^T, the scale
    is the caller's, and the output's zero channels are dropped."""
    pad = width - q.shape[-1]
    if not pad:
        return kernel(q, k, v)
    return kernel(*(F.pad(x, (0, pad)) for x in (q, k, v)))[..., :-pad]


# Triton's matrix multiply takes no inner dimension below 16: narrower heads are zero-padded for compiled FlexAttention
FLEX_MIN_WIDTH = 16


def flex(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: RelativeBias | None, scale: float
) -> Tensor:
    """FlexAttention: the position term through a ``score_mod``, the mask as a block mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    score_mod = None if bias is None else bias.score_mod()
    block_mask = None
    if mask is not None:
        t, S = mask.shape
        block_mask = create_block_mask(lambda b, h, i, j: mask[i, j], None, None, t, S, device=q.device)
    grouped = _grouped(q, k)
    kernel = _flex_kernel(q.is_cuda)
    return _padded(
        lambda q, k, v: kernel(
            q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=grouped
        ),
        max(q.shape[-1], FLEX_MIN_WIDTH) if q.is_cuda else q.shape[-1],
        q,
        k,
        v,
    )


@functools.cache
def _flex_kernel(cuda: bool):
    """FlexAttention compiled on CUDA, where that makes it one fused kernel; eager elsewhere (forward only), its
    warning that it materialises the scores silenced: that is what the CPU has."""
    from torch.nn.attention.flex_attention import flex_attention

    if cuda:
        return compiled_flex()

    @functools.wraps(flex_attention)
    def eager(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(*args, **kwargs)

    return eager


def compiled_flex(backend: str = "inductor"):
    """flex_attention under torch.compile, with room for a compilation for each shape, head count and grad mode
    (all counted against flex_attention's one code object)."""
    from torch.nn.attention.flex_attention import flex_attention

    allow_recompilations()
    return torch.compile(flex_attention, dynamic=False, backend=backend)


def flash_width(d_head: int) -> int:
    """The head width Triton's flash attention runs at: d_head rounded up to a multiple of 16. Triton specialises
    a kernel on the integers that are multiples of 16, so every row and head of its tensors is then known to
    start aligned, and its loads become asynchronous copies into shared memory, pipelined. At 104 or 88 channels
    (multiples of 8 only) they went through registers, and on sm_90 every forward candidate spilled."""
    return -(-d_head // 16) * 16


def fused(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: RelativeBias | None, scale: float
) -> Tensor:
    """Triton's flash attention (:mod:`~switchbench.ops.attention.flash`), the position term read by distance, on
    heads zero-padded to :func:`flash_width`."""
    pos = None if bias is None else bias.scores
    return _padded(
        lambda q, k, v: torch.ops.switchbench.flash_attention(q, k, v, pos, mask, scale)[0],
        flash_width(q.shape[-1]),
        q,
        k,
        v,
    )


# Custom ops: one graph node each for torch.compile (a fake implementation gives their shapes), the Triton module
# imported when first run


@torch.library.custom_op("switchbench::flash_attention", mutates_args=())
def _flash_op(
    q: Tensor, k: Tensor, v: Tensor, pos: Tensor | None, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    from switchbench.ops.attention import flash

    return flash.forward(q, k, v, pos, mask, scale)


@_flash_op.register_fake
def _(q, k, v, pos, mask, scale):
    from switchbench.ops.attention import flash

    B, H, t = q.shape[:3]
    return flash.output_like(q), q.new_empty(B * H, t, dtype=flash.accumulated(q.dtype))


@torch.library.custom_op("switchbench::flash_attention_backward", mutates_args=())
def _flash_backward_op(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Tensor | None,
    mask: Tensor | None,
    o: Tensor,
    lse: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from switchbench.ops.attention import flash

    dq, dk, dv, dpos = flash.backward(do, q, k, v, pos, mask, o, lse, scale)
    return dq, dk, dv, q.new_empty(0) if dpos is None else dpos


@_flash_backward_op.register_fake
def _(do, q, k, v, pos, mask, o, lse, scale):
    from switchbench.ops.attention import flash

    dq, dk, dv, dpos = flash.gradients_like(q, k, v, pos)
    return dq, dk, dv, q.new_empty(0) if dpos is None else dpos


def _flash_setup(ctx, inputs, output):
    q, k, v, pos, mask, scale = inputs
    ctx.save_for_backward(q, k, v, pos, mask, *output)
    ctx.scale = scale


def _flash_backward(ctx, do, _):
    q, k, v, pos, mask, o, lse = ctx.saved_tensors
    dq, dk, dv, dpos = torch.ops.switchbench.flash_attention_backward(
        do, q, k, v, pos, mask, o, lse, ctx.scale
    )
    return dq, dk, dv, None if pos is None else dpos, None, None


_flash_op.register_autograd(_flash_backward, setup_context=_flash_setup)
