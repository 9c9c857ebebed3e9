"""Several projections of one input (models/layers/projections.py) against each projection run on its own."""

import pytest
import torch
from torch import nn

from switchbench.bench.cost.measure import count_saved_bytes
from switchbench.models.layers.projections import project


def _layers(widths, d_in=12, dtype=torch.float64):
    torch.manual_seed(0)
    return nn.ModuleList(nn.Linear(d_in, w, bias=False, dtype=dtype) for w in widths)


@pytest.mark.parametrize("used", [(0, 1, 2), (1,), (0, 2)])
def test_outputs_and_every_gradient_equal_separate_linears_in_float64(used):
    layers = _layers((5, 16, 3))
    x = torch.randn(2, 7, 12, dtype=torch.float64, requires_grad=True)
    ys = project(x, *layers)
    loss = sum((ys[i] * (i + 1)).square().sum() for i in used)  # outputs left unused get no gradient
    grads = torch.autograd.grad(loss, [x, *layers.parameters()])

    x_ref = x.detach().clone().requires_grad_()
    w_ref = [layer.weight.detach().clone().requires_grad_() for layer in layers]
    refs = [torch.nn.functional.linear(x_ref, w) for w in w_ref]
    loss_ref = sum((refs[i] * (i + 1)).square().sum() for i in used)
    expected = torch.autograd.grad(loss_ref, [x_ref, *w_ref], allow_unused=True, materialize_grads=True)
    for y, ref in zip(ys, refs, strict=True):
        torch.testing.assert_close(y, ref, rtol=1e-13, atol=1e-13)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def test_absent_projections_give_none_and_one_layer_runs_as_itself():
    layers = _layers((4, 6))
    x = torch.randn(3, 12, dtype=torch.float64)
    a, none, b = project(x, layers[0], None, layers[1])
    assert none is None and a.shape == (3, 4) and b.shape == (3, 6)
    (only,) = project(x, layers[1])
    torch.testing.assert_close(only, layers[1](x), rtol=0, atol=0)
    assert project(x, None) == (None,)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
        ),
    ],
)
def test_under_autocast_the_input_is_cast_once_and_kept_once(device):
    layers = _layers((8, 16, 4), dtype=torch.float32).to(device)
    x = torch.randn(5, 12, device=device, requires_grad=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        ys = project(x, *layers)
        separate = [layer(x) for layer in layers]
        # one bf16 copy of x kept for every projection; separate linears keep one each, and their cast weights
        assert count_saved_bytes(lambda: project(x, *layers), layers) == x.numel() * 2
        assert count_saved_bytes(lambda: [layer(x) for layer in layers], layers) > 3 * x.numel() * 2
    for y, ref in zip(ys, separate, strict=True):
        assert y.dtype == torch.bfloat16
        # the same casts and bf16 GEMMs: on the CPU the same bits; cuBLAS may pick another kernel for a linear
        exact = {"rtol": 0, "atol": 0} if device == "cpu" else {}
        torch.testing.assert_close(y, ref, **exact)
    sum(y.float().sum() for y in ys).backward()
    expected = sum(layer.weight.sum(0) for layer in layers)  # d/dx of the outputs' sum, in float32
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, expected.expand_as(x), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("widths", [(4,), (4, 9)])
def test_a_reader_of_the_shared_input_gets_its_gradient_added_to_the_projections(widths):
    layers = _layers(widths)
    reader = torch.randn(12, 6, dtype=torch.float64)  # another consumer of x, as an expert matmul
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    shared, *ys = project(x, *layers, share_input=True)
    loss = (shared @ reader).sin().sum() + sum((y * y).sum() for y in ys)
    grads = torch.autograd.grad(loss, [x, *layers.parameters()])

    x_ref = x.detach().clone().requires_grad_()
    w_ref = [layer.weight.detach().clone().requires_grad_() for layer in layers]
    loss_ref = (x_ref @ reader).sin().sum() + sum((x_ref @ w.t()).square().sum() for w in w_ref)
    for got, want in zip(grads, torch.autograd.grad(loss_ref, [x_ref, *w_ref]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(shared, x, rtol=0, atol=0)


def test_without_projections_the_shared_input_is_the_input_itself():
    x = torch.randn(2, 3)
    shared, none = project(x, None, share_input=True)
    assert shared is x and none is None


@pytest.mark.slow  # compiles
@pytest.mark.parametrize("grad", [True, False])
def test_compiles_whole_with_and_without_a_gradient(grad):
    layers = _layers((4, 6))
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=grad)
    compiled = torch.compile(
        lambda x: project(x, *layers, share_input=True), backend="aot_eager", fullgraph=True
    )
    with torch.set_grad_enabled(grad):
        _, a, b = compiled(x)
    torch.testing.assert_close(a, layers[0](x), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(b, layers[1](x), rtol=1e-13, atol=1e-13)
    assert a.requires_grad == grad


def test_only_the_gradients_asked_for_are_computed():
    layers = _layers((4, 6))
    for p in layers.parameters():
        p.requires_grad_(False)
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    a, b = project(x, *layers)
    (a.sum() + b.sum()).backward()
    torch.testing.assert_close(x.grad, (layers[0].weight.sum(0) + layers[1].weight.sum(0)).expand_as(x))
    assert all(p.grad is None for p in layers.parameters())

    for p in layers.parameters():
        p.requires_grad_(True)
    a, b = project(x.detach(), *layers)  # the input wants none
    (a.sum() + b.sum()).backward()
    torch.testing.assert_close(layers[1].weight.grad, x.detach().sum(0).expand(6, 12))
