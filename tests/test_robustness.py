"""Bad input and faults, as a new user meets them: a one-line error and exit 2 (130 when interrupted), no
traceback, every earlier file byte-for-byte intact; out of memory is a result row; nothing silently wrong."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from switchbench.analysis import analyze, quality
from switchbench.bench.cost import measure, scaling, tables
from switchbench.bench.kernels import bench as kernels
from switchbench.bench.timing import gate, speed
from switchbench.cli import main
from switchbench.core import results
from switchbench.jobs import main_job
from switchbench.models import family as registry
from switchbench.models.config import ModelConfig
from switchbench.models.presets import PRESETS
from switchbench.ops.attention import choice as attention_choice
from switchbench.reports import report
from switchbench.train import checkpoint, text
from switchbench.train import run as training
from switchbench.train.run import LMTask, TrainConfig

ROOT = os.geteuid() == 0
TINY_LISTOPS = dict(steps=4, batch=4, eval_every=2, warmup=1, val_size=16)


def fails_cleanly(capsys, argv: list[str], code: int = 2, says: str = "") -> str:
    """Run the CLI; it must exit ``code`` with exactly one line on stderr, no traceback; returns that line."""
    assert main(argv) == code
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert says in err, err
    return err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def real_cpu_oom():
    """What the CPU allocator raises when memory runs out: a petabyte is more than any address space holds."""
    torch.empty(2**50, dtype=torch.uint8)


# Output locations: checked before any work


class WorkReached(BaseException):
    """Raised in place of a command's work: the output location was accepted. A BaseException, so the command
    line's last line of defence (an unexpected failure is one line, exit 3) lets it through."""


def _no_work(*args, **kwargs):
    raise WorkReached


# command: (argv with OUT for the output, the work the command must not reach, whether OUT is a file)
WRITERS = {
    "tables": (["tables", "--out", "OUT"], (tables, "all_tables"), False),
    "sweep": (["sweep", "--out", "OUT"], (scaling, "sweep"), False),
    "speed": (["speed", "--quick", "--device", "cpu", "--out", "OUT"], (speed, "run"), False),
    "kernel-bench": (["kernel-bench", "--device", "cpu", "--out", "OUT"], (kernels, "run"), False),
    "train": (["train", "--out", "OUT", "--json"], (training, "train"), False),
    "quality": (["quality", "--device", "cpu", "--out", "OUT"], (quality, "run"), False),
    "analyze": (["analyze", "some/checkpoint.pt", "--out", "OUT"], (analyze, "analyze"), False),
    "all": (["all", "--quick", "--results", "OUT", "--runs", "RUNS"], (main_job, "STEPS"), False),
    "all --runs": (["all", "--quick", "--results", "RESULTS", "--runs", "OUT"], (main_job, "STEPS"), False),
    "report": (["report", "--results", "RESULTS", "--out", "OUT"], (report, "collect"), True),
    "check --write": (["check", "RUN", "--baseline", "OUT", "--write"], (gate, "load_run"), True),
}
PROC = Path("/proc")


# What a command writing a file may replace: an earlier file of its own kind
EARLIER = {"report": "<!DOCTYPE html>\n<title>switchbench report</title>\n"}


def _bad_location(tmp_path: Path, command: str, case: str, is_file: bool, monkeypatch) -> tuple[Path, str]:
    """An output location of kind ``case`` for a command writing a folder (or a file); the expected message."""
    existing = tmp_path / "existing"
    existing.write_text(EARLIER.get(command, "earlier results\n"))
    if case == "existing file":
        return (existing, "") if is_file else (existing, "is a file")
    if case == "a folder":
        return (tmp_path, "is a folder") if is_file else (tmp_path / "new" / "out", "")
    if case == "inside a file":
        return existing / "sub", "a file, not a folder"
    if case == "under /proc":  # the mode bits let root write; the file system refuses everyone
        return PROC / ("switchbench-nope.json" if is_file else "switchbench-nope"), str(PROC)
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "kept.csv").write_text("a,b\n1,2\n")
    locked.chmod(0o555)
    if ROOT:  # root writes anywhere whatever the mode bits: answer os.access as for any other user

        def access(path, mode, real=os.access):
            return False if Path(path) == locked and mode & os.W_OK else real(path, mode)

        monkeypatch.setattr(os, "access", access)
    return locked / "sub", "is not writable"


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every file (with its bytes) and folder under ``folder``."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


@pytest.mark.parametrize(
    "case", ["existing file", "inside a file", "read-only folder", "a folder", "under /proc"]
)
@pytest.mark.parametrize("command", list(WRITERS))
def test_output_locations_are_checked_before_any_work(command, case, tmp_path, monkeypatch, capsys):
    """A bad location is one line and exit 2 before the work; a good one reaches the work, and the check
    leaves nothing behind in either case (not even the folders it made to try writing there)."""
    argv, (module, work), is_file = WRITERS[command]
    if case == "under /proc" and not PROC.is_dir():
        pytest.skip("no /proc on this system")
    monkeypatch.setattr(module, work, _no_work if work != "STEPS" else (main_job.Step("work", _no_work),))
    results_folder = tmp_path / "results"
    results_folder.mkdir()
    out, message = _bad_location(tmp_path, command, case, is_file, monkeypatch)
    before = tree(tmp_path)
    where = {"OUT": str(out), "RUNS": str(tmp_path / "runs"), "RESULTS": str(results_folder), "RUN": "r.json"}
    argv = [where.get(a, a) for a in argv]
    if case == ("existing file" if is_file else "a folder"):  # a valid location
        with pytest.raises(WorkReached):
            main(argv)
    else:
        fails_cleanly(capsys, argv, says=message)
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["sweep", "--out", ""], "--out"),
        (["train", "--out", ""], "--out"),  # read as no --out, it trained into the default folder
        (["params", ""], "PRESET"),
        (["speed", "--presets", "tiny-transformer", ""], "--presets"),
        (["wheelhouse", ""], "DIR"),
    ],
)
def test_an_empty_value_is_refused_and_nothing_is_written_here(argv, named, tmp_path, monkeypatch, capsys):
    """`--out "$DIR"` with DIR unset: an empty path is the current folder, where `sweep --out ''` wrote its
    results (and `wheelhouse ''` its wheels)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(argv))
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err and not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("flag", "value", "least"),
    [("--steps", 0, 1), ("--warmup", -1, 0), ("--top", 0, 1), ("--batch", 0, 1), ("--fit-from", 0, 1)],
)
def test_profile_names_the_number_out_of_range(flag, value, least, tmp_path, capsys):
    argv = ["profile", "tiny-switchhead", flag, str(value), "--out", str(tmp_path / "p")]
    fails_cleanly(capsys, argv, says=f"{flag} must be >= {least}; got {value}")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["speed", "--presets", "listops-switchhead-h2"],
        ["decode", "listops-switchhead-h2"],
        ["profile", "listops-switchhead-h2"],
    ],
    ids=lambda argv: argv[0],
)
def test_a_listops_classifier_is_refused_by_name_where_language_models_run(argv, tmp_path, capsys):
    """The model's own refusal said only "causal must be True for a language model"."""
    fails_cleanly(
        capsys, [*argv, "--out", str(tmp_path / "x")], says="listops-switchhead-h2 is a ListOps classifier"
    )
    assert not (tmp_path / "x").exists()


