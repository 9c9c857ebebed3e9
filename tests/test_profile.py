"""``switchbench profile``: shares that add up to the step, each unit of time counted once and put where it ran."""

import json
import statistics
import time
from pathlib import Path

import pytest
import torch

from switchbench.bench import profile
from switchbench.bench.speed import model_benches
from switchbench.cli import main
from switchbench.models import expert_matmul, expert_matmul_choice
from switchbench.reports.report import load_profile, render


def _shares(rows: list[dict], what: str = "train step") -> dict[str, float]:
    return {r["name"]: r["ms"] for r in rows if r["kind"] == "share" and r["what"] == what}


def test_the_shares_add_up_to_the_step_timed_by_a_separate_clock():
    rows = profile.run(["tiny-switchhead"], ["train step"], 2, "cpu", torch.float32, steps=2, warmup=1, top=5)
    shares = _shares(rows)
    assert list(shares) == list(profile.SHARES)
    wall = rows[0]["ms_wall"]  # perf_counter around each profiled step, not the profiler's clock
    assert sum(shares.values()) == pytest.approx(wall, rel=0.02)
    assert sum(r["fraction"] for r in rows if r["kind"] == "share") == pytest.approx(1.0)


def test_every_operator_is_counted_once():
    """The units are operators' self times: summed with the host's time they give the step's range exactly, which
    an operator counted with its children (total times) would exceed."""
    bench = model_benches("tiny-switchhead", 2, "cpu", torch.float32)[0]
    bench.run()
    labels = profile._Labels(profile.module_roles(bench.module))
    with labels, torch.profiler.profile() as prof, torch.profiler.record_function(profile.STEP_LABEL):
        bench.run()
    events = list(prof.events())
    found, step_us = profile.units(events, "cpu")
    ops = [e for e in events if e.name.startswith(profile.OPERATORS)]
    assert len(found) == len(ops)
    assert sum(u.us for u in found) == pytest.approx(sum(e.self_cpu_time_total for e in ops))
    assert sum(u.us for u in found) < step_us < sum(e.cpu_time_total for e in ops)


def test_a_slower_expert_matmul_takes_a_larger_share(monkeypatch):
    def run() -> float:
        """The expert matmul's forward time over the rest of the operators' time: a ratio that a busy machine,
        slowing every operator alike, leaves where it is."""
        with expert_matmul_choice.selected("torch"):  # the implementation slowed below, whatever else is set
            rows = profile.run(["tiny-switchhead"], ["train step"], 2, "cpu", torch.float32, 2, 1, 5)
        shares = _shares(rows)
        rest = sum(shares.values()) - shares[profile.EXPERT_FORWARD] - shares["outside kernels"]
        return shares[profile.EXPERT_FORWARD] / rest

    before = statistics.median(run() for _ in range(3))  # a median of three: one busy moment moves a run
    forward = expert_matmul.TorchExpertMatmul.forward

    def ten_times(*args):
        for _ in range(9):
            forward(*args)
        return forward(*args)

    monkeypatch.setattr(expert_matmul.TorchExpertMatmul, "forward", staticmethod(ten_times))
    after = statistics.median(run() for _ in range(3))
    # ten times the op's arithmetic: about 4.5 times the ratio here (the op's gathers and scatters are not
    # repeated); the share attributed elsewhere would leave it near 1
    assert after > 2.5 * before, (before, after)


def test_each_part_of_a_switchhead_step_lands_in_its_share():
    rows = profile.run(["tiny-switchhead"], ["train step"], 2, "cpu", torch.float32, 2, 1, 50)
    shares = _shares(rows)
    for name in (
        *profile.SHARES[:3],
        "attention",
        "routing",
        "dense GEMMs",
        "norms and elementwise",
        "optimizer",
    ):
        assert shares[name] > 0, name
    kernels = [r for r in rows if r["kind"] == "kernel"]
    # the routers' GEMMs, forward and backward (MmBackward is found through its forward operator's module)
    assert any(r["name"] == "aten::mm" and r["share"] == "routing" for r in kernels)
    assert any(r["name"] == "aten::mm" and r["share"] == "dense GEMMs" for r in kernels)
    assert {r["share"] for r in kernels if r["name"] == "aten::bmm"} >= {profile.EXPERT_FORWARD}
    dense = _shares(profile.run(["tiny-transformer"], ["train step"], 2, "cpu", torch.float32, 1, 1, 5))
    assert all(dense[name] == 0 for name in (*profile.SHARES[:3], "routing"))


