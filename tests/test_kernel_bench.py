"""The kernel benchmark's cases, correctness gate and result files (on the CPU; timings mean nothing here)."""

import json
from pathlib import Path

import pytest
import torch

from switchbench.bench import kernels
from switchbench.cli import main

pytest.importorskip("triton")


def _cli(out: Path) -> list[str]:
    return [
        "kernel-bench",
        "--sizes",
        "47m",
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--json",
    ]


def test_cases_are_the_presets_shapes():
    by_name = {c.name: c for c in kernels.cases("262m", batch=64)}
    v, o = by_name["262m switchhead-v"], by_name["262m switchhead-o"]
    # C4 262M SwitchHead: 4 heads x 112, E=4, k=2, d_model 1024, T=512 with one cached chunk
    assert v.macs == (64 * 1024) * (4 * 2) * 1024 * 112
    assert o.macs == (64 * 512) * (4 * 2) * 112 * 1024
    assert by_name["262m sigma-moe-up"].macs == (64 * 512) * 4 * 1024 * 128
    assert by_name["262m moa-o"].macs == (64 * 512) * 8 * 146 * 1024
    assert by_name["262m expert-sized"].macs == (64 * 1024 * 2 // 4) * 1024 * 112


@pytest.mark.slow
def test_triton_is_checked_then_timed():
    case = kernels.Case("tiny", tokens=20, in_groups=2, slots=4, out_groups=1, experts_per_group=3, groups=2,
                        d_in=24, d_out=20, gated=True)  # fmt: skip
    rows = kernels.measure(case, "triton", "cpu", torch.float32)
    assert [r["pass"] for r in rows] == ["forward", "forward+backward"]
    assert all(r["max_rel_error"] < 1e-5 and r["ms"] > 0 for r in rows)
    assert rows[1]["tflops"] == pytest.approx(2 * 3 * case.macs / rows[1]["ms"] / 1e9)


def test_a_wrong_kernel_is_not_timed(monkeypatch):
    case = kernels.Case("tiny", 8, 1, 2, 1, 3, 1, 16, 16, True)
    broken = dict(kernels.IMPLEMENTATIONS, triton=lambda c, i: 1.01 * kernels.IMPLEMENTATIONS["torch"](c, i))
    monkeypatch.setattr(kernels, "IMPLEMENTATIONS", broken)
    rows = kernels.measure(case, "triton", "cpu", torch.float32)
    assert [r["status"] for r in rows] == ["wrong", "wrong"] and not any("ms" in r for r in rows)
    assert rows[0]["error"].startswith("out relative error 1.00e-02")


@pytest.mark.slow
def test_cli_writes_results_without_overwriting(tmp_path, capsys):
    argv = _cli(tmp_path)
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["saved"] != second["saved"]
    saved = json.loads(Path(first["saved"]).read_text())
    assert saved["metadata"]["torch"] == torch.__version__ and saved["metadata"]["batch"] == 1
    assert {r["impl"] for r in saved["rows"]} == {"torch", "dense"}
    assert len(list(tmp_path.glob("*.csv"))) == 2
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_peers_match_the_torch_path_in_output_and_every_gradient(impl):
    # 16-byte rows in bf16 for grouped_mm; an expert without tokens (3 experts, k=2 of them per token)
    case = kernels.Case("tiny", tokens=9, in_groups=2, slots=4, out_groups=1, experts_per_group=3, groups=2,
                        d_in=24, d_out=16, gated=True)  # fmt: skip
    dtype = torch.bfloat16 if impl == "grouped_mm" else torch.float32
    assert kernels.unsupported(impl, case, dtype) is None
    inputs = kernels.make_inputs(case, "cpu", dtype)
    got, ref = kernels.outputs(case, inputs, impl), kernels.outputs(case, inputs, "torch")
    assert set(got) == {"out", "grad_x", "grad_weight", "grad_scores"}
    for name in got:
        scale = ref[name].abs().max()
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got[name] / scale, ref[name] / scale, rtol=0, atol=tol)
    rows = kernels.measure(case, impl, "cpu", dtype)
    assert [r["pass"] for r in rows] == ["forward", "forward+backward"]
    assert all(r["ms_min"] <= r["ms"] <= r["ms_max"] and r["repeats"] == 5 for r in rows)


def test_grouped_mm_is_skipped_with_its_reason():
    case = kernels.Case("odd", 8, 1, 2, 1, 3, 1, 146, 32, True)
    rows = kernels.measure(case, "grouped_mm", "cpu", torch.bfloat16)
    assert all("16-byte rows" in r["skipped"] for r in rows)
    assert "bf16" in kernels.unsupported("grouped_mm", case, torch.float32)