def test_a_listops_classifier_s_attention_layer_is_still_timed(tmp_path):
    """Its attention layer is an attention layer like any other (bidirectional): only its model is refused."""
    argv = ["speed", "--presets", "listops-transformer-h8", "listops-switchhead-h2", "--scopes", "layer"]
    argv += ["--device", "cpu", "--rounds", "1", "--warmup", "0", "--batch", "1", "--threads", "1"]
    assert main([*argv, "--out", str(tmp_path), "--json"]) == 0
    assert list(tmp_path.rglob("*.json"))


@pytest.mark.parametrize("command", ["speed", "decode", "quality", "profile"])
def test_more_threads_than_cores_are_refused_before_any_work(command, tmp_path, monkeypatch, capsys):
    """100,000 intra-op threads: libgomp failed to make them (exit 1) or crashed (exit 139) before the refusal."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    argv = [command, "--threads", "5"] + (["tiny-transformer"] if command == "profile" else [])
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"switchbench {command}: error: --threads must be <= 4 (this machine's cores); got 5"
    )
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("nested", [False, True], ids=["existing folder", "folders to make"])
def test_checking_a_location_leaves_nothing_behind(nested, tmp_path):
    folder = tmp_path / "a" / "b" if nested else tmp_path
    results.writable_folder(folder)
    results.writable_file(folder / "report.html")
    assert list(tmp_path.iterdir()) == []


# Out of memory on the CPU is a result row; the sweep goes on


def test_a_cpu_allocation_failure_is_an_oom():
    with pytest.raises(RuntimeError) as caught:
        real_cpu_oom()
    assert measure.is_oom(caught.value)
    assert measure.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not measure.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))


@pytest.mark.slow  # steps of hundreds of MB, measured
def test_a_step_near_the_cpus_memory_is_measured_not_estimated(monkeypatch):
    """On the CPU a step past the memory is not an error but the OOM killer: `speed --batch 100000` of two tiny
    presets was killed after a minute with nothing saved. Within CPU_MARGIN of the free memory the lower bound
    gives way to a measurement at two small batches, extended linearly."""
    from switchbench.bench.timing import benches

    # probes of hundreds of MB, well above what the heap's state moves a peak by
    case = ("tiny-transformer", 4096, "layer")
    estimate = benches.estimated_bytes(*case, torch.float32)
    # probes at 512 and 2,048, extended to 4,096: the bound is a bound, and a loose one (3.3 to 4 times)
    measured = benches.cpu_step_bytes(*case, torch.float32, probe=512)
    assert measured > 2 * estimate, f"measured {measured} bytes, estimated {estimate}"
    # too_large probes at batch / 32 here (free memory 2x the bound): at 32,768 that is 1,024 again; at 4,096 its
    # probes of a few MB failed now and then under load, within what the heap's state moves a peak by
    large = ("tiny-transformer", 32 * 1024, "layer")
    bound = benches.estimated_bytes(*large, torch.float32)
    monkeypatch.setattr(benches, "free_memory", lambda device: 2 * bound)
    assert benches.too_large(*large, "cuda", torch.float32) is None  # the bound alone
    refused = benches.too_large(*large, "cpu", torch.float32)
    assert refused and refused.startswith("needs at least"), refused
    # the extension: a fixed part counted once, the rest in proportion to the batch
    monkeypatch.setattr(benches, "_cpu_peak", lambda preset, batch, scope, dtype: 1000 + 7 * batch)
    assert benches.cpu_step_bytes("p", 4096, "layer", torch.float32, probe=16) == 1000 + 7 * 4096
    # the probe is capped so that its larger run stays within the batch
    assert benches.cpu_step_bytes("p", 8, "layer", torch.float32, probe=16) == 1000 + 7 * 8


@pytest.mark.slow
def test_speed_records_a_cpu_oom_and_goes_on(tmp_path, monkeypatch, capsys):
    real = speed.layer_benches

    def benches(preset, *args):
        found = real(preset, *args)
        if preset == "tiny-switchhead":
            for bench in found:
                bench.run = real_cpu_oom
        return found

    monkeypatch.setattr(speed, "layer_benches", benches)
    argv = [
        "speed",
        "--presets",
        "tiny-transformer",
        "tiny-switchhead",
        "tiny-moa",
        "--scopes",
        "layer",
        "--device",
        "cpu",
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--out",
        str(tmp_path),
        "--json",
    ]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    status = {(r["preset"], r["what"]): r["status"] for r in rows if r["scope"] == "layer"}
    assert status == {
        (preset, what): "OOM" if preset == "tiny-switchhead" else "ok"
        for preset in ("tiny-transformer", "tiny-switchhead", "tiny-moa")
        for what in ("forward", "forward+backward")
    }
    assert len(list(tmp_path.rglob("*.json"))) == 1


@pytest.mark.slow
def test_kernel_bench_records_a_cpu_oom_and_goes_on(tmp_path, monkeypatch, capsys):
    real = kernels.make_inputs

    def inputs(case, *args, **kwargs):
        if case.name == "47m switchhead-o":
            real_cpu_oom()
        return real(case, *args, **kwargs)

    def logits(case, *args, real=kernels.router_logits, **kwargs):
        if case.name == "47m switchhead-o":
            real_cpu_oom()
        return real(case, *args, **kwargs)

    monkeypatch.setattr(kernels, "make_inputs", inputs)
    monkeypatch.setattr(kernels, "router_logits", logits)
    monkeypatch.setattr(kernels, "cases", lambda size, batch, real=kernels.cases: real(size, batch)[:3])
    argv = [
        "kernel-bench",
        "--sizes",
        "47m",
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--out",
        str(tmp_path),
        "--json",
    ]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    status = {(r["case"], r["impl"], r["pass"]): r["status"] for r in rows}
    # the three cases are routed: each times its routings, by the sort in force and by the count beside it
    routings = [kernels.routing_name(n, m) for m in (None, "count") for n in kernels.TIMED_ROUTINGS]
    impls = [*routings, *kernels.default_impls("cpu")]
    assert len(status) == 3 * len(impls) * 2
    assert {k for k, v in status.items() if v == "OOM"} == {
        ("47m switchhead-o", impl, p) for impl in impls for p in kernels.PASSES
    }
    assert all(r["vs_dense"] is None for r in rows if r["status"] == "OOM")


def test_count_records_a_cpu_oom_and_goes_on(monkeypatch, capsys):
    monkeypatch.setattr(measure, "fvcore_macs", lambda cfg: real_cpu_oom())
    measure.cost_views.cache_clear()
    try:
        assert main(["count", "tiny-switchhead", "--json"]) == 0
        views = json.loads(capsys.readouterr().out)
        assert main(["count", "tiny-switchhead"]) == 0
        assert "OOM" in capsys.readouterr().out
    finally:
        measure.cost_views.cache_clear()
    assert views["macs_fvcore"] == "OOM"
    assert (
        views["macs_exact"] == views["macs_flop_counter"] and views["mem_exact"] == views["mem_saved_floats"]
    )


# Files of the right format but the wrong shape


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """A tiny ListOps run: checkpoint and log at step 4."""
    folder = tmp_path_factory.mktemp("run")
    training.train(TrainConfig("listops", "listops-switchhead-h2", **TINY_LISTOPS), folder, progress=False)
    return folder


def _damaged_checkpoint(run_folder: Path, tmp_path: Path, change) -> Path:
    folder = tmp_path / "damaged"
    folder.mkdir()
    payload = torch.load(run_folder / "checkpoint.pt", weights_only=True)
    change(payload)
    torch.save(payload, folder / "checkpoint.pt")
    (folder / "log.csv").write_bytes((run_folder / "log.csv").read_bytes())
    return folder


CHECKPOINT_DAMAGE = {
    "no optimizer state": (lambda p: p.pop("optimizer"), "no 'optimizer'"),
    "no step": (lambda p: p.pop("step"), "no 'step'"),
    "train as a list": (lambda p: p.update(train=[1, 2]), "'train' must be an object"),
    "step as text": (lambda p: p.update(step="4"), "'step' must be an integer"),
    "step as a float": (lambda p: p.update(step=4.0), "'step' must be an integer"),  # a TypeError, exit 3
    # built for minutes, or its weights allocated, before they were found not to fit
    "a configuration 1,000 times wider": (
        lambda p: p["config"].update(d_model=1000 * p["config"]["d_model"]),
        "weights do not match the configuration: Error(s) in loading state_dict for SequenceClassifier: size "
        "mismatch for",
    ),
    "a configuration of 200,000 layers": (
        lambda p: p["config"].update(n_layers=200_000),
        "weights do not match the configuration: the configuration has 200000 layers, the weights 6",
    ),
    # torch's first line alone named no weight
    "a weight of another shape": (
        lambda p: p["model"].update({next(iter(p["model"])): torch.zeros(3)}),
        "weights do not match the configuration: Error(s) in loading state_dict for SequenceClassifier: size "
        "mismatch for",
    ),
}


def test_two_checkpoints_of_one_name_are_refused_before_any_work(run_folder, tmp_path, capsys):
    """Runs are named by their folders: two of one name (a run and its copy elsewhere) would share each figure's
    and table's keys. The analysis crashed with a KeyError after writing 35 files."""
    copy = tmp_path / "elsewhere" / run_folder.name
    copy.mkdir(parents=True)
    for name in ("checkpoint.pt", "log.csv"):
        (copy / name).write_bytes((run_folder / name).read_bytes())
    out = tmp_path / "analysis"
    argv = ["analyze", str(run_folder / "checkpoint.pt"), str(copy / "checkpoint.pt"), "--out", str(out)]
    fails_cleanly(capsys, argv, says=f"two checkpoints are named {run_folder.name}")
    assert not out.exists()


