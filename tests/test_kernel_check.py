"""kernel-check: the JIT's specialisation, the recorded launches, the roofline's counts, and (slow) that every
kernel compiles for sm_90 without a spill at the 262M shapes, the expert matmul's to wgmma."""

import json

import pandas as pd
import pytest
import torch

triton = pytest.importorskip("triton")

from switchbench.bench.kernels import check as kernel_check
from switchbench.bench.kernels import roofline
from switchbench.bench.kernels.bench import Case, attention_shapes, cases
from switchbench.cli import main
from switchbench.ops import tuned as tuning
from switchbench.ops.attention import flash as attention_flash
from switchbench.ops.expert_matmul import triton_kernels as kernels


def test_integers_are_specialised_as_the_jit_does():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    values = (1, 2, 16, 17, 112, 146, 2**31 + 16)
    signature, constexprs, divisible = kernel_check._specialise(
        type("F", (), {"arg_names": [f"a{i}" for i in range(len(values))]}), values, {}
    )
    for i, value in enumerate(values):
        kind, hint = native_specialize_impl(BaseBackend, value, False, True, True)
        assert signature[f"a{i}"] == kind
        assert ((i,) in constexprs) == (kind == "constexpr")
        assert ((i,) in divisible) == (hint == "D")


def test_launches_cover_forward_and_every_gradient_at_padded_widths():
    moa_o = next(c for c in cases("262m", batch=1) if c.name.endswith("moa-o"))  # d_in = d_head 146
    recorded = kernel_check.launches(moa_o, torch.bfloat16)
    names = [(phase, fn.__name__) for phase, fn, *_ in recorded]
    assert names == [
        ("forward", "_scatter_matmul_kernel"),
        ("backward", "_scatter_matmul_kernel"),
        ("backward", "_grouped_outer_kernel"),
    ]
    for _, fn, _, args, constants in recorded:
        values = dict(zip(fn.arg_names, args, strict=False)) | constants
        assert values["d_in"] % 16 == 0 and values["d_out"] % 16 == 0
        assert 146 in (moa_o.d_in, moa_o.d_out) and 160 in (values["d_in"], values["d_out"])
    assert dict(zip(recorded[1][1].arg_names, recorded[1][3], strict=False))["dot_ptr"] is not None


def test_autotuner_configs_are_pruned_to_the_output_width():
    fn, tuned = kernels._scatter_matmul_kernel, kernels._scatter_matmul_tuned
    narrow = kernel_check._configs(tuned, fn, (), {"d_out": 112})
    assert {c.kwargs["BLOCK_N"] for c in narrow} == {64, 128}
    assert len(kernel_check._configs(tuned, fn, (), {"d_out": 1024})) == len(
        kernels.CONFIGS["scatter_matmul"]
    )


