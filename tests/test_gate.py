"""The regression gate: the median interval, exact counters, exit codes, and the gate on real timings."""

import copy
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from switchbench.bench.cost.measure import count_op_calls, layer_and_inputs
from switchbench.bench.timing import gate, speed
from switchbench.cli import main
from switchbench.models.presets import PRESETS

BASELINE = Path(__file__).resolve().parent.parent / "results" / "baselines" / "cpu.json"
SWITCHHEAD_TIMES = [
    k for k in json.loads(BASELINE.read_text())["ratios"] if k.startswith(speed.GATE_LAYERS[1])
]


def _run_like(baseline: dict, rounds: int = 30) -> dict:
    """A speed run that measures exactly the baseline's values, each time ratio the same in every round."""
    rows = []
    for key, entry in baseline["ratios"].items():
        preset, scope, what = key.split(" | ")
        row = {"preset": preset, "scope": scope, "what": what, "status": "ok"} | entry
        if "ratio_time" in entry:
            row["ratio_time_rounds"] = [entry["ratio_time"]] * rounds
        rows.append(row)
    return {"metadata": dict(baseline["metadata"]), "rows": rows}


def _committed() -> dict:
    return json.loads(BASELINE.read_text())


def _write(path: Path, content) -> Path:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.mark.parametrize("n, ranks", [(6, (1, 6)), (10, (2, 9)), (20, (6, 15)), (30, (10, 21))])
def test_median_interval_matches_the_published_order_statistics(n, ranks):
    """Ranks of the distribution-free 95% interval of a median, as tabulated (e.g. Conover, Practical
    Nonparametric Statistics, table A3; n = 30: the 10th and 21st smallest)."""
    values = [float(v) for v in range(1, n + 1)]
    random.Random(n).shuffle(values)
    assert gate.median_interval(values) == ranks
    with pytest.raises(ValueError, match="too few"):
        gate.median_interval(values[:5])


def test_time_is_decided_by_the_interval_counts_exactly():
    baseline = _committed()
    key = SWITCHHEAD_TIMES[0]
    expected = baseline["ratios"][key]["ratio_time"]
    limit = expected * (1 + baseline["tolerances"]["ratio_time"])
    run = _run_like(baseline)
    row = next(r for r in run["rows"] if f"{r['preset']} | {r['scope']} | {r['what']}" == key)
    # A median above the limit whose interval still reaches below it is noise, not a regression ...
    row["ratio_time_rounds"] = [0.9 * limit] * 12 + [1.1 * limit] * 18
    assert all(v["verdict"] == "ok" for v in gate.check(run, baseline))
    # ... an interval wholly above it is one.
    row["ratio_time_rounds"] = [0.9 * limit] * 9 + [1.1 * limit] * 21
    failed = [v for v in gate.check(run, baseline) if v["verdict"] != "ok"]
    assert [(v["ratio"], v["quantity"]) for v in failed] == [(key, "ratio_time")]
    assert failed[0]["low"] == 1.1 * limit and failed[0]["limit"] == limit
    row["ratio_time_rounds"] = [expected] * 30
    row["op_calls"] += 1  # one extra operator call: an exact regression however noisy time is
    failed = [v for v in gate.check(run, baseline) if v["verdict"] != "ok"]
    assert [(v["ratio"], v["quantity"]) for v in failed] == [(key, "op_calls")]


def test_baseline_round_trip_drops_self_ratios(tmp_path):
    committed = _committed()
    run = _run_like(committed)
    for row in run["rows"]:
        if (
            row["preset"] == speed.GATE_LAYERS[0]
        ):  # as the harness records the dense layer: 1.0 against itself
            row |= {"baseline": row["preset"], "ratio_time": 1.0, "ratio_time_rounds": [1.0] * 30}
    written = json.loads(gate.write_baseline([run], tmp_path / "b.json").read_text())
    assert written["ratios"] == committed["ratios"]
    assert all(v["verdict"] == "ok" for v in gate.check(run, written))


