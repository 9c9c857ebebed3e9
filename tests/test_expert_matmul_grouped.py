"""The grouped-GEMM expert matmul (torch's grouped_mm) against a float64 loop: output and every gradient, for every
family's groupings, gated and not, uneven and empty experts, unaligned widths, non-contiguous inputs, autocast."""

from dataclasses import replace

import naive
import pytest
import torch

from switchbench.ops.expert_matmul import grouped as expert_matmul_grouped
from switchbench.ops.expert_matmul.cases import CASES, Case, float64_inputs
from switchbench.ops.expert_matmul.op import expert_matmul, route

pytestmark = pytest.mark.skipif(
    expert_matmul_grouped.unavailable() is not None, reason="this torch has no grouped_mm"
)
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gated", [True, False], ids=["gates", "no-gates"])
@pytest.mark.parametrize("case", list(naive.FAMILY_CASES))
def test_grouped_mm_matches_float64(case, gated, dtype):
    naive.assert_matches_float64("grouped_mm", naive.FAMILY_CASES[case], gated, dtype, TOLERANCE[dtype])


def test_a_wrong_transposition_is_caught(monkeypatch):
    """The comparison can fail: W^T read as a reshape of W (the same shape, the wrong layout) breaks grad_x."""
    real = expert_matmul_grouped.grouped_mm

    def reshaped(rows, weight, ends):
        if weight.stride(-2) == 1:  # the transposed view of the input gradient
            weight = weight.transpose(1, 2).contiguous().reshape(weight.shape)
        return real(rows, weight, ends)

    x, weight, indices, scores, grad_out = float64_inputs(CASES["switchhead-o"])
    exact = naive.outputs("torch", x, weight, indices, scores, 1, grad_out)
    monkeypatch.setattr(expert_matmul_grouped, "grouped_mm", reshaped)
    got = naive.outputs("grouped_mm", x.float(), weight.float(), indices, scores.float(), 1, grad_out)
    with pytest.raises(AssertionError, match="grad_x"):
        naive.assert_close_scaled(got, exact, 2e-6)


def test_experts_without_rows_get_zero_weight_gradients():
    x, weight, indices, scores, grad_out = float64_inputs(CASES["empty-experts"])
    _, _, grad_w, _ = naive.outputs(
        "grouped_mm", x.float(), weight.float(), indices, scores.float(), 1, grad_out
    )
    unused = sorted(set(range(weight.shape[0])) - set(indices.flatten().tolist()))
    assert unused and grad_w[unused].abs().max() == 0 and grad_w.abs().sum() > 0


def test_empty_groups_are_zeroed_where_the_library_leaves_garbage(monkeypatch):
    """On Blackwell the K-grouped GEMM gave experts without rows non-zero gradients (pytorch#172439): stand in for
    it, and the weight gradients of those experts are still zero."""
    real = expert_matmul_grouped._grouped_mm

    def blackwell(a, b, offs):
        out = real(a, b, offs=offs)
        if a.dim() == b.dim() == 2:  # the weight gradient
            empty = torch.cat([offs[:1], offs.diff()]) == 0
            out[empty] = 7.0
        return out

    monkeypatch.setattr(expert_matmul_grouped, "_grouped_mm", blackwell)
    test_experts_without_rows_get_zero_weight_gradients()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_no_tokens_at_all(dtype):
    """Every expert empty: an empty output, zero gradients (the K-grouped GEMM is skipped: a zero-length
    contraction passes no stride check)."""
    x = torch.randn(0, 2, 24, dtype=dtype, requires_grad=True)
    weight = torch.randn(6, 24, 20, dtype=dtype, requires_grad=True)
    scores = torch.rand(0, 6, dtype=dtype, requires_grad=True)
    y = expert_matmul(x, weight, route(torch.zeros(0, 4, dtype=torch.long), 6), scores, 1, impl="grouped_mm")
    assert y.shape == (0, 1, 20)
    y.sum().backward()
    assert x.grad.shape == x.shape and scores.grad.shape == scores.shape
    assert weight.grad.shape == weight.shape and weight.grad.abs().max() == 0