def test_an_example_for_a_language_model_is_refused_before_any_work(tmp_path, capsys):
    """--example picks a ListOps validation example: a language model's analysis ignored it without a word."""
    run = tmp_path / "lm"
    training.train(
        TrainConfig("lm", "tiny-switchhead", steps=1, batch=1, eval_every=1, warmup=1), run, progress=False
    )
    out = tmp_path / "analysis"
    argv = ["analyze", str(run / "checkpoint.pt"), "--example", "3", "--out", str(out)]
    fails_cleanly(capsys, argv, says="--example picks a ListOps validation example; a language model reads")
    assert not out.exists()


def test_a_sample_past_the_memory_is_refused_before_it_is_made(run_folder, tmp_path, capsys):
    """`analyze --sample 2147483647` generated ListOps examples for hours before observing any."""
    out = tmp_path / "analysis"
    argv = ["analyze", str(run_folder / "checkpoint.pt"), "--sample", "2147483647", "--out", str(out)]
    fails_cleanly(capsys, argv, says="--sample 2147483647: observing it needs at least")
    assert not out.exists()


@pytest.mark.parametrize(  # a resume builds its model first: one damage in the fast loop, every one in the full
    ("command", "damage"),
    [
        pytest.param(c, d, marks=pytest.mark.slow) if c != "analyze" and d != "no optimizer state" else (c, d)
        for d in CHECKPOINT_DAMAGE
        for c in ["analyze", "train --resume"]
    ],
)
def test_a_checkpoint_of_the_wrong_shape_is_named(command, damage, run_folder, tmp_path, capsys):
    change, message = CHECKPOINT_DAMAGE[damage]
    folder = _damaged_checkpoint(run_folder, tmp_path, change)
    before = snapshot(tmp_path)
    argv = (
        ["analyze", str(folder / "checkpoint.pt"), "--out", str(tmp_path / "analysis")]
        if command == "analyze"
        else ["train", "--preset", "listops-switchhead-h2", "--out", str(folder), "--resume", "--json"]
    )
    line = fails_cleanly(capsys, argv, says=message)
    assert str(folder / "checkpoint.pt") in line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["analyze", "train --resume"])
def test_a_log_without_steps_is_named(command, run_folder, tmp_path, capsys):
    # the settings a resume must share made the command line's defaults, so that the resume reaches the log
    defaults = TrainConfig("listops", "listops-switchhead-h2")
    folder = _damaged_checkpoint(
        run_folder,
        tmp_path,
        lambda p: p["train"].update({k: getattr(defaults, k) for k in training.SAME_ON_RESUME}),
    )
    pd.read_csv(folder / "log.csv").rename(columns={"step": "iteration"}).to_csv(
        folder / "log.csv", index=False
    )
    before = snapshot(tmp_path)
    argv = (
        ["analyze", str(folder / "checkpoint.pt"), "--out", str(tmp_path / "analysis")]
        if command == "analyze"
        else ["train", "--preset", "listops-switchhead-h2", "--out", str(folder), "--resume", "--json"]
    )
    fails_cleanly(capsys, argv, says=f"{folder / 'log.csv'}: no 'step' column")
    assert snapshot(tmp_path) == before


