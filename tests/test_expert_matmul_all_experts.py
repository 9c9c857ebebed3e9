"""The expert matmul as dense GEMMs over every expert against a float64 loop: output and every gradient, for every
family's groupings (one input group or one output group), gated and not, uneven and empty experts, a token whose
slots share an expert, fp32 and bf16, the passes around its GEMMs as Triton kernels and as eager PyTorch; and its
refusal where neither side has one group."""

import math
import os
from dataclasses import replace

import naive
import pytest
import torch
from small import TRITON_DEVICE

from switchbench.ops.expert_matmul import all_experts, op
from switchbench.ops.expert_matmul.cases import CASES, float64_inputs
from switchbench.ops.expert_matmul.op import expert_matmul, route

# Every family's groupings with one input group or one output group
ONE_SIDE = {name: c for name, c in naive.FAMILY_CASES.items() if 1 in (c.in_groups, c.out_groups)}
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 3e-2}


@pytest.fixture(params=["triton", "torch"])
def passes(request, monkeypatch):
    """The passes around the GEMMs as Triton kernels (on the GPU, or in Triton's interpreter without one) or as
    eager PyTorch (the CPU's)."""
    if request.param == "torch":
        monkeypatch.setattr(all_experts, "fused", lambda t: False)
    elif torch.cuda.is_available():
        pass  # the op runs on the GPU (``device``), where the kernels are all_experts' own choice
    elif os.environ.get("TRITON_INTERPRET") == "1":
        monkeypatch.setattr(all_experts, "fused", lambda t: True)  # asked for: a CPU run is eager
    else:
        pytest.skip("Triton runs here on a GPU or in its interpreter")
    return request.param


def device(passes: str) -> str:
    """Where the op runs for ``passes``: Triton's where its kernels run."""
    return TRITON_DEVICE if passes == "triton" else "cpu"


# In the fast loop Triton's passes run SwitchHead's two projections (one input group, one output group), in fp64
# (exact) and bf16 (the casts): in Triton's interpreter each case costs a third of a second. The full suite runs
# every case, the edge cases included, in every dtype.
FAST_TRITON = ("switchhead-v", "switchhead-o")
assert set(FAST_TRITON) <= set(ONE_SIDE)
CASES_AND_DTYPES = [
    pytest.param(
        case,
        dtype,
        passes,
        marks=pytest.mark.slow
        if passes == "triton" and (dtype == torch.float32 or case not in FAST_TRITON)
        else (),
        id=f"{name}-{passes}-{case}",
    )
    for dtype, name in zip(TOLERANCE, ("fp64", "fp32", "bf16"), strict=True)
    for passes in ("triton", "torch")
    for case in ONE_SIDE
]


@pytest.mark.parametrize("gated", [True, False], ids=["gates", "no-gates"])
@pytest.mark.parametrize(("case", "dtype", "passes"), CASES_AND_DTYPES, indirect=["passes"])
def test_all_experts_matches_float64(case, gated, dtype, passes):
    naive.assert_matches_float64(
        "all_experts", ONE_SIDE[case], gated, dtype, TOLERANCE[dtype], device(passes)
    )


def test_slots_that_share_an_expert_add_up(passes):
    """Two slots of one token on one expert (the op allows it; top-k never does): both forms add both."""
    for case in (CASES["switchhead-v"], CASES["switchhead-o"]):
        x, weight, indices, scores, grad_out = float64_inputs(replace(case, routing="one-expert"))
        exact = naive.outputs("torch", x, weight, indices, scores, case.out_groups, grad_out)
        got = naive.outputs(
            "all_experts", x, weight, indices, scores, case.out_groups, grad_out, device(passes)
        )
        for a, ref in zip(got, exact, strict=True):
            torch.testing.assert_close(a, ref, rtol=1e-12, atol=1e-12)