def test_pooled_baseline_takes_the_median_of_the_runs_and_needs_equal_counts(tmp_path, capsys):
    committed = _committed()
    key = SWITCHHEAD_TIMES[0]
    runs = []
    for scale in (0.9, 1.2, 1.0):
        run = _run_like(committed)
        for row in run["rows"]:
            if f"{row['preset']} | {row['scope']} | {row['what']}" == key:
                row["ratio_time"] *= scale
        runs.append(_write(tmp_path / f"run{scale}.json", run))
    pooled = tmp_path / "pooled.json"
    assert main(["check", *map(str, runs), "--baseline", str(pooled), "--write"]) == 0
    written = json.loads(pooled.read_text())
    assert written["ratios"][key]["ratio_time"] == committed["ratios"][key]["ratio_time"]
    assert written["metadata"]["runs"] == 3
    other = _run_like(committed)
    next(r for r in other["rows"] if "op_calls" in r)["op_calls"] += 1
    odd = _write(tmp_path / "odd.json", other)
    assert main(["check", str(runs[0]), str(odd), "--baseline", str(pooled), "--write"]) == 2
    assert "disagree on the op_calls" in capsys.readouterr().err


def test_committed_baseline_is_single_thread_and_gates_switchhead():
    baseline = gate.load_baseline(BASELINE)
    assert baseline["metadata"]["threads"] == speed.GATE_THREADS and baseline["metadata"]["device"]
    assert baseline["tolerances"]["ratio_time"] <= 0.2
    assert {k.split(" | ")[2] for k in SWITCHHEAD_TIMES} == {"forward", "forward+backward"}
    assert all(baseline["ratios"][k]["op_calls"] > 0 for k in SWITCHHEAD_TIMES)


@pytest.mark.parametrize("page", ["docs/speed-and-gate.md", "README.md"])
def test_the_docs_state_the_committed_baseline_as_the_gate_prints_it(page, tmp_path, capsys):
    """One paragraph of the page speaks of the committed baseline, and its time ratios and limits are the
    numbers `switchbench check` prints for results/baselines/cpu.json."""
    paragraphs = (BASELINE.parents[2] / page).read_text().split("\n\n")
    statements = [p for p in paragraphs if "committed baseline" in " ".join(p.split()).lower()]
    assert len(statements) == 1, statements
    run = _write(tmp_path / "run.json", _run_like(_committed()))
    assert main(["check", str(run), "--baseline", str(BASELINE)]) == 0
    printed = capsys.readouterr().out
    committed = _committed()
    for entry in (committed["ratios"][k] for k in SWITCHHEAD_TIMES):
        for value in (entry["ratio_time"], entry["ratio_time"] * (1 + committed["tolerances"]["ratio_time"])):
            assert f"{value:.4f}" in printed and f"{value:.4f}" in statements[0], f"{value:.4f}"