SPEED_ROW = {
    "preset": "p",
    "scope": "layer",
    "what": "forward",
    "status": "ok",
    "ratio_time": 0.5,
    "baseline": "d",
}
BAD_RUNS = {
    "rows not a list": ({"metadata": {}, "rows": {"a": 1}}, "needs a list of 'rows'"),
    "row without status": (
        {"rows": [{k: v for k, v in SPEED_ROW.items() if k != "status"}]},
        "row 0: 'status'",
    ),
    "ratio as text": ({"rows": [SPEED_ROW | {"ratio_time": "fast"}]}, "row 0: 'ratio_time' must be a number"),
    "metadata a list": ({"metadata": [], "rows": []}, "'metadata' must be an object"),
}
BASELINE = {
    "metadata": {},
    "tolerances": {"ratio_time": 0.75},
    "ratios": {"p | layer | forward": {"ratio_time": 0.5}},
}


@pytest.mark.parametrize("bad", list(BAD_RUNS))
@pytest.mark.parametrize("command", ["check", "report"])
def test_a_run_of_the_wrong_shape_is_named(command, bad, tmp_path, capsys):
    content, message = BAD_RUNS[bad]
    run = tmp_path / "results" / "speed" / "cpu" / "fp32-b2.json"
    run.parent.mkdir(parents=True)
    run.write_text(json.dumps(content))
    (tmp_path / "baseline.json").write_text(json.dumps(BASELINE))
    before = snapshot(tmp_path)
    if command == "report":
        assert message in skips_the_section(capsys, tmp_path, says=f"{run}: ")
        return
    line = fails_cleanly(
        capsys, ["check", str(run), "--baseline", str(tmp_path / "baseline.json")], says=f"{run}: "
    )
    assert message in line
    assert snapshot(tmp_path) == before


def test_check_names_a_run_without_rows(tmp_path, capsys):
    """It was compared with the baseline and called measured differently (device None against the baseline's)."""
    run = tmp_path / "empty.json"
    run.write_text(json.dumps({"metadata": {}, "rows": []}))
    (tmp_path / "baseline.json").write_text(json.dumps(BASELINE))
    argv = ["check", str(run), "--baseline", str(tmp_path / "baseline.json")]
    fails_cleanly(capsys, argv, says=f"{run}: a speed run without rows: nothing was measured")


def skips_the_section(capsys, tmp_path: Path, says: str) -> str:
    """The report leaves out the file that is unusable, with one line on stderr naming it; with nothing else under
    results/, it says there is nothing to report and writes nothing (exit 1)."""
    argv = ["report", "--results", str(tmp_path / "results"), "--out", str(tmp_path / "report.html")]
    assert main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "Traceback" not in err[0] and "left out" in err[0] and says in err[0], err
    assert err[1].startswith("switchbench report: nothing to report: ")
    assert not (tmp_path / "report.html").exists()
    return err[0]


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        ("tables/table1.csv", "model,macs_vs_dense,mem_vs_dense\nx,0.5,0.5\n", "no 'preset' column"),
        (
            "tables/cost_scaling.csv",
            "size,model,macs_crossover_T,mem_crossover_T\n47m,a,many,2\n",
            "column 'macs_crossover_T' must hold a number",
        ),
        (
            "analysis/run/summary.csv",
            "model,layer,head,side,entropy\na,0,0,src,1.0\n",
            "no 'perplexity' column",
        ),
        (
            "kernels/cpu.json",
            json.dumps({"rows": [{"case": "c", "impl": 3, "pass": "forward"}]}),
            "row 0: 'impl' must be text",
        ),
    ],
)
def test_report_leaves_out_a_section_whose_file_has_the_wrong_shape(file, content, message, tmp_path, capsys):
    path = tmp_path / "results" / file
    path.parent.mkdir(parents=True)
    path.write_text(content)
    skips_the_section(capsys, tmp_path, says=f"{path}: {message}")