def test_a_kernel_wrong_only_in_its_gradients_is_not_timed(monkeypatch):
    def wrong_backward(case, inputs):
        y = kernels.IMPLEMENTATIONS["torch"](case, inputs)
        return y + 0.01 * (y - y.detach())  # the same output, gradients 1% too large

    case = kernels.Case("tiny", 8, 1, 2, 1, 3, 1, 16, 16, True)
    monkeypatch.setattr(kernels, "IMPLEMENTATIONS", dict(kernels.IMPLEMENTATIONS, loop=wrong_backward))
    rows = kernels.measure(case, "loop", "cpu", torch.float32)
    assert {r["status"] for r in rows} == {"wrong"} and "grad_x relative error" in rows[0]["error"]


def test_a_wrong_row_is_recorded_and_the_command_exits_1(tmp_path, monkeypatch, capsys):
    """A failed check is a row and the sweep goes on (on an H100 it was a traceback and no file); exit 1."""
    broken = dict(kernels.IMPLEMENTATIONS, loop=lambda c, i: 1.01 * kernels.IMPLEMENTATIONS["torch"](c, i))
    monkeypatch.setattr(kernels, "IMPLEMENTATIONS", broken)
    monkeypatch.setattr(kernels, "default_impls", lambda device: ["loop", "dense"])
    monkeypatch.setattr(
        kernels, "cases", lambda size, batch: [kernels.Case("tiny", 8, 1, 2, 1, 3, 1, 16, 16, True)]
    )
    argv = _cli(tmp_path)
    assert main(argv) == 1
    captured = capsys.readouterr()
    rows = json.loads(Path(json.loads(captured.out)["saved"]).read_text())["rows"]
    assert {(r["impl"], r["status"]) for r in rows} == {("loop", "wrong"), ("dense", "ok")}
    assert captured.err.strip().startswith(
        "switchbench kernel-bench: loop on tiny is wrong: out relative error"
    )


def test_a_case_too_large_for_memory_is_refused_before_it_starts(tmp_path, capsys):
    """--batch 10000000 on the CPU used to be killed by the system at about 24 GB, with no message and no file."""
    argv = ["kernel-bench", "--sizes", "47m", "--batch", "10000000", "--dtype", "fp32", "--device", "cpu",
            "--out", str(tmp_path), "--json"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows and all(r["status"] == "OOM" and "GiB free" in r["reason"] for r in rows)


def test_the_memory_estimate_is_a_lower_bound_of_the_inputs():
    case = kernels.Case("tiny", tokens=9, in_groups=2, slots=4, out_groups=1, experts_per_group=3, groups=2,
                        d_in=24, d_out=16, gated=True)  # fmt: skip
    inputs = kernels.make_inputs(case, "cpu", torch.float32)
    held = sum(inputs[k].numel() for k in ("x", "weight", "scores", "rows")) * 4
    assert held <= kernels.estimated_bytes(case) <= held + 4 * 9 * 4 * 16  # plus one output row per slot


def test_gradients_are_reset_before_every_timed_call():
    leaf = torch.ones(3, requires_grad=True)
    seen = []

    def step():
        seen.append(leaf.grad is None)
        leaf.sum().backward()

    times = kernels.timer("cpu")(step, grad_to_none=[leaf])
    assert len(times) == 5 and seen == [True] * 6  # the warm-up call, then each timed one


def test_the_kernel_only_peer_is_checked_against_its_float64_loop(monkeypatch):
    """grouped_mm on rows already in expert order (no sort, gather or unsort timed), checked in its output and
    the gradients of its sorted rows and weight before it is timed."""
    case = kernels.Case("tiny", tokens=9, in_groups=2, slots=4, out_groups=1, experts_per_group=3, groups=2,
                        d_in=24, d_out=16, gated=True)  # fmt: skip
    rows = kernels.measure(case, "grouped_mm-kernel", "cpu", torch.bfloat16)
    assert [r["status"] for r in rows] == ["ok", "ok"] and rows[0]["max_rel_error"] < 1e-2
    got = kernels.outputs(case, kernels.make_inputs(case, "cpu", torch.bfloat16), "grouped_mm-kernel")
    assert set(got) == {"out", "grad_sorted", "grad_weight"} and got["out"].shape == (9 * 4, 16)
    off_by_one = dict(
        kernels.IMPLEMENTATIONS, **{"grouped_mm-kernel": lambda c, i: 1.05 * kernels._grouped_mm_kernel(c, i)}
    )
    monkeypatch.setattr(kernels, "IMPLEMENTATIONS", off_by_one)
    assert {r["status"] for r in kernels.measure(case, "grouped_mm-kernel", "cpu", torch.bfloat16)} == {
        "wrong"
    }
