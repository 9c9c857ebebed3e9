"""The expert matmul as dense GEMMs over every expert against a float64 loop: output and every gradient, for every
family's groupings (one input group or one output group), gated and not, uneven and empty experts, a token whose
slots share an expert, fp32 and bf16; and its refusal where neither side has one group."""

from dataclasses import replace

import naive
import pytest
import torch

from switchbench.ops.expert_matmul.cases import CASES, Case, float64_inputs
from switchbench.ops.expert_matmul.op import expert_matmul, route

# MoA's output projection: per-head input, one output per token (S_in = S, S_out = 1)
FAMILY_CASES = {name: case for name, case in CASES.items() if 1 in (case.in_groups, case.out_groups)}
FAMILY_CASES["moa-o"] = Case("moa-o", 8, 4, 4, 1, 6, 1, 24, 20, True)
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("gated", [True, False], ids=["gates", "no-gates"])
@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_all_experts_matches_float64(case, gated, dtype):
    s_out = FAMILY_CASES[case].out_groups
    x, weight, indices, scores, grad_out = float64_inputs(FAMILY_CASES[case])
    scores = scores if gated else None
    exact = naive.outputs("torch", x, weight, indices, scores, s_out, grad_out)
    inputs = [None if t is None else t.to(dtype) for t in (x, weight, scores)]
    got = naive.outputs("all_experts", inputs[0], inputs[1], indices, inputs[2], s_out, grad_out)
    naive.assert_close_scaled(got, exact, TOLERANCE[dtype])


def test_slots_that_share_an_expert_add_up():
    """Two slots of one token on one expert (the op allows it; top-k never does): both forms add both."""
    for case in (CASES["switchhead-v"], CASES["switchhead-o"]):
        x, weight, indices, scores, grad_out = float64_inputs(replace(case, routing="one-expert"))
        exact = naive.outputs("torch", x, weight, indices, scores, case.out_groups, grad_out)
        got = naive.outputs("all_experts", x, weight, indices, scores, case.out_groups, grad_out)
        for a, ref in zip(got, exact, strict=True):
            torch.testing.assert_close(a, ref, rtol=1e-12, atol=1e-12)


def test_neither_side_with_one_group_is_refused():
    case = CASES["k-1"]  # two input groups, two output groups
    x, weight, indices, scores, _ = float64_inputs(case)
    with pytest.raises(
        ValueError, match="all_experts needs one input group or one output group; got 2 and 2"
    ):
        expert_matmul(x, weight, route(indices, weight.shape[0]), scores, case.out_groups, impl="all_experts")