# Device and implementation choices


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["train", "speed", "kernel-bench"])
def test_cuda_asked_for_without_cuda(command, tmp_path, capsys):
    fails_cleanly(
        capsys, [command, "--device", "cuda", "--out", str(tmp_path / "out")], says="no CUDA device"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("choice", "interpret", "message"),
    [
        ("bogus", "1", "must be one of torch, triton"),
        ("triton", None, "needs a CUDA device, or TRITON_INTERPRET=1"),
    ],
)
@pytest.mark.parametrize("command", ["train", "count", "speed", "kernel-bench", "tables"])
def test_expert_matmul_choice_is_checked_first(
    command, choice, interpret, message, tmp_path, monkeypatch, capsys
):
    if interpret is None and torch.cuda.is_available():
        pytest.skip("Triton runs here")
    monkeypatch.setenv("SWITCHBENCH_EXPERT_MATMUL", choice)
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = {"count": ["count", "tiny-switchhead"]}.get(command, [command, "--out", str(tmp_path / "out")])
    fails_cleanly(capsys, argv, says=f"SWITCHBENCH_EXPERT_MATMUL={choice}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("named", ["flag", "environment"])
def test_triton_routing_off_cuda_without_its_interpreter_is_refused_first(
    named, tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = ["speed", "--device", "cpu", "--out", str(tmp_path / "out")]
    if named == "flag":
        argv += ["--routing", "triton"]
    else:
        monkeypatch.setenv("SWITCHBENCH_ROUTING", "triton")
    said = (
        "--routing triton" if named == "flag" else "SWITCHBENCH_ROUTING=triton"
    )  # as given: one style for all
    fails_cleanly(capsys, argv, says=f"{said} needs a CUDA device, or TRITON_INTERPRET=1")
    assert list(tmp_path.iterdir()) == []


def test_heads_wider_than_the_triton_attention_takes_are_refused_before_any_work(
    tmp_path, monkeypatch, capsys
):
    """MoA's 262M heads (146 channels) are past the flash kernel's 128: speed names the preset before it builds or
    times any group, and building the layer under that choice (what every other command does first) is refused."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    moa = registry.get("moa").roles["262m"]
    assert PRESETS[moa].d_head == 146
    monkeypatch.setattr(speed, "run", _no_work)
    argv = ["speed", "--presets", "tiny-transformer", moa, "--attention", "triton", "--device", "cpu"]
    fails_cleanly(capsys, [*argv, "--out", str(tmp_path / "out")], says=f"128 channels; {moa} has 146")
    assert list(tmp_path.iterdir()) == []
    with attention_choice.selected("triton"), pytest.raises(ValueError, match="a moa model has 146"):
        registry.get("moa").attention(PRESETS[moa])
    registry.get("moa").attention(PRESETS[registry.get("moa").roles["47m"]])  # 88 channels: built


@pytest.mark.parametrize(
    ("named", "said"),
    [
        (["--attention", "triton"], "--attention triton"),
        (["--expert-matmul", "triton"], "--expert-matmul triton"),
        ({"SWITCHBENCH_ATTENTION": "triton"}, "SWITCHBENCH_ATTENTION=triton"),
        ({"SWITCHBENCH_EXPERT_MATMUL": "triton"}, "SWITCHBENCH_EXPERT_MATMUL=triton"),
    ],
)
def test_bf16_through_triton_s_interpreter_is_refused_before_any_work(
    named, said, tmp_path, monkeypatch, capsys
):
    """Triton's interpreter multiplies bf16 matrices wrongly: a CPU speed run in bf16 on Triton's attention saved
    rows marked ok from logits 4 off. fp16 and fp32 it multiplies exactly: they reach the work."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for variable, value in named.items() if isinstance(named, dict) else ():
        monkeypatch.setenv(variable, value)
    argv = ["speed", "--presets", "tiny-switchhead", "--device", "cpu", "--out", str(tmp_path / "out")]
    argv += [] if isinstance(named, dict) else named
    monkeypatch.setattr(speed, "run", _no_work)
    fails_cleanly(capsys, [*argv, "--dtype", "bf16"], says=f"{said} takes no bf16 on the CPU")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(WorkReached):
        main([*argv, "--dtype", "fp16"])
    if isinstance(
        named, dict
    ):  # a flag naming another kernel overrides the variable: nothing multiplies in Triton
        flag = "--expert-matmul" if "SWITCHBENCH_EXPERT_MATMUL" in named else "--attention"
        with pytest.raises(WorkReached):
            main([*argv, "--dtype", "bf16", flag, "torch" if flag == "--expert-matmul" else "explicit"])


def test_a_width_refusal_names_the_environment_where_it_made_the_choice(monkeypatch):
    """It said "--attention triton ... leave it out" where no flag was given: leaving it out changed nothing."""
    monkeypatch.setenv("SWITCHBENCH_ATTENTION", "triton")
    moa = PRESETS[registry.get("moa").roles["262m"]]
    with pytest.raises(
        ValueError, match=r"^SWITCHBENCH_ATTENTION=triton takes heads of at most 128 channels"
    ):
        registry.get("moa").attention(moa)
    with attention_choice.selected("triton"), pytest.raises(ValueError, match=r"^--attention triton takes"):
        monkeypatch.delenv("SWITCHBENCH_ATTENTION")
        registry.get("moa").attention(moa)


def test_triton_under_its_interpreter_is_accepted(monkeypatch, capsys):
    monkeypatch.setenv("SWITCHBENCH_EXPERT_MATMUL", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["params", "tiny-switchhead", "--json"]) == 0


@pytest.mark.parametrize(
    "widths",
    [
        ["--vocab", "2147483647", "--d-model", "2147483647"],
        ["--d-model", "2147483647", "--d-ff", "2147483647"],
    ],
    ids=["embedding", "mlp"],
)
def test_a_weight_past_what_torch_can_size_is_one_line(widths, capsys):
    """Each width under 2**31, their product past 2**63 bytes: torch's meta tensor overflowed (exit 3)."""
    fails_cleanly(
        capsys, ["params", "tiny-transformer", *widths], says="passes 2**63 bytes: torch cannot size it"
    )


# Silently wrong, exit 0 before


@pytest.mark.parametrize("value", ["inf", "nan"])
@pytest.mark.parametrize("flag", ["--entropy-reg", "--moa-z-coef", "--moa-switch-coef", "--mlp-entropy-reg"])
@pytest.mark.parametrize("command", ["params", "count"])
def test_non_finite_coefficients_are_rejected(command, flag, value, capsys):
    fails_cleanly(capsys, [command, "tiny-switchall", flag, value], says=flag[2:].replace("-", "_"))
    with pytest.raises(ValueError, match="finite"):
        ModelConfig(**{flag[2:].replace("-", "_"): float(value)})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lr", "inf"], "lr must be a finite number > 0"),
        (["--lr", "nan"], "lr must be a finite number > 0"),
        (["--lr", "1e308"], "lr must be a finite number > 0 (float32's)"),  # it overflowed in the first step
        (["--seed", str(2**64)], "seed must be in [0, 2**64)"),
        (["--seed", "-1"], "seed must be in [0, 2**64)"),
        (["--text", "tempest.txt"], "--text and --hf-dataset are for --task lm"),
        (["--stop-at", "1.5"], "stop_at is a ListOps validation accuracy in [0, 1]"),
        (["--stop-at", "nan"], "stop_at is a ListOps validation accuracy in [0, 1]"),
        (
            ["--task", "lm", "--stop-at", "0.5"],
            "stop_at is a ListOps validation accuracy: the lm task has none",
        ),
        (["--resume", "--force"], "--resume continues the folder's run and --force replaces it: give one"),
        (
            ["--model", "gqa", "--preset", "listops-switchhead-h2"],
            "--model gqa contradicts --preset listops-switchhead-h2, a switchhead model",
        ),
        (  # the configuration's name for the family is read as train's: the refusal names it as train does
            ["--model", "transformer", "--preset", "listops-switchhead-h2"],
            "--model dense contradicts --preset listops-switchhead-h2, a switchhead model",
        ),
        (["--preset", "listops-switchhead-h2:n_heads=two"], "n_heads must be int; got 'two'"),
        (["--preset", "listops-switchhead-h3"], "unknown preset 'listops-switchhead-h3'; did you mean"),
        (  # it made 10 million ListOps examples in Python first, for minutes, then ran out of memory
            ["--batch", "10000000"],
            "batch 10000000: a training step of listops-switchhead-h2 needs at least",
        ),
        (  # it built the model first: 32 GiB of one weight failed to allocate, with a traceback
            ["--task", "lm", "--preset", "tiny-switchhead:d_model=8192,d_ff=1048576", "--steps", "1"],
            "a training step of tiny-switchhead:d_model=8192,d_ff=1048576 needs at least",
        ),
    ],
)
def test_training_settings_are_checked_before_training(extra, message, tmp_path, capsys):
    fails_cleanly(capsys, ["train", "--out", str(tmp_path / "run"), "--json", *extra], says=message)
    assert list(tmp_path.iterdir()) == []


def test_quality_checks_each_models_memory_before_it_builds_one(tmp_path, capsys):
    preset = "bytes-920k-switchhead-h2:d_model=8192,d_ff=1048576"
    argv = [
        "quality",
        "--presets",
        preset,
        "--families",
        "switchhead",
        "--steps",
        "1",
        "--out",
        str(tmp_path),
    ]
    fails_cleanly(capsys, argv, says=f"batch 16: a training step of {preset} needs at least")
    assert list(tmp_path.iterdir()) == []


def test_a_short_text_is_counted_right(tmp_path, capsys):
    (tmp_path / "one.txt").write_bytes(b"a")
    argv = [
        "train",
        "--task",
        "lm",
        "--text",
        str(tmp_path / "one.txt"),
        "--out",
        str(tmp_path / "run"),
        "--json",
    ]
    fails_cleanly(capsys, argv, says="the text has 1 byte: too short")