def test_pinned_config(monkeypatch):
    monkeypatch.setenv(
        tuning.ENV, "grouped_outer=M64 N128 K128 SPLIT4 w8 s3; scatter_matmul=M64 N64 K64 w4 s4"
    )
    got = kernels.pinned("grouped_outer")
    assert (got.kwargs, got.num_warps, got.num_stages) == (
        {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT": 4},
        8,
        3,
    )
    assert kernels.pinned("scatter_matmul").kwargs["BLOCK_N"] == 64
    monkeypatch.setenv(tuning.ENV, "scatter_matmul=M16 N16 K16 w1 s1")
    with pytest.raises(ValueError, match="not a scatter_matmul config"):
        kernels.pinned("scatter_matmul")


def test_roofline_counts_by_hand():
    # 4 tokens x 2 slots, one input row each and one output row for both; 3 experts, 32 -> 16 wide, bf16
    case = Case(
        "hand",
        tokens=4,
        in_groups=2,
        slots=2,
        out_groups=1,
        experts_per_group=3,
        groups=1,
        d_in=32,
        d_out=16,
        gated=False,
    )
    got = {name: (nbytes, macs) for name, nbytes, macs in roofline.passes(case, 2)}
    m, w = 8, 3 * 32 * 16 * 2
    assert got["forward matmul"] == (m * 32 * 2 + w + m * 16 * 2 + m * 8, m * 32 * 16)
    assert got["forward slot sum"] == ((m * 16 + 4 * 16) * 2, 0)
    assert got["grad_x matmul"] == (m * 16 * 2 + w + m * 32 * 2 + m * 8, m * 32 * 16)
    assert got["grad_w matmul"] == (m * 48 * 2 + w + m * 8, m * 32 * 16)
    assert "grad_x slot sum" not in got  # one slot per input row: a view
    assert roofline.milliseconds(3.35e9, 0, "H100 SXM", "bf16") == pytest.approx(1.0)
    assert roofline.milliseconds(0, 989e12 / 2 / 1e3, "H100 SXM", "bf16") == pytest.approx(1.0)


def test_all_experts_roofline_counts_by_hand():
    """Three GEMMs over every expert, E / S times the routed MACs, in the form each side's groups give: with one
    input group x W_cat, [4, 32] @ [32, 3 x 16]; with one output group the laid-out rows, [4, 3 x 32] @ [96, 16];
    and the pass that lays rows out by expert."""
    by_input = Case("v", 4, 1, 2, 2, 3, 1, 32, 16, True)
    by_output = Case("o", 4, 2, 2, 1, 3, 1, 32, 16, True)
    w = 3 * 32 * 16 * 2
    for case, gemm in ((by_input, "forward GEMM"), (by_output, "forward GEMM")):
        got = {name: (nbytes, macs) for name, nbytes, macs in roofline.all_experts_passes(case, 2)}
        assert sum(macs for _, macs in got.values()) == 3 * 4 * 3 * 32 * 16  # every expert, three times
        wide = 4 * 3 * (16 if case is by_input else 32) * 2  # Y [N, E d_out] or the laid-out X [N, E d_in]
        edge = 4 * 32 * 2 if case is by_input else 4 * 16 * 2  # x read, or out written
        assert got[f"all_experts: {gemm}"] == (edge + w + wide, 4 * 3 * 32 * 16)
        assert all(macs == 0 for name, (_, macs) in got.items() if "GEMM" not in name)
        # the Triton lay-out: each slot's row (its gate and expert id) read once, every place of [N, E, d] written
        width = 16 if case is by_input else 32
        slot_rows, gates, ids = 4 * 2 * width * 2, (0 if case is by_input else 4 * 2 * 2), 4 * 2 * 8
        laid_out = "backward: lay out by expert" if case is by_input else "forward: lay out by expert"
        assert got[f"all_experts: {laid_out}"] == (slot_rows + gates + ids + wide, 0)
    # ungated, four slots into two output groups: each slot's row (and its id) read once, each group's row written,
    # in the one pass that picks them: no pass of its own sums the slots
    ungated = Case("v", 4, 1, 4, 2, 3, 1, 32, 16, False)
    got = {name: (nbytes, macs) for name, nbytes, macs in roofline.all_experts_passes(ungated, 2)}
    assert got["all_experts: forward: pick slots"] == (4 * 4 * 16 * 2 + 4 * 4 * 8 + 4 * 2 * 16 * 2, 0)
    assert "all_experts: forward: gate and slot sum" not in got
    assert roofline.all_experts_passes(Case("k-1", 4, 2, 2, 2, 3, 1, 32, 16, True), 2) == []


def test_flash_attention_is_checked_over_every_familys_distinct_window():
    """At 262M and at its RoPE size, by the presets' heads: each family's query heads over the key heads it caches,
    at its head width padded to a multiple of 16, with XL's term or none; a window two families share (dense's and
    MoH's, SwitchHead's and SwitchAll's) once; MoA's 146-channel heads, wider than the kernel takes, not at all."""
    found = {
        (s.role, s.heads, s.key_heads, s.queries, s.keys, s.width, s.term) for s in attention_shapes("262m")
    }
    assert found == {
        ("262m", 16, 16, 512, 1024, 64, True),  # dense: 16 heads of 64; a chunk of 512 and one cached
        ("262m", 4, 4, 512, 1024, 112, True),  # SwitchHead: 4 heads of 112
        ("262m", 16, 4, 512, 1024, 64, True),  # GQA: 16 query heads over 4
        ("244m-rope", 16, 16, 1024, 1024, 64, False),  # RoPE: chunks of 1024, nothing cached
        ("244m-rope", 4, 4, 1024, 1024, 112, False),  # SwitchHead's 100 channels padded to 112
        ("244m-rope", 16, 4, 1024, 1024, 64, False),
    }


def test_the_position_bias_is_checked_as_the_model_launches_it():
    """Both kernels specialised as the 262M dense model's launches are at batch 64 (its scores by distance made
    head by head, the bias in aligned rows): no size or stride the JIT would compile as a constant, or as
    16-divisible, where the model's is not."""
    from switchbench.models.layers.attention_xl import scores_by_distance
    from switchbench.models.presets import PRESETS
    from switchbench.ops.attention import position_kernels
    from switchbench.ops.attention.layout import empty_in_order, order_of
    from switchbench.ops.attention.relative import aligned_width

    cfg = PRESETS["c4-262m-transformer-h16"]
    H, t, S, d = cfg.n_heads, cfg.T, 2 * cfg.T, cfg.d_head
    meta = {"dtype": torch.bfloat16, "device": "meta"}
    q = torch.empty(64, t, H, d, **meta).transpose(1, 2)  # head-split
    scores = scores_by_distance(q, torch.empty(H, d, S, **meta))
    bias = torch.empty(64, H, t, aligned_width(S), **meta)[..., :S]
    gradient = empty_in_order(bias, scores.shape, order_of(scores))
    mask = torch.empty(t, S, dtype=torch.bool, device="meta")
    model = [
        position_kernels._arguments(scores, bias, mask, S, S)[1:],
        position_kernels._arguments(bias, gradient, mask, S, S)[1:],
    ]
    checked = position_kernels.launches(t, S, H, torch.bfloat16)
    for (_, fn, *launch), real in zip(checked, model, strict=True):
        assert kernel_check._specialise(fn, *launch) == kernel_check._specialise(fn, *real)


@pytest.mark.slow
def test_every_kernel_compiles_to_wgmma_without_spills_on_sm90(capsys):
    """The expert matmul's and the flash attention's kernels to pipelined wgmma (flash attention's grouped and
    RoPE windows too); the position bias's two copies, each router's Triton
    routing (the top-k for SwitchHead's four experts a head, the count and placement for every router) and
    all_experts' passes around its GEMMs to no tensor-core MMA."""
    assert main(["kernel-check", "--arch", "sm_90", "--dtype", "bf16", "--sizes", "262m", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    routers = {"262m switchhead-v", "262m switchhead-o", "262m moa-q", "262m sigma-moe-up"}
    expert_cases = {c.name for c in cases("262m", 1)[:-1]}
    widths = {  # every family's distinct window, XL's and RoPE's; MoA's 146-channel heads are refused
        f"{role} {model} attention d{width}": width
        for role in ("262m", "244m-rope")
        for model, width in (("transformer", 64), ("switchhead", 112), ("gqa", 64))
    }
    attention = set(widths)
    assert {r["case"] for r in rows} == expert_cases | {"262m position bias"} | attention | {
        f"{name} routing" for name in routers
    } | {f"{name} all_experts" for name in expert_cases}
    flash = {(r["case"], r["kernel"], r["config"]) for r in rows if r["case"] in attention}
    assert flash == {  # every candidate the measured choice may pick
        (case, f"{kernel}{suffix}", attention_flash.config_label(config))
        for case, width in widths.items()
        for kernel, suffix in (
            ("forward", " (forward)"),
            ("key_block", "_backward (backward)"),
            ("query_block", "_backward (backward)"),
        )
        for config in attention_flash.candidates(kernel, width)
    }
    position = [r for r in rows if r["case"] == "262m position bias"]
    assert sorted(r["kernel"] for r in position) == ["gather (backward)", "spread (forward)"]
    routing = [r for r in rows if r["case"].endswith(" routing")]
    kernels = {(r["case"], r["kernel"]) for r in routing}
    grouping = {(f"{name} routing", k) for name in routers for k in ("count (count)", "place (place)")}
    ranking = {(f"262m switchhead-{side} routing", "top_k (top-k)") for side in "vo"}
    assert kernels == grouping | ranking
    passes = [r for r in rows if r["case"].endswith(" all_experts")]
    assert {(r["case"], r["kernel"]) for r in passes if "switchhead" in r["case"]} == {
        ("262m switchhead-v all_experts", "pick (forward)"),
        ("262m switchhead-v all_experts", "gate_sum (forward)"),
        ("262m switchhead-v all_experts", "gate_sum_backward (backward)"),
        ("262m switchhead-v all_experts", "lay_out (backward)"),
        ("262m switchhead-o all_experts", "lay_out (forward)"),
        ("262m switchhead-o all_experts", "pick (backward)"),
    }
    copies = position + routing + passes
    # no tensor-core MMA (the gating's multiply-adds are plain FMA)
    assert all(r["compiled"] and not r["spill_bytes"] and r["mma"] in ("none", "fma") for r in copies)
    matmuls = [r for r in rows if r not in copies]
    bad = [r for r in matmuls if not r["compiled"] or r["spill_bytes"] or r["mma"] != "wgmma"]
    assert not bad, bad[:3]
    assert out["failed"] == 0 and all(r["pipelined"] for r in matmuls)


def test_a_kernel_over_the_archs_shared_memory_fails():
    """It compiles, yet no block of the arch can launch it: 288 KiB (a 128 x 128 tile of 128 channels in three
    stages) against sm_90's 227 KiB; 200 KiB fits sm_90 but not sm_80's 163 KiB."""
    rows = pd.DataFrame(
        [
            {
                "kernel": "query_block_backward",
                "arch": arch,
                "compiled": True,
                "spill_bytes": 0,
                "shared_bytes": kib * 1024,
                "mma": mma,
            }
            for arch, kib, mma in (
                ("sm_90", 288, "wgmma"),
                ("sm_90", 200, "wgmma"),
                ("sm_80", 200, "mma.sync"),
            )
        ]
    )
    assert kernel_check.failing(rows).tolist() == [True, False, True]


@pytest.mark.parametrize(("spill", "code"), [(0, 0), (64, 1)])
def test_the_exit_says_whether_a_kernel_fails(spill, code, monkeypatch, capsys):
    """kernel-check exited 0 with 172 of 198 kernels failing: a CI step could not see a spill."""
    row = {"kernel": "matmul", "case": "c", "dtype": "bf16", "arch": "sm_90", "config": "-", "compiled": True}
    row |= {"registers": 128, "spill_bytes": spill, "shared_bytes": 1024, "mma": "wgmma", "pipelined": True}
    asked = []
    monkeypatch.setattr(kernel_check, "check", lambda *args: asked.append(args) or [row])
    assert main(["kernel-check", "--json"]) == code
    assert asked == [(["sm_90"], ["bf16"], ["47m", "262m"])]  # a bare run checked 262M alone
    out = json.loads(capsys.readouterr().out)
    assert out["failed"] == code
    # spills differ between Triton versions (3.6 spilled four candidates 3.9 compiled clean): the run names its own
    assert out["compiler"] == f"Triton {triton.__version__}"


def test_the_worker_s_progress_is_a_bar_and_its_other_lines_the_error(capsys):
    """kernel-check ran minutes without a word: the worker reports each compiled kernel, shown as a bar where
    stderr is a terminal (none here), and the rest of its stderr is kept for an error."""
    lines = [f"{kernel_check.PROGRESS} 1 3\n", "a warning\n", f"{kernel_check.PROGRESS} 3 3\n", "Traceback\n"]
    assert kernel_check._follow(iter(lines)) == ["a warning\n", "Traceback\n"]
    assert capsys.readouterr().err == ""  # no terminal: the bar stays quiet