def test_check_json_reports_each_quantity(tmp_path, capsys):
    run = _write(tmp_path / "run.json", _run_like(_committed()))
    assert main(["check", str(run), "--baseline", str(BASELINE), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    times = [c for c in out["checks"] if c["quantity"] == "ratio_time"]
    assert out["regressions"] == 0 and {c["ratio"] for c in times} == set(SWITCHHEAD_TIMES)
    assert all(c["low"] <= c["measured"] <= c["high"] and c["verdict"] == "ok" for c in times)


def test_scaled_baseline_is_a_regression(tmp_path, capsys):
    """The committed baseline with its SwitchHead time ratios x 0.7, against a run at the committed values."""
    run = _write(tmp_path / "run.json", _run_like(_committed()))
    scaled = _committed()
    for key in SWITCHHEAD_TIMES:
        scaled["ratios"][key]["ratio_time"] *= 0.7
    assert main(["check", str(run), "--baseline", str(_write(tmp_path / "b.json", scaled))]) == 1
    out = capsys.readouterr().out
    assert out.count("REGRESSION") == len(SWITCHHEAD_TIMES) and "FAIL" in out


def _kernel_bench_run() -> dict:
    return {
        "metadata": {"device": "x86_64"},
        "rows": [{"case": "47m", "impl": "torch", "pass": "forward", "ms": 1.0}],
    }


def _broken_runs() -> dict:
    committed = _committed()
    threads = _run_like(committed)
    threads["metadata"]["threads"] = 2
    no_rounds = _run_like(committed)
    del next(r for r in no_rounds["rows"] if "ratio_time" in r)["ratio_time_rounds"]
    wrong_type = _run_like(committed)
    wrong_type["rows"][0]["op_calls"] = "many"
    other_groups = _run_like(committed)
    other_groups["rows"] = [r for r in other_groups["rows"] if r["scope"] == "count"]
    return {
        "empty file": ("", "not a readable run"),
        "not JSON": ("{rows: [", "not a readable run"),
        "a list": ([], "not a switchbench speed run"),
        "kernel-bench run": (_kernel_bench_run(), "a kernels run, not a speed run"),
        "rows not a list": ({"metadata": {}, "rows": {}}, "not a switchbench speed run"),
        "malformed count": (wrong_type, "malformed op_calls"),
        "no per-round ratios": (no_rounds, "malformed ratio_time_rounds"),
        "too few rounds": (_run_like(committed, rounds=5), "too few for a 95% interval"),
        "other threads": (threads, "threads 2 vs 1"),
        "other benchmark": (other_groups, "not the baseline's benchmark"),
    }


def _broken_baselines() -> dict:
    committed = _committed()
    no_time = copy.deepcopy(committed)
    no_time["ratios"] = {k: v for k, v in no_time["ratios"].items() if "ratio_time" not in v}
    self_ratio = copy.deepcopy(committed)
    dense = speed.GATE_LAYERS[0]
    self_ratio["ratios"][f"{dense} | layer | forward"] = {"baseline": dense, "ratio_time": 1.0}
    wrong_type = copy.deepcopy(committed)
    wrong_type["ratios"][SWITCHHEAD_TIMES[0]]["ratio_time"] = "0.4"
    no_reference = copy.deepcopy(committed)
    del no_reference["ratios"][SWITCHHEAD_TIMES[0]]["baseline"]
    no_tolerance = copy.deepcopy(committed)
    del no_tolerance["tolerances"]["op_calls"]
    return {
        "empty file": ("", "not a readable baseline"),
        "empty object": ({}, "not a switchbench baseline"),
        "no ratios": (committed | {"ratios": {}}, "no SwitchHead/dense time ratio"),
        "no time ratio": (no_time, "no SwitchHead/dense time ratio"),
        "self-ratio": (self_ratio, "to itself"),
        "malformed ratio": (wrong_type, "malformed ratio_time"),
        "missing tolerance": (no_tolerance, "'tolerances' must give"),
        "ratio without its reference": (no_reference, "without the preset they are relative to"),
        "a speed run": (_run_like(committed), "not a switchbench baseline"),
    }


@pytest.mark.parametrize("case", [*_broken_runs(), "missing file", "empty folder"])
def test_unusable_run_exits_2(case, tmp_path, capsys):
    if case == "missing file":
        run, message = tmp_path / "nope.json", "no such run file"
    elif case == "empty folder":
        run, message = tmp_path, "no run (*.json)"
    else:
        content, message = _broken_runs()[case]
        run = _write(tmp_path / "run.json", content)
    assert main(["check", str(run), "--baseline", str(BASELINE)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(run) in err and message in err, err


@pytest.mark.parametrize("case", [*_broken_baselines(), "missing file"])
def test_unusable_baseline_exits_2(case, tmp_path, capsys):
    run = _write(tmp_path / "run.json", _run_like(_committed()))
    if case == "missing file":
        baseline, message = tmp_path / "nope.json", "no such baseline file"
    else:
        content, message = _broken_baselines()[case]
        baseline = _write(tmp_path / "baseline.json", content)
    assert main(["check", str(run), "--baseline", str(baseline)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(baseline) in err and message in err, err


def test_write_refuses_a_baseline_that_gates_no_speedup(tmp_path, capsys):
    committed = _committed()
    dense_only = _run_like(committed)
    dense_only["rows"] = [r for r in dense_only["rows"] if not r["preset"].startswith(speed.GATE_LAYERS[1])]
    run = _write(tmp_path / "run.json", dense_only)
    assert main(["check", str(run), "--baseline", str(tmp_path / "b.json"), "--write"]) == 2
    assert "refusing to write" in capsys.readouterr().err and not (tmp_path / "b.json").exists()


def test_op_calls_are_hand_counted_and_deterministic():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    assert count_op_calls(lambda: torch.add(a, b)) == 1
    assert count_op_calls(lambda: [torch.add(a, b) for _ in range(3)]) == 3  # a Python loop shows
    assert count_op_calls(a[0, 0].item) == 2  # a sync: aten::item and its aten::_local_scalar_dense
    layer, x, mem, window = layer_and_inputs(PRESETS["tiny-switchhead"])

    def step():
        layer(x, mem, window)[0].sum().backward()

    with speed.intra_op_threads(1):
        one = count_op_calls(step)
    with speed.intra_op_threads(2):
        assert count_op_calls(step) == count_op_calls(step) == one


def _slowed(run, factor: float):
    """``run`` made ``factor`` times slower: the call, then a spin for (factor - 1) times the CPU time it took,
    as the gate measures it (a regression is extra work)."""

    def slower():
        start = time.thread_time()
        out = run()
        end = start + factor * (time.thread_time() - start)
        while time.thread_time() < end:
            pass
        return out

    return slower


@pytest.mark.slow
def test_gate_fails_on_a_switchhead_layer_slowed_by_30_percent(monkeypatch, tmp_path, capsys):
    layer_benches = speed.layer_benches

    def with_slow_switchhead(preset, *args):
        benches = layer_benches(preset, *args)
        if preset == speed.GATE_LAYERS[1]:
            for bench in benches:
                bench.run = _slowed(bench.run, 1.3)
        return benches

    monkeypatch.setattr(speed, "layer_benches", with_slow_switchhead)
    threads = torch.get_num_threads()
    assert main(["speed", "--quick", "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads
    capsys.readouterr()
    assert main(["check", str(tmp_path), "--baseline", str(BASELINE), "--json"]) == 1
    checks = json.loads(capsys.readouterr().out)["checks"]
    failed = {(c["ratio"], c["quantity"]) for c in checks if c["verdict"] != "ok"}
    assert failed and failed <= {(key, "ratio_time") for key in SWITCHHEAD_TIMES}, checks  # time only


BUSY = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@pytest.mark.slow
def test_gate_passes_beside_4_busy_processes(tmp_path):
    """The CI gate as tox runs it, while 4 processes spin on this machine's cores (each ends by itself too)."""
    # The machine this was written on is shared with other jobs: beside them and 4 busy processes it took 460 s.
    limit = 720
    busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=limit + 240)]) for _ in range(4)]
    try:
        cli = [sys.executable, "-m", "switchbench"]
        speed_run = [*cli, "speed", "--quick", "--out", str(tmp_path)]
        done = subprocess.run(speed_run, capture_output=True, text=True, timeout=limit)
        assert done.returncode == 0, done.stderr[-2000:]
        still_busy = sum(p.poll() is None for p in busy)
        check = subprocess.run(
            [*cli, "check", str(tmp_path), "--baseline", str(BASELINE)],
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert still_busy == 4
    assert check.returncode == 0, check.stdout + check.stderr
