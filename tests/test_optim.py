"""The optimizer of every timed or trained step: AdamW without weight decay, its fused kernel where the step runs on
CUDA. The CPU runs that kernel too, so the implementation a GPU step gets is checked here against Adam by hand."""

import pytest
import torch

from switchbench.core import optim


def adam_by_hand(start, grads, lr, betas=(0.9, 0.999), eps=1e-8):
    """Kingma and Ba's Adam with bias correction, no weight decay, in float64."""
    w, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    for t, g in enumerate(grads, 1):
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        w = w - lr * (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return w


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_adamw_is_adam_without_weight_decay_in_either_implementation(device):
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(7, 3, dtype=torch.float64, generator=gen)
    grads = [torch.randn(7, 3, dtype=torch.float64, generator=gen) for _ in range(4)]
    weight = torch.nn.Parameter(start.clone())
    optimizer = optim.adamw([weight], 1e-2, device)
    assert bool(optimizer.param_groups[0]["fused"]) == (device == "cuda") == optim.fused(device)
    assert ("fused" in optim.describe(device)) == (device == "cuda")
    for grad in grads:
        weight.grad = grad.clone()
        optimizer.step()
    torch.testing.assert_close(weight.detach(), adam_by_hand(start, grads, 1e-2), rtol=1e-12, atol=1e-12)


def test_a_numbered_cuda_device_is_cuda():
    assert optim.fused("cuda:1") and not optim.fused("cpu")