def test_a_text_that_is_not_a_regular_file_or_named_twice_is_refused(tmp_path):
    """/dev/zero was read until the OOM killer ended the run; with --hf-dataset too, --text was ignored."""
    with pytest.raises(ValueError, match="text /dev/zero is not a regular file"):
        text.load_text("/dev/zero")
    with pytest.raises(ValueError, match="--text and --hf-dataset each name the text: give one"):
        text.load_text(str(tmp_path / "a.txt"), str(tmp_path / "dataset"))


def test_a_text_file_is_read_as_its_bytes(tmp_path):
    raw = bytes(range(256)) * 40 + "naïve\n".encode("latin-1")  # not UTF-8
    (tmp_path / "raw.txt").write_bytes(raw)
    assert text.load_text(str(tmp_path / "raw.txt")) == raw
    cfg = TrainConfig("lm", "tiny-switchhead", batch=2, text=str(tmp_path / "raw.txt"))
    task = LMTask(cfg, PRESETS["tiny-switchhead"])
    length = task.train.shape[1]
    assert task.train.flatten().tolist() == list(raw[: 2 * length])


@pytest.mark.slow
def test_a_diverging_run_stops_and_keeps_its_last_finite_checkpoint(tmp_path, capsys):
    cfg = TrainConfig(
        "listops", "listops-switchhead-h2", steps=6, batch=4, eval_every=1, warmup=1, val_size=8, lr=1e30
    )
    with pytest.raises(ValueError, match=r"not finite|the loss is (nan|inf)") as stopped:
        training.train(cfg, tmp_path, progress=False)
    saved = checkpoint.load(tmp_path / "checkpoint.pt")
    assert f"(step {saved['step']}) is kept" in str(stopped.value)
    assert saved["step"] < 6 and all(t.isfinite().all() for t in saved["model"].values())
    assert pd.read_csv(tmp_path / "log.csv")["step"].tolist() == list(range(1, saved["step"] + 1))


def test_training_into_an_earlier_run_needs_resume_or_force(run_folder, tmp_path, capsys):
    before = snapshot(run_folder)
    argv = ["train", "--preset", "listops-switchhead-h2", "--out", str(run_folder), "--json"]
    fails_cleanly(capsys, argv, says=f"{run_folder} holds an earlier run")
    assert snapshot(run_folder) == before


def test_resuming_a_run_without_its_checkpoint_is_refused_and_keeps_its_log(tmp_path, capsys):
    """--resume over a folder with a log and no checkpoint would start afresh and write over the log."""
    (tmp_path / "log.csv").write_text("step,loss\n1,3.0\n2,2.5\n")
    before = snapshot(tmp_path)
    argv = ["train", "--preset", "listops-switchhead-h2", "--out", str(tmp_path), "--resume", "--steps", "1"]
    fails_cleanly(capsys, argv, says="holds a log but no checkpoint.pt to resume from")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("task", "preset", "tokens"),
    [
        ("lm", "tiny-switchhead", 256),
        pytest.param("listops", "listops-switchhead-h2", 16, marks=pytest.mark.slow),
    ],
)
def test_a_vocabulary_below_the_data_s_is_refused_before_training(task, preset, tokens, tmp_path, capsys):
    """It failed in the first step's embedding lookup (IndexError, exit 3); the model at the data's own
    vocabulary trains (the bound is not one too high)."""
    argv = ["train", "--task", task, "--steps", "1", "--batch", "2", "--eval-every", "1"]
    out = tmp_path / "run"
    fails_cleanly(
        capsys,
        [*argv, "--preset", f"{preset}:vocab={tokens - 1}", "--out", str(out)],
        says=f"the {tokens} tokens",
    )
    assert not out.exists()
    assert main([*argv, "--preset", f"{preset}:vocab={tokens}", "--out", str(out)]) == 0


@pytest.mark.slow  # two trainings and four refused resumes
def test_resuming_with_other_training_settings_is_refused(tmp_path, capsys):
    """--resume continued a run with another batch, learning rate or seed, exit 0: one log of two trainings.
    More steps, or evaluations at other intervals, continue it."""
    argv = ["train", "--steps", "2", "--batch", "4", "--eval-every", "1", "--out", str(tmp_path), "--json"]
    assert main(argv) == 0
    before = snapshot(tmp_path)
    for flag, value in (("--batch", "3"), ("--lr", "0.01"), ("--seed", "5")):
        changed = [*argv, "--resume", flag, value]
        fails_cleanly(capsys, changed, says=f"was trained with {flag[2:]} ")
        assert snapshot(tmp_path) == before
    assert main([*argv, "--resume", "--steps", "3", "--eval-every", "3"]) == 0
    # fewer steps than the checkpoint's trained nothing and printed its figures as this run's, exit 0
    before = snapshot(tmp_path)
    fails_cleanly(capsys, [*argv, "--resume", "--steps", "1"], says="is at step 3, past --steps 1")
    assert snapshot(tmp_path) == before


# Interruption


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(scaling, "sweep", interrupted)
    fails_cleanly(capsys, ["sweep", "--out", "unused"], code=130, says="switchbench sweep: interrupted")