def test_non_contiguous_inputs_and_scores():
    """x with a feature stride of 2, a column-major weight, a transposed scores view: the same results."""
    aligned = replace(CASES["switchhead-v"], d_in=40, d_out=24)  # the weight reaches the GEMM as it is
    for case in (aligned, CASES["switchhead-v"]):
        x, weight, indices, scores, grad_out = float64_inputs(case, seed=7)
        exact = naive.outputs("torch", x, weight, indices, scores, 3, grad_out)
        x_nc = torch.stack([x, x], -1).float()[..., 0]
        weight_nc = weight.float().transpose(1, 2).contiguous().transpose(1, 2)
        scores_nc = scores.float().t().contiguous().t()
        assert not (x_nc.is_contiguous() or weight_nc.is_contiguous() or scores_nc.is_contiguous())
        naive.assert_close_scaled(
            naive.outputs("grouped_mm", x_nc, weight_nc, indices, scores_nc, 3, grad_out), exact, 2e-6
        )


def test_autocast_bf16_matches_float64():
    """fp32 leaves under CPU autocast: the op computes in bf16, the leaves get fp32 gradients of the right value."""
    x, weight, indices, scores, grad_out = float64_inputs(CASES["switchhead-v"], seed=5)
    leaves = [t.float().requires_grad_() for t in (x, weight, scores)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = expert_matmul(*leaves[:2], route(indices, 4), leaves[2], 3, impl="grouped_mm")
    assert y.dtype == torch.bfloat16
    y.backward(grad_out.to(y.dtype))
    assert all(leaf.grad.dtype == torch.float32 for leaf in leaves)
    exact = naive.outputs("torch", x, weight, indices, scores, 3, grad_out)
    naive.assert_close_scaled([y.detach().double(), *(leaf.grad.double() for leaf in leaves)], exact, 3e-2)


def test_the_presets_unaligned_widths_run():
    """47M SwitchHead's V projection in bf16: d_model 412 and d_head 76 are not 16-byte rows; padded, not refused."""
    case = Case("47m switchhead-v", 32, 1, 4, 2, 10, 1, 412, 76, True)
    x, weight, indices, scores, grad_out = float64_inputs(case, seed=2)
    exact = naive.outputs("torch", x, weight, indices, scores, 2, grad_out)
    bf16 = [t.to(torch.bfloat16) for t in (x, weight, scores)]
    naive.assert_close_scaled(
        naive.outputs("grouped_mm", bf16[0], bf16[1], indices, bf16[2], 2, grad_out), exact, 3e-2
    )


def test_deterministic():
    x, weight, indices, scores, grad_out = float64_inputs(CASES["sigma-moe-down"], seed=3)
    args = (x.float(), weight.float(), indices, scores.float(), 1, grad_out)
    for a, b in zip(naive.outputs("grouped_mm", *args), naive.outputs("grouped_mm", *args), strict=True):
        assert torch.equal(a, b)


def test_float64_is_refused():
    x, weight, indices, scores, _ = float64_inputs(CASES["k-1"])
    with pytest.raises(ValueError, match="grouped_mm expert matmul takes fp32, fp16 or bf16"):
        expert_matmul(x, weight, route(indices, 3), scores, 2, impl="grouped_mm")


def test_custom_op_registration():
    """Schema, fake implementation and autograd registration agree with the real op (opcheck)."""
    x, weight, indices, scores, _ = float64_inputs(CASES["switchhead-v"])
    routing = route(indices, weight.shape[0])
    leaves = [t.float().requires_grad_() for t in (x, weight, scores)]
    torch.library.opcheck(
        torch.ops.switchbench.expert_matmul.default,
        (*leaves, routing.indices, routing.order, routing.experts, routing.offsets, 3, "grouped_mm"),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


def test_backward_takes_an_fp32_gradient_with_bf16_inputs():
    """As under CUDA autocast: the backward op casts an fp32 incoming gradient to the inputs' bf16."""
    x, weight, indices, scores, grad_out = float64_inputs(CASES["switchhead-o"])
    routing = route(indices, weight.shape[0])
    inputs = [t.to(torch.bfloat16) for t in (x, weight, scores)]
    got = torch.ops.switchbench.expert_matmul_backward(
        grad_out.float(),
        *inputs,
        routing.indices,
        routing.order,
        routing.experts,
        routing.offsets,
        "grouped_mm",
    )
    exact = naive.outputs("torch", x, weight, indices, scores, 1, grad_out)[1:]
    assert all(a.dtype == torch.bfloat16 for a in got)
    naive.assert_close_scaled([torch.zeros(1), *(a.double() for a in got)], [torch.zeros(1), *exact], 3e-2)
