"""Plain references shared by the tests: the expert matmul slot by slot, and the cases and routing patterns it is
tried on."""

import pytest
import torch
from optional import installed

from switchbench.ops.expert_matmul.op import expert_matmul as op
from switchbench.ops.expert_matmul.op import route


def expert_matmul(x, weight, indices, scores, s_out):
    """out[n, s // (S/S_out)] += scores[n, e] * x[n, s // (S/S_in)] @ weight[e], e = indices[n, s], one slot at a
    time, in x's dtype; differentiable, so its gradients are references too."""
    n_tokens, s_in = x.shape[:2]
    slots = indices.shape[1]
    rows = []
    for n in range(n_tokens):
        groups = [x.new_zeros(weight.shape[2]) for _ in range(s_out)]
        for s in range(slots):
            e = int(indices[n, s])
            term = x[n, s // (slots // s_in)] @ weight[e]
            if scores is not None:
                term = scores[n, e] * term
            groups[s // (slots // s_out)] = groups[s // (slots // s_out)] + term
        rows.append(torch.stack(groups))
    return torch.stack(rows)


ROUTINGS = ("random", "two-experts", "one-expert", "all-experts")


def routing(pattern: str, n_tokens: int, n_experts: int, slots: int, gen: torch.Generator) -> torch.Tensor:
    """[N, S] expert indices: uniform; only experts 0 and 2 (the others get no slot); every slot to the last
    expert; or k = E, each token using every expert once in its own order."""
    if pattern == "random":
        return torch.randint(0, n_experts, (n_tokens, slots), generator=gen)
    if pattern == "two-experts":
        return torch.tensor([0, 2])[torch.randint(0, 2, (n_tokens, slots), generator=gen)]
    if pattern == "one-expert":
        return torch.full((n_tokens, slots), n_experts - 1)
    if pattern == "all-experts":
        assert slots == n_experts, "k = E"
        return torch.stack([torch.randperm(n_experts, generator=gen) for _ in range(n_tokens)])
    raise ValueError(pattern)


# (tokens N, S_in, slots S, S_out, experts E, d_in, d_out, routing): sizes off the 16-wide interpreter blocks, and
# off the 16-byte rows of the grouped GEMM
CASES = {
    "switchhead-v": (9, 1, 6, 3, 4, 37, 19, "random"),  # 3 heads x k=2, per-head output
    "switchhead-o": (7, 3, 6, 1, 5, 19, 23, "random"),  # per-head input, sum over heads and choices
    "sigma-moe-up": (11, 1, 3, 3, 6, 17, 18, "random"),
    "sigma-moe-down": (11, 3, 3, 1, 6, 18, 17, "random"),
    "moa-q": (8, 1, 2, 2, 5, 20, 33, "random"),
    "single-token": (1, 1, 2, 1, 3, 5, 7, "random"),
    "empty-experts": (6, 1, 2, 1, 8, 16, 16, "two-experts"),
    "one-expert-takes-all": (13, 1, 1, 1, 4, 21, 9, "one-expert"),
    "k-equals-E": (5, 1, 4, 1, 4, 9, 17, "all-experts"),
    "k-1": (10, 2, 2, 2, 3, 33, 5, "random"),
}
NAMES = ("out", "grad_x", "grad_w", "grad_scores")


def make_case(n, s_in, slots, s_out, n_experts, d_in, d_out, pattern, seed=0):
    """Seeded float64 inputs of one case: x, weight, indices, scores and the output's gradient."""
    gen = torch.Generator().manual_seed(seed)
    indices = routing(pattern, n, n_experts, slots, gen)
    x = torch.randn(n, s_in, d_in, generator=gen, dtype=torch.float64)
    weight = torch.randn(n_experts, d_in, d_out, generator=gen, dtype=torch.float64)
    scores = torch.rand(n, n_experts, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(n, s_out, d_out, generator=gen, dtype=torch.float64)
    return x, weight, indices, scores, grad_out


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


def assert_counted_exactly(cfg) -> None:
    """The exact cost of ``cfg``'s attention layer equals what fvcore and FlopCounterMode count (MACs) and what
    saved-tensor hooks see (floats kept for backward): the check every family's cost is held to."""
    from switchbench.bench.cost import measure
    from switchbench.bench.cost.accounting import exact_cost

    exact = exact_cost(cfg)
    assert measure.flop_counter_macs(cfg) == exact.macs
    assert measure.saved_floats(cfg) == exact.mem
    if not installed("fvcore"):
        pytest.skip("needs fvcore, which is not installed here (FlopCounterMode and saved floats agreed)")
    assert measure.fvcore_macs(cfg) == exact.macs