def _sigint_by_default() -> None:
    """In the child, SIGINT at its default: a shell's background job (`tox &`) inherits it ignored, and Python then
    installs no KeyboardInterrupt handler, so the interrupt this test sends would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_during_training(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "switchbench",
        "train",
        "--steps",
        "100000",
        "--eval-every",
        "1",
        "--batch",
        "2",
        "--out",
        str(tmp_path / "run"),
        "--json",
    ]
    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_by_default
    )
    deadline = time.monotonic() + 240
    while not (tmp_path / "run" / "checkpoint.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130 and err.splitlines() == ["switchbench train: interrupted"], err
    assert checkpoint.load(tmp_path / "run" / "checkpoint.pt")["step"] >= 1
    assert not list((tmp_path / "run").glob(".*.tmp"))


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("straight")
    training.train(
        TrainConfig("listops", "listops-switchhead-h2", **TINY_LISTOPS | {"steps": 6}), folder, progress=False
    )
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("renamed", [False, True], ids=["before the checkpoint's rename", "after it"])
def test_a_kill_around_the_checkpoint_loses_no_log_row(renamed, straight_run, tmp_path, monkeypatch):
    cfg = TrainConfig("listops", "listops-switchhead-h2", **TINY_LISTOPS | {"steps": 6})
    real, calls = checkpoint.save, []

    def killed_at_the_second(*args, **kwargs):
        calls.append(kwargs["step"])
        if len(calls) == 2:  # the checkpoint of step 4, the log's write just before or just after it
            if renamed:
                real(*args, **kwargs)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save", killed_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        training.train(cfg, tmp_path / "killed", progress=False)
    monkeypatch.setattr(checkpoint, "save", real)
    training.train(cfg, tmp_path / "killed", resume=True, progress=False)
    straight, resumed = (pd.read_csv(folder / "log.csv") for folder in (straight_run, tmp_path / "killed"))
    assert resumed["step"].tolist() == straight["step"].tolist() == [2, 4, 6]
    assert resumed["train_seconds"].is_monotonic_increasing  # timed anew after the resume, so not compared
    timed = ["train_seconds", "mfu", "matmul_peak_tflops"]  # so is the MFU of each interval, and its peak
    assert (resumed["mfu"] > 0).all()
    pd.testing.assert_frame_equal(resumed.drop(columns=timed), straight.drop(columns=timed), rtol=1e-5)


def test_stale_temporary_files_are_removed_by_the_next_write(tmp_path):
    stale = [tmp_path / ".log.csv.k3j9x_2a.tmp", tmp_path / ".log.csv.00000000.tmp"]
    others = [tmp_path / ".log.csv.mine.tmp", tmp_path / ".other.csv.k3j9x_2a.tmp", tmp_path / "notes.tmp"]
    for path in stale + others:
        path.write_text("left by a killed run")
    results.write_csv(tmp_path / "log.csv", [{"step": 1}])
    assert [p.exists() for p in stale + others] == [False, False, True, True, True]


def test_a_rename_that_fails_puts_back_the_files_renamed_before_it(tmp_path):
    """A set of files is replaced whole or not at all: a rename refused midway (here a folder where the last file
    goes; `tables --out` met a file made immutable) left the first file new and the rest old. A symbolic link is
    put back as one, a dangling one too (it was lost: nothing was there to keep, so the new file was removed)."""
    old, linked, dangling, new = (tmp_path / f"{name}.csv" for name in ("old", "linked", "dangling", "new"))
    old.write_text("earlier run")
    linked.symlink_to("old.csv")
    dangling.symlink_to("gone.csv")
    (tmp_path / "blocked.csv").mkdir()
    writers = {
        path: (lambda tmp: tmp.write_text("this run"))
        for path in (old, linked, dangling, new, tmp_path / "blocked.csv")
    }
    with pytest.raises(IsADirectoryError):
        results.replace_together(writers)
    assert old.read_text() == "earlier run" and linked.is_symlink() and not new.exists()
    assert dangling.is_symlink() and os.readlink(dangling) == "gone.csv"
    left = ["blocked.csv", "dangling.csv", "linked.csv", "old.csv"]
    assert sorted(p.name for p in tmp_path.iterdir()) == left  # no temporary file left
    writers.pop(tmp_path / "blocked.csv")
    assert results.replace_together(writers) == [old, linked, dangling, new]
    assert {p.read_text() for p in (old, linked, dangling, new)} == {"this run"} and not linked.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*left, "new.csv"])


def test_an_interrupt_as_the_index_is_renamed_leaves_the_earlier_set(tmp_path, monkeypatch):
    """Ctrl-C lands after a rename returns: the index renamed, then the interrupt. The files before it were put
    back and the index was not, a new index over the earlier data (it was recorded as renamed only afterwards)."""
    paths = [tmp_path / name for name in ("a.csv", "b.csv", "metadata.json")]
    for path in paths:
        path.write_text("earlier run")
    real, interrupted = os.replace, []

    def interrupted_after_the_index(src, dst):
        real(src, dst)
        if Path(dst).name == "metadata.json" and not interrupted:  # the rename into place, not the one back
            interrupted.append(dst)
            raise KeyboardInterrupt

    monkeypatch.setattr(results.os, "replace", interrupted_after_the_index)
    with pytest.raises(KeyboardInterrupt):
        results.replace_together({path: (lambda tmp: tmp.write_text("this run")) for path in paths})
    assert [p.read_text() for p in paths] == ["earlier run"] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv", "b.csv", "metadata.json"]


def test_a_tables_run_stopped_while_writing_leaves_the_earlier_set(tmp_path, monkeypatch, capsys):
    def built(ratio):
        row = {
            "preset": "p",
            "macs_published": "1M",
            "macs_paper_printed": "1M",
            "mem_published": "2M",
            "mem_paper_printed": "2M",
            "macs_vs_dense": ratio,
            "mem_vs_dense": ratio,
            "reproduced": "yes",
        }
        return {f"table{t}": [row] for t in tables.TABLES}

    monkeypatch.setattr(tables, "all_tables", lambda: built(0.5))
    assert main(["tables", "--out", str(tmp_path), "--json"]) == 0
    capsys.readouterr()
    before = snapshot(tmp_path)
    assert json.loads(before["metadata.json"])["files"] == [
        f"table{t}.{ext}" for t in tables.TABLES for ext in ("csv", "md", "tex")
    ]
    real_write, writes = Path.write_text, []

    def killed_at_the_third(self, *args, **kwargs):
        writes.append(self)
        if len(writes) == 3:
            raise KeyboardInterrupt
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(tables, "all_tables", lambda: built(0.25))
    monkeypatch.setattr(Path, "write_text", killed_at_the_third)
    fails_cleanly(capsys, ["tables", "--out", str(tmp_path), "--json"], code=130, says="interrupted")
    assert len(writes) == 3 and snapshot(tmp_path) == before


def test_a_folder_another_run_writes_in_meanwhile_is_left_to_it(tmp_path, monkeypatch):
    """Three trainings started together probe runs/<name> each: a probe that made runs/ must not fail when another
    run has written in it meanwhile (it left a race: 'Directory not empty'), and leaves that run's file alone."""
    real = results.tempfile.mkstemp

    def beside_another_run(*args, **kwargs):
        (tmp_path / "runs" / "other").mkdir()  # the other training's folder, made while this probe runs
        return real(*args, **kwargs)

    monkeypatch.setattr(results.tempfile, "mkstemp", beside_another_run)
    assert results.writable_folder(tmp_path / "runs" / "mine") == tmp_path / "runs" / "mine"
    assert (tmp_path / "runs" / "other").is_dir() and not (tmp_path / "runs" / "mine").exists()


def test_a_parent_another_probe_removed_meanwhile_is_made_again(tmp_path, monkeypatch):
    """The other side of that race: this probe found runs/ made by another, which removed it (its own check done)
    before this one made runs/<name> inside: 'No such file or directory' stopped a training. It makes runs/ again,
    and removes what it made."""
    real, removed = results.Path.mkdir, []

    def after_another_probe(self, *args, **kwargs):
        if self == tmp_path / "runs" and not removed:
            real(self)  # the other probe's runs/: this one finds it there ...
        if self == tmp_path / "runs" / "mine" and not removed:
            (tmp_path / "runs").rmdir()  # ... and the other removes it before this one goes down
            removed.append(True)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(results.Path, "mkdir", after_another_probe)
    assert results.writable_folder(tmp_path / "runs" / "mine") == tmp_path / "runs" / "mine"
    assert removed and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("gone", ["before its check", "before the folder inside it is made"])
