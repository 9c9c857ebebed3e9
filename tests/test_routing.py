"""Grouping token slots by expert: the sort-free count and the Triton kernels (under TRITON_INTERPRET=1 without a
GPU) against the stable sort they replace, op by op and through every routed family (outputs and every gradient:
their top-k by rank included), and the choice of method."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from small import TIGHT, TRITON_DEVICE, make_lm, random_tokens, small_cfg

from switchbench.models import family as registry
from switchbench.models.layers.router import FEW_EXPERTS, sigmoid_topk
from switchbench.ops.expert_matmul.op import (
    ENV_ROUTING,
    MAX_GROUPED,
    ROUTINGS,
    route,
    routing_method,
    routing_selected,
)

ROUTED = ["switchhead", "switchall", "moa"]
SORT_FREE = [by for by in ROUTINGS if by != "sort"]


def _grouped_by_loop(indices: torch.Tensor, n_experts: int) -> tuple[list[int], list[int]]:
    """Slot ids expert by expert, each expert's in flat order, and each expert's start: by hand."""
    flat = indices.reshape(-1).tolist()
    order = [slot for e in range(n_experts) for slot, expert in enumerate(flat) if expert == e]
    counts = [flat.count(e) for e in range(n_experts)]
    return order, [sum(counts[:e]) for e in range(n_experts + 1)]


# deadline: the Triton interpreter's first launch of a kernel builds it; 30 examples, not 100: each launches
# Triton's grouping in its interpreter (tiles past one program: test_the_triton_grouping_past_its_tiles_is_the_sort)
@settings(deadline=None, max_examples=30)
@given(
    tokens=st.integers(0, 40),
    slots=st.integers(1, 6),
    experts=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_every_method_groups_slots_as_a_loop_does(tokens, slots, experts, seed):
    indices = torch.randint(experts, (tokens, slots), generator=torch.Generator().manual_seed(seed))
    order, offsets = _grouped_by_loop(indices, experts)
    for by in ROUTINGS:
        got_order, got_experts, got_offsets = _grouped(indices, experts, by)
        assert got_order.tolist() == order and got_offsets.tolist() == offsets, by
        assert got_experts.tolist() == sorted(indices.reshape(-1).tolist()), by
        assert got_order.dtype == got_offsets.dtype == torch.long


def _grouped(indices: torch.Tensor, n_experts: int, by: str) -> tuple[torch.Tensor, ...]:
    """(order, experts, offsets) of ``indices`` grouped ``by`` a method, on the CPU; Triton's made on the device
    its kernels run on."""
    routing = route(indices.to(TRITON_DEVICE) if by == "triton" else indices, n_experts, by)
    return tuple(t.cpu() for t in routing.grouped)


@pytest.mark.parametrize("by", SORT_FREE)
def test_a_sort_free_method_takes_a_strided_view_and_one_expert_for_everything(by):
    indices = torch.randint(6, (9, 8))[:, ::2]  # not contiguous
    assert torch.equal(_grouped(indices, 6, by)[0], route(indices, 6, by="sort").order)
    same = torch.full((5, 3), 2)
    assert _grouped(same, 4, by)[2].tolist() == [0, 0, 0, 15, 15]


@pytest.mark.parametrize(
    ("tokens", "slots", "experts", "programs"),
    [
        (1024, 8, 16, None),  # SwitchHead 262M's V (4 heads x 4 experts): a program a block of slots
        pytest.param(  # the most it counts, 66 blocks over 33 programs, each reading 2 tiles of counts
            700, 3, MAX_GROUPED, 40, marks=pytest.mark.slow
        ),
        (50, 4, MAX_GROUPED + 1, None),  # past it: sorted
    ],
)
def test_the_triton_grouping_past_its_tiles_is_the_sort(tokens, slots, experts, programs, monkeypatch):
    from switchbench.ops.expert_matmul import routing_kernels

    if programs:
        monkeypatch.setattr(routing_kernels, "_SPANS", programs)
    indices = torch.randint(experts, (tokens, slots), generator=torch.Generator().manual_seed(tokens))
    indices[0] = experts - 1  # the last expert taken
    triton, sort = _grouped(indices, experts, "triton"), route(indices, experts, "sort").grouped
    for got, want in zip(triton, sort, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("method", SORT_FREE)
@pytest.mark.parametrize("model", ROUTED)
def test_every_routed_family_computes_the_same_with_every_method(model, method):
    """Float64 logits and every parameter's gradient, bit for bit: the methods give one order, so every op after
    them sees the same tensors. (Where Triton's routing runs on a GPU, both do, where float64 atomics may add up
    in another order.)"""
    cfg = small_cfg(model)
    device = TRITON_DEVICE if method == "triton" else "cpu"
    tokens = random_tokens(cfg, 2 * cfg.T).to(device)
    results = {}
    for by in ("sort", method):
        lm = make_lm(cfg).to(device).train()
        with routing_selected(by):
            out = lm(tokens)
            out.loss(tokens.roll(-1, 1)).backward()
        results[by] = [out.logits.detach()] + [p.grad for p in lm.parameters() if p.grad is not None]
    assert len(results["sort"]) > 1
    exact = dict(rtol=0, atol=0) if device == "cpu" else TIGHT
    for a, b in zip(results["sort"], results[method], strict=True):
        torch.testing.assert_close(a, b, **exact)


@settings(deadline=None, max_examples=30)
@given(experts=st.integers(1, FEW_EXPERTS), data=st.data(), seed=st.integers(0, 2**16))
def test_every_method_breaks_ties_to_the_lower_expert_as_a_loop_does(experts, data, seed):
    """bf16 scores tie often (under autocast 0.1% of a router's token-heads): the sort gave a tie to the higher
    expert (torch's top-k on the CPU; either on CUDA), the count and Triton to the lower, so one model routed
    otherwise by method. Every method now picks as a loop ranking by (score, then lower id) does."""
    k = data.draw(st.integers(1, experts))
    gen = torch.Generator().manual_seed(seed)
    # four levels, and -inf (an expert dropped), so that most rows tie
    levels = torch.tensor([-math.inf, -1.0, 0.0, 1.0, 2.0])
    logits = levels[torch.randint(0, 5, (40, experts), generator=gen)]
    by_loop = [sorted(range(experts), key=lambda e, r=row: (-r[e], e))[:k] for row in logits.tolist()]
    for method in ROUTINGS:
        device = TRITON_DEVICE if method == "triton" else "cpu"
        with routing_selected(method):
            _, picked = sigmoid_topk(logits.to(device), k)
        assert picked.cpu().tolist() == by_loop, method


def test_the_method_is_chosen_named_then_from_the_environment_and_auto_sorts(monkeypatch):
    monkeypatch.delenv(ENV_ROUTING, raising=False)
    assert routing_method("cpu") == "sort"
    monkeypatch.setenv(ENV_ROUTING, "count")
    assert routing_method("cpu") == "count"
    with routing_selected("sort"):
        assert routing_method("cuda") == "sort"
    monkeypatch.setenv(ENV_ROUTING, "radix")
    with pytest.raises(
        ValueError, match="SWITCHBENCH_ROUTING: the routing must be one of auto, sort, count, triton"
    ):
        routing_method("cpu")
    with pytest.raises(ValueError, match="route by one of sort, count, triton"):
        route(torch.zeros(2, 1, dtype=torch.long), 1, by="radix")


@pytest.mark.parametrize(
    "model, changes",
    [
        ("switchhead", {}),
        ("switchhead", {"experts": "qkvo"}),
        ("switchhead", {"experts": "kvo", "shared_selection": True}),
        ("moa", {}),
        ("switchall", {}),
    ],
)
def test_a_family_declares_the_expert_matmuls_its_model_runs(model, changes, monkeypatch):
    """Each family's declared cases (what kernel-bench, kernel-tune and profile time) against the calls a model makes
    on its second chunk, the memory full: once a layer each, with its tokens, groups, slots, experts, widths and
    gates, and ``shared_by`` the number of calls handed the same routing."""
    from collections import Counter

    from switchbench.models.families import moa, switchhead
    from switchbench.models.layers import sigma_moe
    from switchbench.ops.expert_matmul import op

    calls = []

    def recorded(x, weight, routing, scores=None, out_groups=None, impl=None):
        s_out = routing.slots if out_groups is None else out_groups
        shape = (*x.shape[:2], routing.slots, s_out, routing.n_experts, x.shape[2], weight.shape[2])
        calls.append((*shape, scores is not None, routing))
        return op.expert_matmul(x, weight, routing, scores, out_groups, impl)

    cfg = small_cfg(model, **changes)
    lm, batch = make_lm(cfg), 3
    tokens = random_tokens(cfg, 2 * cfg.T, batch)
    state = lm(tokens[:, : cfg.T]).state
    for module in (switchhead, moa, sigma_moe):
        monkeypatch.setattr(module, "expert_matmul", recorded)
    lm(tokens[:, cfg.T :], state)
    shared = Counter(id(call[-1]) for call in calls)
    ran = Counter((*call[:-1], shared[id(call[-1])]) for call in calls)
    fields = (
        "tokens",
        "in_groups",
        "slots",
        "out_groups",
        "n_experts",
        "d_in",
        "d_out",
        "gated",
        "shared_by",
    )
    declared = [tuple(getattr(c, f) for f in fields) for c in registry.layer_expert_matmuls(cfg, batch)]
    assert ran == Counter(declared * cfg.n_layers)
