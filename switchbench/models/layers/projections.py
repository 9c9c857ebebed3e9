"""Several bias-free projections of one input: the input cast once, its gradient one GEMM.

Each consumer of a layer's input costs it once more: under autocast one more cast of the input (and one more copy
kept for the backward), and in the backward one more float32 sum of the input's gradient. In an H200 profile of
SwitchHead 262M at batch 64 such sums and casts around the routers' inputs took about 16 ms of a 236 ms step.
Fusing the weights into one GEMM, as a practitioner fuses Q, K and V (nanoGPT's ``c_attn``, gpt-fast's ``wqkv``),
removes them, but makes every output a view of one storage: whatever the backward keeps of one output (V, or XL's K)
keeps all of them. So here the forward runs each projection on the one cast, each output a tensor of its own, and
the backward gathers their gradients for one GEMM into the input's gradient and one into the weights'. An expert
matmul reading the same input takes the cast too (``share_input``), its gradient added in the first GEMM's epilogue.
The parameters stay apart: checkpoints, the analysis and the initialisation see each projection by its name.
"""

import torch
from torch import Tensor, nn

from switchbench.core.precision import autocast_dtype


def project(x: Tensor, *layers: nn.Linear | None, share_input: bool = False) -> tuple[Tensor | None, ...]:
    """x [..., d_in] through each of ``layers`` (bias-free; None: no such projection, None out) -> each one's
    output [..., d_out]. With ``share_input``, first x as they read it (cast to autocast's dtype where it is on),
    for another reader of x to take instead of x."""
    present = [layer for layer in layers if layer is not None]
    if len(present) > 1 or (share_input and present):
        weights = [layer.weight for layer in present]
        # Without a gradient to take, the same forward as is: torch.compile (2.13) traced the autograd function
        # under no_grad with its tensors in the place of ctx
        shared, *outputs = (
            _Projections.apply(x, *weights) if torch.is_grad_enabled() else _forward(x, weights)
        )
    else:
        shared, outputs = x, [layer(x) for layer in present]
    outputs = iter(outputs)
    projected = tuple(None if layer is None else next(outputs) for layer in layers)
    return (shared, *projected) if share_input else projected


def _forward(x: Tensor, weights: list[Tensor]) -> tuple[Tensor, ...]:
    """(x as the projections read it, each projection's output)."""
    x = x.to(autocast_dtype(x.device.type) or x.dtype)  # once for every reader (a no-op outside autocast)
    return x.view_as(x), *(x @ weight.to(x.dtype).t() for weight in weights)


class _Projections(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, *weights: Tensor) -> tuple[Tensor, ...]:
        shared, *outputs = _forward(x, weights)
        ctx.save_for_backward(shared, *weights)
        ctx.set_materialize_grads(False)
        return shared, *outputs

    @staticmethod
    def backward(ctx, grad_shared: Tensor | None, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        rows = x.shape[:-1].numel()
        grad = torch.cat(
            [
                x.new_zeros(rows, w.shape[0]) if g is None else g.reshape(rows, -1).to(x.dtype)
                for g, w in zip(grads, weights, strict=True)
            ],
            dim=1,
        )  # [rows, sum of d_out]
        # each GEMM only where its gradient is wanted; autograd brings each to its tensor's dtype
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            weight = torch.cat(weights).to(x.dtype)  # [sum of d_out, d_in]
            if grad_shared is None:
                grad_x = (grad @ weight).view(x.shape)
            else:
                grad_x = torch.addmm(grad_shared.reshape(rows, -1).to(x.dtype), grad, weight).view(x.shape)
        if any(ctx.needs_input_grad[1:]):
            grad_w = grad.t() @ x.reshape(rows, -1)  # [sum of d_out, d_in]: each weight's rows in turn
            grad_w = grad_w.split([w.shape[0] for w in weights])
        return grad_x, *(grad_w or [None] * len(weights))