@pytest.mark.parametrize("writable", [results.writable_folder, results.writable_file])
def test_the_folder_a_probe_found_is_made_again_when_another_probe_removed_it(
    tmp_path, monkeypatch, gone, writable
):
    """The race a CI run lost (one of the chain's three ListOps trainings exited 2, 'No such file or directory';
    a review reproduced it 24 to 77 times in 300 with three processes): this probe found runs/, which another
    probe had made, and that one removed it, its check done, before this one made its folder inside. The folder
    is made again and removed with the rest; no refusal, nothing left behind."""
    runs = tmp_path / "runs"
    target = runs / "mine" / ("" if writable is results.writable_folder else "log.txt")
    real_nearest, real_mkdir, removed = results._nearest_existing, results.Path.mkdir, []

    def found_by_another(path, flag):
        real_mkdir(runs)  # the other probe's, found here
        nearest = real_nearest(path, flag)
        if gone == "before its check":
            runs.rmdir()
            removed.append(runs)
        return nearest

    def removed_meanwhile(self, *args, **kwargs):
        if self == runs / "mine" and not removed:
            runs.rmdir()
            removed.append(runs)
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(results, "_nearest_existing", found_by_another)
    monkeypatch.setattr(results.Path, "mkdir", removed_meanwhile)
    assert writable(target) == target
    assert removed and not runs.exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["speed", "--quick", "--scopes", "layer", "model", "layer"], "--scopes: layer is named twice"),
        (
            ["decode", "tiny-transformer", "tiny-switchhead", "--contexts", "64", "64"],
            "--contexts: 64 is named",
        ),
        (["decode", "--batches", "1", "4", "1"], "--batches: 1 is named twice"),
        (["kernel-bench", "--sizes", "47m", "47m"], "--sizes: 47m is named twice"),
        (
            ["kernel-check", "--arch", "sm_90", "sm_90"],
            "--arch: sm_90 is named twice",
        ),  # compiled 4 times over
        (["kernel-check", "--dtype", "bf16", "bf16"], "--dtype: bf16 is named twice"),
        (["evidence", "--only", "report", "report"], "--only: report is named twice"),
        (["quality", "--quick", "--families", "dense", "dense"], "--families: dense is named twice"),
    ],
)
def test_a_list_value_named_twice_is_refused_before_any_work(argv, says, tmp_path, capsys):
    """Each was measured twice, its rows repeated (decode's first pair then without its ratios): now a usage
    error as the flags are read, exit 2 in one line."""
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "out").exists()


def test_an_output_that_is_no_regular_file_is_refused(tmp_path, capsys):
    """A FIFO (or /dev/null) as --out: the report was written beside it and renamed over it, replacing the node."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    results = Path(__file__).resolve().parents[1] / "results"
    fails_cleanly(
        capsys, ["report", "--results", str(results), "--out", str(fifo)], says="is not a regular file"
    )
    assert stat.S_ISFIFO(fifo.stat().st_mode)


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "RANK", "LOCAL_RANK"])
def test_a_torchrun_variable_that_is_no_integer_is_named(variable, monkeypatch):
    from switchbench.core import distributed

    monkeypatch.setenv(variable, "abc")
    with pytest.raises(ValueError, match=f"{variable} must be an integer"):
        distributed.from_environment()


@pytest.mark.parametrize(
    ("environment", "says"),
    [
        ({"WORLD_SIZE": "1", "RANK": "1"}, "RANK must be in [0, WORLD_SIZE 1); got 1"),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK must be in [0, WORLD_SIZE 2); got -1"),
        ({"LOCAL_RANK": "-2"}, "LOCAL_RANK must be >= 0; got -2"),
    ],
)
def test_a_rank_outside_its_world_is_refused_before_any_work(
    environment, says, tmp_path, capsys, monkeypatch
):
    """A stale RANK past WORLD_SIZE: speed measured, then wrote nothing and printed nothing, exit 0 (only rank 0
    writes); train failed on an empty shard of the data, exit 3."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    argv = ["speed", "--quick", "--device", "cpu", "--presets", "tiny-switchhead", "--scopes", "layer"]
    fails_cleanly(capsys, [*argv, "--out", str(tmp_path / "out")], says=says)
    assert not (tmp_path / "out").exists()


def test_a_table_s_name_taken_by_a_folder_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """tables --out where table2.md is a folder: it failed at the rename, after the work, with exit 3."""
    from switchbench.bench.cost import tables

    (tmp_path / "table2.md").mkdir()
    monkeypatch.setattr(tables, "all_tables", lambda: pytest.fail("built before the check"))
    fails_cleanly(capsys, ["tables", "--out", str(tmp_path)], says=f"{tmp_path / 'table2.md'} is a folder")


def test_a_run_s_name_taken_by_a_folder_goes_to_the_next_stem(tmp_path):
    """speed, decode, profile, kernel-bench and quality picked the first stem without a .json: a folder named
    as its .csv made the rename fail after the work (exit 3, the measurements lost)."""
    (tmp_path / "fp32-b2.csv").mkdir()
    assert results.new_run_stem(tmp_path, "fp32-b2") == tmp_path / "fp32-b2-2"
    (tmp_path / "q-summary.csv").mkdir()  # quality's summary beside its run
    assert results.new_run_stem(tmp_path, "q") == tmp_path / "q-2"
    assert results.new_run_stem(tmp_path, "fp32-b4") == tmp_path / "fp32-b4"


@pytest.mark.parametrize(
    ("argv", "work", "taken"),
    [
        (["sweep"], (scaling, "sweep"), "cost_scaling.png"),
        (["analyze", "some/checkpoint.pt"], (analyze, "analyze"), "summary.csv"),
    ],
    ids=["sweep", "analyze"],
)
def test_an_output_named_by_a_folder_is_refused_before_the_work(
    argv, work, taken, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "out"
    (out / taken).mkdir(parents=True)
    monkeypatch.setattr(*work, _no_work)
    fails_cleanly(capsys, [*argv, "--out", str(out)], says=taken)


def test_an_analysis_named_from_a_checkpoint_in_the_working_folder_takes_the_folder_s_name(
    tmp_path, monkeypatch
):
    """`analyze checkpoint.pt` from inside the run's folder named the run "": its files went to
    results/analysis/ itself, named -usage.png and the like."""
    run = tmp_path / "listops-switchhead-h2"
    run.mkdir()
    monkeypatch.chdir(run)
    assert analyze._name(Path("checkpoint.pt")) == "listops-switchhead-h2"


@pytest.mark.parametrize("blank", [" ", "\t"])
def test_a_listops_input_of_no_tokens_is_refused(blank, run_folder, tmp_path, capsys):
    """A blank --input reached the model as a sequence of no tokens: a reshape error, exit 3."""
    argv = ["analyze", str(run_folder), "--input", blank, "--sample", "2", "--out", str(tmp_path / "a")]
    fails_cleanly(capsys, argv, says="--input holds no ListOps tokens")
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())