def test_the_grouped_gemm_path_lands_in_the_expert_matmul_shares(tmp_path, capsys):
    """On grouped_mm the forward, input-gradient and weight-gradient GEMMs each land in their share; the choice is
    recorded in the run's metadata."""
    with expert_matmul_choice.selected("grouped_mm"):
        rows = profile.run(["tiny-switchhead"], ["train step"], 2, "cpu", torch.float32, 1, 1, 50)
    grouped = {r["share"] for r in rows if r["kind"] == "kernel" and r["name"] == "aten::_grouped_mm"}
    assert grouped == set(profile.SHARES[:3])
    argv = ["profile", "tiny-switchhead", "--device", "cpu", "--steps", "1", "--warmup", "0", "--expert-matmul",
            "grouped_mm", "--out", str(tmp_path), "--json"]  # fmt: skip
    assert main(argv) == 0
    metadata = json.loads(capsys.readouterr().out)["metadata"]
    assert metadata["expert_matmul"] == "grouped_mm"
    assert {r["impl"] for r in metadata["expert_matmul_resolved"].values()} == {"grouped_mm"}


@pytest.mark.parametrize(
    ("unit", "expected"),
    [
        (profile.Unit(1, "k", "aten::mm", ("Optimizer.step#AdamW.step", "aten::mm")), "optimizer"),
        (
            profile.Unit(1, "k", "aten::mm", (profile.MODULE_LABEL + "routing", "aten::linear", "aten::mm")),
            "routing",
        ),
        (profile.Unit(1, "k", "aten::bmm", (profile.EXPERT_OP, "aten::bmm")), profile.EXPERT_FORWARD),
        (profile.Unit(1, "k", "aten::index", (profile.EXPERT_OP, "aten::index")), "routing"),
        (profile.Unit(1, "k", "aten::bmm", (profile.EXPERT_BACKWARD_OP, "aten::bmm")), profile.EXPERT_INPUT),
        (
            profile.Unit(
                1, "k", "aten::bmm", (profile.EXPERT_BACKWARD_OP, expert_matmul.WEIGHT_GRADIENT_LABEL)
            ),
            profile.EXPERT_WEIGHT,
        ),
        (profile.Unit(1, "k", "aten::mm", (profile.MODULE_LABEL + "attention", "aten::mm")), "attention"),
        (profile.Unit(1, "k", "aten::mm", ("aten::linear", "aten::mm")), "dense GEMMs"),
        (
            profile.Unit(1, "k", "aten::copy_", (profile.MODULE_LABEL + "moe", "aten::copy_")),
            "copies and casts",
        ),
        (profile.Unit(1, "k", "aten::sigmoid", (profile.MODULE_LABEL + "moe", "aten::sigmoid")), "routing"),
        (profile.Unit(1, "k", "aten::add", ("aten::add",)), "norms and elementwise"),
        (profile.Unit(1, "k", "", ("cudaMemsetAsync",)), "other"),
    ],
)
def test_share_rules(unit, expected):
    assert profile.share(unit) == expected


def test_the_command_writes_a_run_and_the_report_shows_it_side_by_side(tmp_path: Path, capsys):
    out = tmp_path / "profile"
    args = [
        "profile",
        "tiny-transformer",
        "tiny-switchhead",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--warmup",
        "0",
    ]
    assert main([*args, "--forward", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = Path(printed["saved"])
    assert saved.parent == out / saved.parent.name and saved.with_suffix(".csv").exists()
    assert printed["metadata"]["presets"] == ["tiny-transformer", "tiny-switchhead"]
    assert printed["metadata"]["expert_matmul"] == "auto" and printed["metadata"]["expert_matmul_resolved"]
    assert {(r["preset"], r["what"]) for r in printed["rows"]} == {
        (p, w) for p in ("tiny-transformer", "tiny-switchhead") for w in ("train step", "forward")
    }
    page = render({"profile": load_profile(tmp_path)}, {})
    assert "Where a training step" in page and page.count("tiny-switchhead<br>") == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["no-such-preset"], "unknown presets"), (["tiny-switchhead", "--steps", "0"], "must be >= 1")],
)
def test_bad_input_is_one_line_and_exit_2(extra, message, capsys, tmp_path):
    start = time.perf_counter()
    assert main(["profile", *extra, "--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert time.perf_counter() - start < 5 and not any(tmp_path.iterdir())


def test_a_batch_that_cannot_fit_is_refused_before_any_work(capsys, tmp_path):
    assert main(["profile", "c4-262m-switchhead-h4", "--batch", "10000000", "--device", "cpu",
                 "--out", str(tmp_path)]) == 2  # fmt: skip
    assert "try a smaller --batch" in capsys.readouterr().err
