"""Helpers the tests share: the expert matmul run on one implementation as float64 results and compared with the
float64 loop's, and the check every family's exact cost is held to. The expert-matmul cases and their float64 reference are the package's
(``switchbench.ops.expert_matmul.cases``), read by the benchmarks too."""

import torch
from optional import installed

from switchbench.ops.expert_matmul.cases import CASES, Case, float64_inputs
from switchbench.ops.expert_matmul.op import expert_matmul as op
from switchbench.ops.expert_matmul.op import route

NAMES = ("out", "grad_x", "grad_w", "grad_scores")
# The tests' cases and MoA's output projection: per-head input, one output per token (S_in = S, S_out = 1)
FAMILY_CASES = CASES | {"moa-o": Case("moa-o", 8, 4, 4, 1, 6, 1, 24, 20, True)}


def outputs(impl, x, weight, indices, scores, s_out, grad_out, device="cpu"):
    """Output and gradients (NAMES; no grad_scores without scores) of the op on one implementation, as float64
    CPU tensors."""
    leaves = [
        t.detach().to(device).requires_grad_() for t in (x, weight) + (() if scores is None else (scores,))
    ]
    gates = None if scores is None else leaves[2]
    y = op(leaves[0], leaves[1], route(indices.to(device), weight.shape[0]), gates, s_out, impl=impl)
    y.backward(grad_out.to(device, y.dtype))
    return [t.detach().double().cpu() for t in (y, *(leaf.grad for leaf in leaves))]


def assert_matches_float64(
    impl: str, case: Case, gated: bool, dtype: torch.dtype, atol: float, device: str = "cpu"
) -> None:
    """``impl`` on ``case``'s inputs in ``dtype`` (on ``device``) against the PyTorch path in float64 on the CPU: the
    output and every gradient."""
    x, weight, indices, scores, grad_out = float64_inputs(case)
    scores = scores if gated else None
    exact = outputs("torch", x, weight, indices, scores, case.out_groups, grad_out)
    inputs = [None if t is None else t.to(dtype) for t in (x, weight, scores)]
    got = outputs(impl, inputs[0], inputs[1], indices, inputs[2], case.out_groups, grad_out, device)
    assert_close_scaled(got, exact, atol)


def assert_close_scaled(got, exact, atol) -> None:
    """Each output and gradient within ``atol`` of the float64 one, relative to the latter's largest value."""
    assert len(got) == len(exact)
    for what, a, ref in zip(NAMES, got, exact, strict=False):
        scale = ref.abs().max().clamp(min=1)
        torch.testing.assert_close(
            a / scale, ref / scale, rtol=0, atol=atol, msg=lambda m, w=what: f"{w}: {m}"
        )


def assert_counted_exactly(cfg) -> None:
    """The exact cost of ``cfg``'s attention layer equals what fvcore and FlopCounterMode count (MACs, of one
    sequence and of a batch) and what saved-tensor hooks see (floats kept for backward): the check every family's
    cost is held to."""
    from switchbench.bench.cost import measure
    from switchbench.bench.cost.accounting import exact_cost

    exact = exact_cost(cfg)
    assert measure.flop_counter_macs(cfg) == exact.macs
    assert measure.flop_counter_macs(cfg, batch=3) == exact.batched_macs(3)
    assert measure.saved_floats(cfg) == exact.mem
    # Where fvcore is missing (a GPU node) the other two still hold every example: a skip here, inside a
    # Hypothesis test, ended it after its first
    if installed("fvcore"):
        assert measure.fvcore_macs(cfg) == exact.macs
