"""The kernel benchmark's cases, correctness gate and result files (on the CPU; timings mean nothing here)."""

import json
from pathlib import Path

import pytest
import torch

from switchbench.bench import kernels
from switchbench.cli import main

pytest.importorskip("triton")


def test_cases_are_the_presets_shapes():
    by_name = {c.name: c for c in kernels.cases("262m", batch=64)}
    v, o = by_name["262m switchhead-v"], by_name["262m switchhead-o"]
    # C4 262M SwitchHead: 4 heads x 112, E=4, k=2, d_model 1024, T=512 with one cached chunk
    assert v.macs == (64 * 1024) * (4 * 2) * 1024 * 112
    assert o.macs == (64 * 512) * (4 * 2) * 112 * 1024
    assert by_name["262m sigma-moe-up"].macs == (64 * 512) * 4 * 1024 * 128
    assert by_name["262m moa-o"].macs == (64 * 512) * 8 * 146 * 1024
    assert by_name["262m expert-sized"].macs == (64 * 1024 * 2 // 4) * 1024 * 112


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
    with pytest.raises(AssertionError, match="relative error"):
        kernels.measure(case, "triton", "cpu", torch.float32)


def test_cli_writes_results_without_overwriting(tmp_path, capsys):
    argv = ["kernel-bench", "--sizes", "47m", "--dtype", "fp32", "--out", str(tmp_path), "--json"]
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