def test_neither_side_with_one_group_is_refused():
    case = CASES["k-1"]  # two input groups, two output groups
    x, weight, indices, scores, _ = float64_inputs(case)
    with pytest.raises(
        ValueError, match="all_experts needs one input group or one output group; got 2 and 2"
    ):
        expert_matmul(x, weight, route(indices, weight.shape[0]), scores, case.out_groups, impl="all_experts")
    # asked ahead, as kernel-bench asks before it times a case; the routed implementations take any groups
    assert (
        op.unavailable("all_experts", 2, 2)
        == "all_experts needs one input group or one output group; got 2 and 2"
    )
    assert op.unavailable("all_experts", 1, 2) is None and op.unavailable("all_experts", 3, 1) is None
    assert op.unavailable("torch", 2, 2) is None


def _sorts(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name == "aten::sort" for e in prof.events())


def _matmul_macs(fn) -> list[int]:
    """The multiply-accumulates of each matrix product ``fn`` runs, as the CPU profiler records their shapes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    products = [e for e in prof.events() if e.name in ("aten::mm", "aten::bmm")]
    return [math.prod(a) * b[-1] for e in products for a, b in [e.input_shapes[:2]]]


@pytest.mark.parametrize("gated", [True, False], ids=["gates", "no-gates"])
def test_the_form_of_one_input_group_runs_three_gemms_as_a_dense_projection(gated):
    """Forward and backward of SwitchHead's value projection: one GEMM over every expert each way and one for the
    weight gradient, each of N x d_in x E d_out MACs; gated, its gates' gradient comes from the kept outputs, not a
    fourth GEMM that computes them again."""
    case = CASES["switchhead-v"]
    x, weight, indices, scores, grad_out = float64_inputs(case)
    x.requires_grad_(), weight.requires_grad_()
    routing = route(indices, weight.shape[0])
    gates = scores.requires_grad_() if gated else None

    def step():
        expert_matmul(x, weight, routing, gates, case.out_groups, impl="all_experts").backward(grad_out)

    assert _matmul_macs(step) == [case.tokens * case.d_in * case.n_experts * case.d_out] * 3


@pytest.mark.parametrize("impl", ["torch", "all_experts"])
def test_the_slots_are_grouped_only_for_an_implementation_that_reads_the_grouping(impl):
    """A router's slots are sorted by expert on first use: once for the routed implementations, forward and
    backward, never for all_experts, which reads the indices alone."""
    case = CASES["switchhead-v"]
    x, weight, indices, scores, grad_out = float64_inputs(case)
    x.requires_grad_()
    routing = route(indices, weight.shape[0], by="sort")

    def step():
        expert_matmul(x, weight, routing, scores, case.out_groups, impl=impl).backward(grad_out)

    assert _sorts(step) == (impl == "torch")


@pytest.mark.slow
def test_an_ungrouped_op_compiles_whole():
    """The op handed no grouping (None in its schema) traces into one graph with its backward, as every family's
    step must under torch.compile, and gives eager's output and gradients."""
    case = CASES["switchhead-o"]
    x, weight, indices, scores, grad_out = float64_inputs(case)

    def run(x, weight, scores):
        return expert_matmul(
            x, weight, route(indices, weight.shape[0]), scores, case.out_groups, "all_experts"
        )

    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (run, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weight, scores)]
        out = fn(*leaves)
        out.backward(grad_out)
        results.append([out, *(t.grad for t in leaves)])
    for got, expected in zip(*reversed(results), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["switchhead-v", "switchhead-o"])
def test_rows_wider_than_a_program_s_block_of_each_pass(name, passes):
    """Widths of 150 and 140 features: past the 128 a program of the layout and gating passes takes, and several
    steps of the column loops of the passes that loop (32 and 64 features a step), as the 47M and 262M widths are
    (the cases above fit in one block)."""
    case = replace(CASES[name], d_in=150, d_out=140)
    naive.assert_matches_float64(
        "all_experts", case, True, torch.float64, TOLERANCE[torch.float64], device(passes)
    )


@pytest.mark.parametrize("name", ["switchhead-v", "switchhead-o"])
def test_tokens_over_several_programs_of_each_pass(name, passes):
    """70 tokens: more than one program of each Triton pass takes (16 or 32), so the grid covers them all (the
    cases above fit in one)."""
    case = replace(CASES[name], tokens=70)
    naive.assert_matches_float64(
        "all_experts", case, True, torch.float64, TOLERANCE[torch.float64], device(passes)
    )
