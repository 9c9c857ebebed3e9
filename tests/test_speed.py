"""The speed harness: interleaved rounds, paired ratios, OOMs, threads, the CLI (no timing target is asserted)."""

import json
import platform
import statistics
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.utils._python_dispatch import TorchDispatchMode

from switchbench.bench.cost.accounting import model_macs
from switchbench.bench.timing import benches as benches_module
from switchbench.bench.timing import speed
from switchbench.cli import main
from switchbench.core import compiling, distributed
from switchbench.models.presets import PRESETS


@pytest.mark.slow
def test_paired_timing_and_oom_are_recorded():
    calls = []

    def ok():
        calls.append("a")

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory")

    benches = [
        speed.Bench("dense", "layer", "forward", ok, 1e6, lambda: 100.0),
        speed.Bench("moe", "layer", "forward", ok, 1e6, lambda: 40.0),
        speed.Bench("big", "layer", "forward", oom, 1e6, lambda: 1.0),
    ]
    rows = speed.time_group(benches, speed.Timer("cpu"), rounds=5, warmup=1)
    assert [r["status"] for r in rows] == ["ok", "ok", "OOM"]
    assert rows[1]["ratio_memory"] == 0.4 and rows[1]["baseline"] == "dense"
    assert len(calls) == 12  # two benches, six rounds, interleaved
    assert len(rows[1]["ratio_time_rounds"]) == 5 and rows[1]["ratio_time"] == statistics.median(
        rows[1]["ratio_time_rounds"]
    )


def test_a_kernel_readout_that_runs_out_of_memory_after_the_rounds_leaves_the_row_and_the_run():
    """A training step's attention and expert-matmul kernels are read off a differentiated forward of its whole
    batch after the rounds; beside a captured step's memory pool that may not fit, and it crashed the run."""

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory")

    bench = speed.Bench(
        "dense", "model", "train step", lambda: None, 1e6, lambda: 1.0, attention=oom, expert_matmul=oom
    )
    (row,) = speed.time_group([bench], speed.Timer("cpu"), rounds=2, warmup=0)
    assert row["status"] == "ok" and row["ms"] >= 0
    assert "attention" not in row and "expert_matmul" not in row


def test_a_member_compiled_past_the_recompile_limit_is_a_row_without_a_time():
    """Past dynamo's limit the code ran eager with a log line: an H200's compiled FlexAttention forwards took
    614 ms beside the 388 ms training step, saved as measured. Now the member has no time, and the others do."""
    config = torch._dynamo.config
    # restored after: the settings are the process's
    with config.patch(recompile_limit=config.recompile_limit, fail_on_recompile_limit_hit=False):
        compiling.allow_recompilations()
        config.recompile_limit = 2
        _time_a_member_past_the_limit()


def test_with_dynamo_s_errors_suppressed_compiling_still_runs():
    """Dynamo refuses fail_on_recompile_limit_hit beside suppress_errors (an assertion at the next compile): with
    TORCHDYNAMO_SUPPRESS_ERRORS=1 every compiled path of the suite failed."""
    config = torch._dynamo.config
    with config.patch(suppress_errors=True, fail_on_recompile_limit_hit=False):
        compiling.allow_recompilations()
        torch._dynamo.reset()
        assert torch.equal(
            torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2)), torch.full((2,), 2.0)
        )
    torch._dynamo.reset()


def _time_a_member_past_the_limit():
    torch._dynamo.reset()
    double = torch.compile(lambda x: x * 2, dynamic=False, backend="eager")
    shapes = iter(range(1, 100))

    def recompiles():  # a new shape each call: one compilation each
        double(torch.ones(next(shapes)))

    benches = [
        speed.Bench("dense", "layer", "forward", lambda: None, 1e6, lambda: 1.0),
        speed.Bench("moe", "layer", "forward", recompiles, 1e6, lambda: 1.0),
    ]
    rows = speed.time_group(benches, speed.Timer("cpu"), rounds=4, warmup=0)
    assert [r["status"] for r in rows] == ["ok", "past the recompile limit"] and "ms" not in rows[1]
    torch._dynamo.reset()


class _StandInClock:
    """A timer whose call lasts what the call returns, in milliseconds: the rounds' times set by the test."""

    device = "cpu"

    def __call__(self, fn) -> float:
        return fn()


def test_each_row_s_ratio_is_its_time_over_the_baseline_s_round_by_round_and_its_rates_in_their_units():
    """Round by round, the member's time over the baseline's of the same round (a ratio under 1: faster), the median
    of those; the rates from the median time by hand: TFLOP/s = FLOPs / (ms 1e-3) / 1e12, tokens a second = tokens
    / (ms 1e-3); the MAC floor the FLOP ratio."""
    dense_ms, moe_ms = iter([99.0, 10.0, 12.0, 8.0, 11.0]), iter([99.0, 5.0, 9.0, 2.0, 6.6])
    benches = [
        speed.Bench("dense", "model", "train step", lambda: next(dense_ms), 4e12, lambda: 1.0, tokens=2048),
        speed.Bench("moe", "model", "train step", lambda: next(moe_ms), 3e12, lambda: 1.0, tokens=2048),
    ]
    dense, moe = speed.time_group(benches, _StandInClock(), rounds=4, warmup=1)
    assert moe["ratio_time_rounds"] == pytest.approx([0.5, 0.75, 0.25, 0.6])
    assert moe["ratio_time"] == pytest.approx(0.55) and dense["ratio_time"] == 1.0  # (0.5 + 0.6) / 2
    assert moe["ms"] == pytest.approx(5.8) and dense["ms"] == pytest.approx(
        10.5
    )  # the warm-up round left out
    assert moe["tflops"] == pytest.approx(3e12 / 5.8e-3 / 1e12)
    assert moe["tokens_per_s_per_device"] == pytest.approx(2048 / 5.8e-3)
    assert moe["ratio_macs"] == 0.75 and moe["time_over_floor"] == pytest.approx(0.55 / 0.75)


def test_a_member_whose_kernel_went_unread_makes_its_group_mixed():
    """The readout ran out of memory for one member: it was left out of the comparison, so a math-path member
    beside a baseline of unknown kernel passed as fair."""

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory")

    def bench(preset, attention):
        return speed.Bench(preset, "model", "train step", lambda: None, 1e6, lambda: 1.0, attention=attention)

    rows = speed.time_group([bench("dense", oom), bench("moe", lambda: "math")], speed.Timer("cpu"), 2, 0)
    assert [r.get("attention_mixed") for r in rows] == [True, True]
    same = speed.time_group(
        [bench("dense", lambda: "flash"), bench("moe", lambda: "flash")], speed.Timer("cpu"), 2, 0
    )
    unread = speed.time_group(
        [bench("dense", lambda: None), bench("moe", lambda: None)], speed.Timer("cpu"), 2, 0
    )
    assert not any(r.get("attention_mixed") for r in same + unread)


def test_other_errors_are_not_swallowed():
    def broken():
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        speed.time_group(
            [speed.Bench("x", "layer", "forward", broken, 1, lambda: 1.0)], speed.Timer("cpu"), 1, 0
        )


def test_a_step_that_cannot_be_captured_is_a_row_and_the_group_is_timed_without_it(monkeypatch):
    """On an H100 one family's step read a value back during its CUDA graph capture, and the whole group's run
    ended there with no figure."""
    real, released = speed.model_benches, []

    def benches(preset, *args):
        if preset == "tiny-switchhead":
            raise benches_module.CaptureFailed(
                "not capturable in a CUDA graph: Cannot copy between CPU and CUDA"
            )
        return real(preset, *args)

    monkeypatch.setattr(speed, "model_benches", benches)
    monkeypatch.setattr(speed, "release_memory", lambda: released.append(True))
    group = {"tiny": ("tiny-transformer", "tiny-switchhead", "tiny-moa")}
    rows = speed.run(group, ("model",), "cpu", torch.float32, 1, rounds=2, warmup=0)
    failed = [r for r in rows if r["preset"] == "tiny-switchhead" and r["group"] == "tiny"]
    assert [(r["status"], r["reason"]) for r in failed] == [
        ("not capturable", "not capturable in a CUDA graph: Cannot copy between CPU and CUDA")
    ]
    timed = {r["preset"] for r in rows if r.get("status") == "ok" and r.get("group") == "tiny"}
    assert timed == {"tiny-transformer", "tiny-moa"} and released


def test_the_printout_marks_a_ratio_below_its_floor():
    row = {"group": "g", "preset": "p", "scope": "model", "what": "train step", "status": "ok"}
    below = {"ratio_time": 0.7931, "ratio_macs": 0.7960, "time_over_floor": 0.7931 / 0.7960}
    # 0.996 read as 1.00 at two decimals, unmarked in the summary
    assert speed._printed(row | below)["time/floor"] == "0.996 (baseline suspect)"
    above = {"ratio_time": 0.812, "ratio_macs": 0.7960, "time_over_floor": 0.812 / 0.7960}
    assert speed._printed(row | above)["time/floor"] == "1.020"
    # every expert computed: beating what the model executed is as suspect as beating the useful MACs' floor
    executed = above | {"ratio_macs_executed": 0.946}
    assert speed._printed(row | executed)["time/floor"] == "1.020 (baseline suspect)"
    assert speed._printed(row)["time/floor"] == ""


@pytest.mark.slow  # times a group
def test_without_its_dense_baseline_a_group_gets_no_ratios(monkeypatch):
    """Dense is the member most likely not to be built (the largest step at 262M, or not capturable): the next
    member must not become the baseline, its ratios read as SwitchHead's to dense."""
    real = speed.model_benches

    def benches(preset, *args):
        if preset == "tiny-transformer":
            raise benches_module.CaptureFailed("not capturable in a CUDA graph: a sync")
        return real(preset, *args)

    monkeypatch.setattr(speed, "model_benches", benches)
    group = {"tiny": ("tiny-transformer", "tiny-switchhead", "tiny-moa")}
    rows = speed.run(group, ("model",), "cpu", torch.float32, 1, rounds=2, warmup=0)
    timed = [r for r in rows if r.get("status") == "ok" and r["group"] == "tiny"]
    assert {r["preset"] for r in timed} == {"tiny-switchhead", "tiny-moa"}
    assert not any(
        key in r for r in timed for key in ("ratio_time", "ratio_macs", "baseline", "ratio_memory")
    )


@pytest.mark.slow
def test_cli_speed_json_and_files(tmp_path, capsys):
    argv = [
        "speed",
        "--device",
        "cpu",
        "--groups",
        "tiny-rope",
        "--rounds",
        "2",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
        "--json",
    ]
    threads = torch.get_num_threads()
    assert main(argv) == 0
    assert torch.get_num_threads() == threads  # the harness restores the setting
    out = json.loads(capsys.readouterr().out)
    assert out["metadata"]["threads"] == 1
    timed = [r for r in out["rows"] if r["scope"] != "count"]
    assert {(r["scope"], r["what"]) for r in timed} == {
        ("model", "train step"),
        ("model", "forward"),
        ("layer", "forward"),
        ("layer", "forward+backward"),
    }
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in timed)
    assert out["metadata"]["torch"] == torch.__version__ and Path(out["saved"]).with_suffix(".csv").exists()
    train = [r for r in timed if r["what"] == "train step"]
    assert train[0]["ratio_time"] == 1.0 and train[1]["memory_bytes"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["speed", "--groups", "nope"], "unknown groups nope"),
        (["speed", "--presets", "nope"], "unknown presets: nope"),
        (["speed", "--batch", "0"], "batch must be"),
        (["speed", "--threads", "0"], "--threads must be >= 1; got 0"),
        (["speed", "--quick", "--threads", "0"], "--threads must be >= 1; got 0"),  # was about --clock thread
        (["speed", "--warmup", "-1"], "--warmup must be >= 0; got -1"),
        (["speed", "--device", "cpu", "--clock", "thread", "--threads", "2"], "one intra-op thread"),
        (["speed", "--device", "cpu", "--cuda-graphs"], "--cuda-graphs needs one process on a CUDA device"),
        (["speed", "--fit-from", "0"], "--fit-from must be a power of two; got 0"),
        # halved to 2 and made up twice, it timed 4 sequences a step for the 5 asked
        (["speed", "--fit-from", "5"], "--fit-from must be a power of two; got 5"),
        # torch named a bad backend only once the models were built
        (["speed", "--compile", "bogus"], "--compile 'bogus' is no torch.compile backend"),
        (["speed", "--presets", "tiny-transformer:T=0"], "T must be >= 1; got 0"),
        # each was ignored without a word: --groups beside --presets, a member timed twice, --fit-from off a GPU
        (
            ["speed", "--presets", "tiny-transformer", "--groups", "tiny"],
            "presets given make one group and --groups",
        ),
        (["speed", "--presets", "tiny-transformer", "tiny-moa", "tiny-moa"], "tiny-moa is named twice"),
        (["speed", "--groups", "tiny", "tiny"], "tiny is named twice"),
        (["speed", "--device", "cpu", "--fit-from", "8"], "--fit-from fits one GPU's batch"),
        (["decode", "tiny-transformer", "--groups", "tiny"], "presets given make one group and --groups"),
    ],
)
def test_cli_bad_input(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_host_sync_in_a_step_is_named_before_its_capture():
    """Inside a capture CUDA reports only that the capture was invalidated, and torch leaves the capture's stream
    current: the last warm-up step finds the sync first, by name, and the caller's stream stays current."""
    x, stream = torch.ones(4, device="cuda"), torch.cuda.current_stream()
    with pytest.raises(benches_module.CaptureFailed, match=benches_module.SYNC_ERROR):
        benches_module.captured(lambda: x.sum().item())
    assert torch.cuda.current_stream() == stream

    def fails_in_capture():
        x.mul_(2)  # a kernel first: the end of an empty capture warns, and the suite makes warnings errors
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(benches_module.CaptureFailed, match="not permitted"):
        benches_module.captured(fails_in_capture)
    assert torch.cuda.current_stream() == stream  # the failed capture's stream is not left current

    def broken():
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch") as raised:  # a bug, not a finding
        benches_module.captured(broken)
    assert not isinstance(raised.value, benches_module.CaptureFailed)
    replay = benches_module.captured(lambda: x.mul_(2))  # a host-free step still captures
    replay()
    assert torch.cuda.get_sync_debug_mode() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_path(tmp_path, capsys):
    """CUDA events, peak memory, bf16 autocast and the Triton expert matmul, on the tiny groups."""
    argv = [
        "speed",
        "--device",
        "cuda",
        "--groups",
        "tiny",
        "--batch",
        "4",
        "--rounds",
        "3",
        "--out",
        str(tmp_path),
    ]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    timed = [r for r in out["rows"] if r["scope"] != "count"]
    assert all(r["status"] == "ok" for r in timed)
    assert all(r["memory_bytes"] > 0 for r in timed if r["what"] in ("train step", "forward+backward"))
    assert out["metadata"]["cuda"] and out["metadata"]["dtype"] == "bf16"
    assert all(0 < r["gpu_busy"] <= 1.05 for r in timed)  # kernel time over step time, from one profiled call


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_a_practitioners_step_replays_from_one_cuda_graph(tmp_path, capsys, attention):
    """Fused attention and the whole training step captured in a CUDA graph, every tiny family: the capture fails
    on any host sync, so a row that is ok is a host-free step; the run records both settings."""
    argv = ["speed", "--device", "cuda", "--groups", "tiny", "tiny-rope", "--batch", "4", "--rounds", "3"]
    argv += ["--scopes", "model", "--cuda-graphs", "--attention", attention, "--out", str(tmp_path), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    timed = [r for r in out["rows"] if r["scope"] == "model"]
    assert timed and all(r["status"] == "ok" for r in timed)
    assert out["metadata"]["cuda_graphs"] is True and out["metadata"]["attention"] == attention
    assert set(out["metadata"]["attention_resolved"].values()) == {attention}


# Every family in both scopes, as a training run computes in bf16: fp32 parameters and inputs under autocast.
# The layer scope used to cast the layer's parameters instead, and failed for the MoE families in `attend`.
TINY = (*speed.GROUPS["tiny"], *speed.GROUPS["tiny-rope"])
# the command line's start of a speed run of the tiny dense and SwitchHead pair on the CPU
TINY_PAIR_ON_CPU = ("speed", "--presets", "tiny-transformer", "tiny-switchhead", "--device", "cpu")


@pytest.mark.parametrize("preset", TINY)
@pytest.mark.parametrize("scope", ["model", "layer"])
def test_a_bf16_step_of_every_family_in_both_scopes(preset, scope):
    build = speed.model_benches if scope == "model" else speed.layer_benches
    benches = build(preset, 2, "cpu", torch.bfloat16)
    for bench in benches:
        out = bench.run()
        if bench.what == "forward":
            assert out.dtype == torch.bfloat16 and out.isfinite().all()
    memory = next(b for b in benches if b.what != "forward").memory()
    assert memory > 0


def test_a_batch_no_member_fits_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """Every case's lower bound past the free memory: exit 2 in one line and no file (it used to build nothing,
    write a file of OOM rows and exit 1)."""
    monkeypatch.setattr(speed, "free_memory", lambda device: 2**30)
    smallest = benches_module.estimated_bytes("tiny-switchhead", 100000, "layer", torch.float32)
    assert smallest > 2**30  # else the run below would start
    argv = [*TINY_PAIR_ON_CPU, "--batch", "100000", "--rounds", "1", "--out", str(tmp_path / "out"), "--json"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == [
        "switchbench speed: error: no case fits the 1.0 GiB free: the smallest, tiny-switchhead (layer), needs at "
        f"least {smallest / 2**30:.1f} GiB"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # times a group
def test_members_too_large_are_oom_rows_beside_those_that_fit(tmp_path, capsys, monkeypatch):
    """Where some case fits, the run goes on: the others are OOM rows, refused before they are built."""
    free = 2**21  # above a tiny layer's bound at batch 2 by more than CPU_MARGIN (no probe), below a model's
    monkeypatch.setattr(speed, "free_memory", lambda device: free)
    monkeypatch.setattr(benches_module, "free_memory", lambda device: free)
    argv = [
        *TINY_PAIR_ON_CPU,
        "--batch",
        "2",
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--out",
        str(tmp_path),
        "--json",
    ]
    assert main(argv) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["rows"] if r["scope"] != "count"]
    assert {(r["scope"], r["status"]) for r in rows} == {("model", "OOM"), ("layer", "ok")}
    assert all("GiB free" in r["reason"] for r in rows if r["status"] == "OOM")


@pytest.mark.slow  # times a group
def test_the_expert_matmul_choice_is_recorded_and_beside_every_time(tmp_path, capsys):
    argv = [
        *TINY_PAIR_ON_CPU,
        "--dtype",
        "bf16",
        "--scopes",
        "layer",
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--out",
        str(tmp_path),
        "--expert-matmul",
        "grouped_mm",
    ]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    metadata = out["metadata"]
    assert metadata["expert_matmul"] == "grouped_mm" and metadata["expert_matmul_resolved"]
    assert all(
        r == {"impl": "grouped_mm", "reason": "named"} for r in metadata["expert_matmul_resolved"].values()
    )
    timed = {(r["preset"], r["what"]): r for r in out["rows"] if r["scope"] == "layer"}
    assert timed["tiny-switchhead", "forward+backward"]["expert_matmul"] == "grouped_mm"
    assert "expert_matmul" not in timed["tiny-transformer", "forward"]
    assert (
        main(argv[:-2]) == 0
    )  # the default: auto, which falls back to torch on the CPU, printed in the heading
    printed = capsys.readouterr().out
    assert (
        "expert matmul auto -> torch (auto fell back, no measured entry: "
        "triton on CUDA (torch for float64), torch elsewhere)" in printed
    )
    assert "expert matmul" in printed.splitlines()[1]  # a column of the table


def test_the_batch_is_halved_until_the_whole_group_fits(monkeypatch):
    group = ("tiny-transformer", "tiny-switchhead")
    # memory for batch 8 of the larger member: 64 and 32 are refused by the estimate, 16 by a real OOM
    free = max(benches_module.estimated_bytes(p, 8, "model", torch.float32) for p in group)
    monkeypatch.setattr(benches_module, "free_memory", lambda device: free)
    monkeypatch.setattr(benches_module, "CPU_MARGIN", 1)  # the bound alone, as on a GPU: no step measured
    real = benches_module.model_benches

    def benches(preset, batch, *args):
        if batch > 8:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(preset, batch, *args)

    monkeypatch.setattr(benches_module, "model_benches", benches)
    assert benches_module.fitted_batch(group, 64, "cpu", torch.float32) == 8
    monkeypatch.setattr(benches_module, "free_memory", lambda device: 0)
    assert benches_module.fitted_batch(group, 64, "cpu", torch.float32) == 0


def test_a_group_that_does_not_fit_together_is_halved_and_made_up_by_accumulation(monkeypatch):
    """Each member fits alone at 8 (the fit), but the group's members are all resident while they are timed: room
    for 16 sequences in all. At 8 the third member runs out of memory, so the group is rebuilt at 4 with two
    accumulated halves (an H200's 262M group at 64: three members built, three turned away)."""
    real, resident, built = speed.model_benches, [0], []

    def benches(preset, batch, device, dtype, world, mode):
        if resident[0] + batch > 16:
            raise torch.OutOfMemoryError("CUDA out of memory")
        resident[0] += batch
        built.append((preset, batch, mode.accumulation))
        return real(preset, batch, device, dtype, world, mode)

    def released():
        resident[0] = 0

    monkeypatch.setattr(speed, "fitted_batch", lambda *args: 8)
    monkeypatch.setattr(speed, "model_benches", benches)
    monkeypatch.setattr(speed, "release_memory", released)
    group = {"tiny": ("tiny-transformer", "tiny-switchhead", "tiny-moa")}
    rows = speed.run(group, ("model",), "cpu", torch.float32, None, rounds=1, warmup=0, fit_from=8)
    assert built == [(p, 8, 1) for p in group["tiny"][:2]] + [(p, 4, 2) for p in group["tiny"]]
    timed = [r for r in rows if r.get("group") == "tiny"]
    assert {r["status"] for r in timed} == {"ok"}
    steps = [r for r in timed if r["what"] == "train step"]
    assert {(r["batch"], r["accumulation"]) for r in steps} == {(4, 2)}
    assert not any("accumulation" in r for r in timed if r["what"] != "train step")  # one micro-batch each
    assert speed.sequences_per_step(timed, distributed.ONE) == {"tiny": 8}  # what the run's metadata says


def test_an_oom_lets_go_of_the_failed_calls_tensors_before_the_memory_is_released(monkeypatch):
    """On an H100, once a step ran out of memory every smaller batch did too: the memory was released inside the
    handler, while the error's traceback still held the failed step's frames and tensors."""
    held, freed = [], []

    def step():
        activations = torch.empty(1024)
        held.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(benches_module, "release_memory", lambda: freed.append(held[-1]() is None))
    assert benches_module.unless_oom(step) is None
    assert freed == [True]
    with pytest.raises(ValueError):  # anything but an OOM is a bug, raised
        benches_module.unless_oom(lambda: int("x"))


def test_the_estimate_is_a_lower_bound_of_the_saved_activations():
    """The estimate refuses cases, so it must not exceed what a step really keeps."""
    for preset in ("tiny-transformer", "tiny-switchhead"):
        layer = speed.layer_benches(preset, 2, "cpu", torch.float32)[1]
        assert benches_module.estimated_bytes(preset, 2, "layer", torch.float32) <= layer.memory()


def test_each_row_stands_beside_its_mac_floor_and_attention_kernel():
    def bench(preset, flops, kernel):
        return speed.Bench(
            preset, "model", "train step", lambda: None, flops, lambda: None, attention=lambda: kernel
        )

    rows = speed.time_group(
        [bench("dense", 1e6, "flash"), bench("moe", 4e5, "flash"), bench("other", 5e5, "math")],
        speed.Timer("cpu"),
        rounds=3,
        warmup=0,
    )
    assert [r["ratio_macs"] for r in rows] == [1.0, 0.4, 0.5]
    assert rows[1]["time_over_floor"] == pytest.approx(rows[1]["ratio_time"] / 0.4)
    assert [r["attention"] for r in rows] == ["flash", "flash", "math"]
    assert all(r["attention_mixed"] for r in rows)  # one member on the math path taints the group
    same = speed.time_group(
        [bench("dense", 1e6, "flash"), bench("moe", 4e5, "flash")], speed.Timer("cpu"), 1, 0
    )
    assert not any("attention_mixed" in r for r in same)


def test_each_bench_reads_its_attention_kernel_off_a_pass_in_its_own_grad_mode(monkeypatch):
    """SDPA's backend depends on whether the call will be differentiated (cuDNN's takes no float mask under
    grad): a training step's kernel is read off a differentiated pass, a forward's off a no-grad one."""

    def grad_mode(forward):
        return "differentiated" if forward().requires_grad else "no grad"

    monkeypatch.setattr(benches_module, "attention_kernel", grad_mode)
    benches = [
        *speed.model_benches("tiny-transformer", 1, "cpu", torch.float32),
        *speed.layer_benches("tiny-transformer", 1, "cpu", torch.float32),
    ]
    assert [(b.scope, b.what, b.attention()) for b in benches] == [
        ("model", "train step", "differentiated"),
        ("model", "forward", "no grad"),
        ("layer", "forward", "no grad"),
        ("layer", "forward+backward", "differentiated"),
    ]


def test_the_attention_kernel_is_read_off_the_dispatched_operators():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from switchbench.bench.cost.measure import attention_kernel

    rope = speed.layer_benches("tiny-transformer-rope", 2, "cpu", torch.float32)[0]
    assert rope.attention() == "flash (CPU)"
    with sdpa_kernel(SDPBackend.MATH):
        assert attention_kernel(rope.run) == "math"
    xl = speed.layer_benches("tiny-transformer", 2, "cpu", torch.float32)[0]
    assert xl.attention() == "explicit softmax"


@pytest.mark.slow
def test_compiled_groups_are_recorded_as_such(tmp_path, capsys):
    argv = [
        "speed",
        "--device",
        "cpu",
        "--groups",
        "tiny-rope",
        "--scopes",
        "layer",
        "--rounds",
        "1",
        "--warmup",
        "1",
        "--compile",
        "aot_eager",
        "--out",
        str(tmp_path),
        "--json",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["metadata"]["compile"] == "aot_eager" and out["saved"].endswith("-compiled-aot_eager.json")
    timed = [r for r in out["rows"] if r["scope"] == "layer"]
    assert all(r["status"] == "ok" and r["attention"] == "flash (CPU)" for r in timed)


class _MatmulDtypes(TorchDispatchMode):
    """The input dtypes of every matmul-like operator, as dispatched (after autocast)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("mm", "bmm", "addmm", "baddbmm", "_grouped_mm"):
            self.seen.append((func.__name__, {a.dtype for a in args if isinstance(a, torch.Tensor)}))
        return func(*args, **(kwargs or {}))


FAST_SORTS = {("tiny-moa", "torch"), ("tiny-switchhead", "all_experts")}
MATMULS = {f"aten::{name}" for name in ("mm", "bmm", "addmm", "baddbmm", "_grouped_mm")}


@pytest.mark.parametrize(  # beyond dense and SwitchHead's torch path, a family sweep's cases are slow (docs/layout.md)
    ("preset", "impl"),
    [
        pytest.param(p, i, marks=() if (p, i) == ("tiny-switchhead", "torch") else pytest.mark.slow)
        for p in ("tiny-switchhead", "tiny-moa", "tiny-switchall")
        for i in ("torch", "grouped_mm")
    ]
    + [("tiny-transformer", "torch")],
)
def test_a_bf16_training_step_runs_no_fp32_matmul(preset, impl):
    """Routers included: each is one GEMM in the autocast dtype (fp32 accumulation inside it), its logits cast
    to fp32 after. An fp32 matmul would run as a SIMT GEMM without tensor cores on a GPU. Inside the expert
    matmul (one op to a dispatch mode) the profiler's record of each matmul's inputs is read too."""
    from torch.profiler import ProfilerActivity, profile

    from switchbench.ops.expert_matmul import choice as expert_matmul_choice

    device = "cuda" if torch.cuda.is_available() else "cpu"
    step = speed.model_benches(preset, 2, device, torch.bfloat16)[0]
    with expert_matmul_choice.selected(impl), expert_matmul_choice.recording() as resolved:
        with _MatmulDtypes() as spy:
            step.run()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step.run()
    assert spy.seen and all(dtypes == {torch.bfloat16} for _, dtypes in spy.seen), spy.seen
    if not hasattr(FunctionEvent(0, "", 0, 0, 0), "input_dtypes"):
        pytest.skip(
            "this torch's profiler records no input dtypes (torch 2.11): the dispatch mode's check held"
        )
    inner = [
        (e.name, {t for t in e.input_dtypes if t in ("float", "c10::BFloat16", "c10::Half")})
        for e in prof.events()
        if e.name in MATMULS
    ]
    assert inner and all(dtypes == {"c10::BFloat16"} for _, dtypes in inner), inner
    assert {r.impl for r in resolved.values()} == (set() if preset == "tiny-transformer" else {impl})
    if impl == "grouped_mm":
        assert any(name == "aten::_grouped_mm" for name, _ in inner)


@pytest.mark.parametrize(  # each path once in the fast loop, on a family of one router a layer and one of two
    ("preset", "routers_per_layer", "impl"),
    [
        pytest.param(p, r, i, marks=() if (p, i) in FAST_SORTS else pytest.mark.slow)
        for p, r in [("tiny-switchhead", 2), ("tiny-moa", 1), ("tiny-switchall", 3)]
        for i in ["torch", "all_experts"]
    ],
)
def test_one_sort_per_router_per_training_step(preset, routers_per_layer, impl):
    """Every projection a router drives reuses its one sort of the slots by expert; the backward sorts nothing.
    Where every projection computes all experts, no router sorts. (The slots' sort is of their flat expert ids;
    the sort of a router's few scores per row, its top-k, is another.)"""
    from torch.profiler import ProfilerActivity, profile

    from switchbench.ops.expert_matmul import choice as expert_matmul_choice

    with expert_matmul_choice.selected(impl):
        step = speed.model_benches(preset, 2, "cpu", torch.float32)[0]
        step.run()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step.run()
    sorts = sum(e.name == "aten::sort" and len(e.input_shapes[0]) == 1 for e in prof.events())
    assert sorts == (routers_per_layer * PRESETS[preset].n_layers if impl == "torch" else 0)


class _FakeAllocator:
    """torch.cuda's memory counters over a pretend device: what is allocated now, and the peak since a reset."""

    def __init__(self, resident: int):
        self.now = self.peak = resident

    def allocate(self, size: int) -> None:
        self.now += size
        self.peak = max(self.peak, self.now)

    def free(self, size: int) -> None:
        self.now -= size

    def reset(self) -> None:
        self.peak = self.now


def test_a_members_gpu_peak_leaves_out_what_the_others_keep_resident(monkeypatch):
    """At 262M the group's other members hold about 21 GB of weights, gradients and optimizer state, and the timer
    a 256 MB flush buffer: a member whose step needs 1 GB at its peak is measured at 1 GB, not 22."""
    gb = 2**30
    device = _FakeAllocator(resident=21 * gb + 256 * 2**20)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: device.now)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: device.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", device.reset)

    def step():  # activations, then gradients, all freed by the end of the step
        device.allocate(gb // 2)
        device.allocate(gb // 2)
        device.free(gb)

    assert benches_module._cuda_peak(step) == gb


FAULTS = """
import resource, statistics, sys, torch
from switchbench.bench.timing.heap import keep_freed_memory
from switchbench.bench.timing.benches import layer_benches
from switchbench.bench.timing.speed import GATE_LAYERS
torch.set_num_threads(1)
said = keep_freed_memory()
step = next(b for b in layer_benches(GATE_LAYERS[0], 4, "cpu", torch.float32) if b.what == "forward+backward")
def faults():
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
for _ in range(5):
    step.run()
seen = []
for _ in range(15):
    before = faults()
    step.run()
    seen.append(faults() - before)
print(statistics.median(seen), said)
"""


@pytest.mark.slow  # a subprocess or a timing: seconds each, in tox
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_the_gates_dense_layer_runs_without_page_faults_in_a_kept_heap():
    """What made the gate's dense timing wander: its temporaries of 20-30 MiB were mapped afresh and faulted page
    by page on some calls (5k to 40k faults per forward+backward here, varying between processes); in a kept
    heap they are reused and the step touches no new page, in the median call. (Now and then a call still grows the
    heap, a few thousand faults, about one call in ten here: a median of 7 calls once read 734 beside a loaded
    suite; of 15 after 5 warm-up calls, half of them would have to.)"""
    done = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, check=True)
    faults, said = done.stdout.split(" ", 1)
    assert said.startswith("glibc heap kept") and float(faults) < 100, done.stdout


@pytest.mark.slow  # times a group
def test_a_context_sweep_member_is_timed_at_its_context_beside_its_floor_there(tmp_path, capsys):
    """Presets named with a changed chunk length are timed at it, and the row's MAC floor is the exact count's
    ratio at that length (MoE attention pays off more as the context grows)."""
    from switchbench.bench.cost.accounting import exact_cost

    pair = [f"{name}:T=64" for name in ("tiny-transformer-rope", "tiny-switchhead-rope")]
    argv = ["speed", "--presets", *pair, "--device", "cpu", "--scopes", "layer", "--batch", "1"]
    assert main([*argv, "--rounds", "2", "--warmup", "0", "--out", str(tmp_path), "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["rows"] if r["preset"] == pair[1]]
    at_64 = [exact_cost(PRESETS[name.split(":")[0]].replace(T=64)) for name in pair]
    assert rows and all(r["ratio_macs"] == pytest.approx(at_64[1].macs / at_64[0].macs) for r in rows)
    default = [exact_cost(PRESETS[name.split(":")[0]]) for name in pair]
    assert default[1].macs / default[0].macs != pytest.approx(at_64[1].macs / at_64[0].macs)


def test_an_accumulated_step_counts_its_micro_batches_and_updates_as_one_pass():
    """Two micro-batches of the same sequences, each loss halved: the gradients, and AdamW's step, are one pass's;
    the step's FLOPs and tokens are twice a pass's, the forward's its own."""
    from switchbench.bench.timing.benches import StepMode, model_benches

    torch.manual_seed(0)
    one = model_benches("tiny-switchhead", 2, "cpu", torch.float32)
    torch.manual_seed(0)
    two = model_benches("tiny-switchhead", 2, "cpu", torch.float32, mode=StepMode(accumulation=2))
    assert two[0].flops == 2 * one[0].flops and two[0].tokens == 2 * one[0].tokens
    assert two[1].flops == one[1].flops
    before = [p.detach().clone() for p in one[0].module.parameters()]
    one[0].run()
    two[0].run()
    for p, q in zip(one[0].module.parameters(), two[0].module.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7)  # Adam's step would hide a factor
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(p, b) for p, b in zip(one[0].module.parameters(), before, strict=True))


@pytest.mark.slow  # compiles
def test_a_compiled_step_compiles_one_graph_that_every_block_runs():
    """--compile compiles the blocks, as torchtitan does: every layer runs the one graph traced for the first, a
    block's worth of operators (compiling the whole model traces every layer apart); the step equals the eager
    one, and its row names the expert matmul it ran (it had read None)."""
    from switchbench.bench.timing.benches import StepMode, compile_blocks, model_benches
    from switchbench.models.lm import LanguageModel
    from switchbench.models.presets import from_name

    graphs = []

    def recorded(graph, inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    model = LanguageModel(from_name("tiny-switchhead").replace(dropout=0.0))
    tokens = torch.randint(0, model.cfg.vocab, (2, model.cfg.T + 1))
    with torch.no_grad():
        state = model(tokens[:, :-1]).state
    compile_blocks(model, recorded)
    model(tokens[:, :-1], state).loss(tokens[:, 1:]).backward()
    norms = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "layer_norm" in str(n.target)]
    assert model.cfg.n_layers > 1 and len(graphs) == 1
    assert len(norms) == 3  # one block's: its attention's on the chunk and on the memory, its MLP's

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = model_benches("tiny-switchhead", 2, "cpu", torch.float32)[0]
    torch.manual_seed(0)
    compiled = model_benches("tiny-switchhead", 2, "cpu", torch.float32, mode=StepMode(compile="aot_eager"))[
        0
    ]
    eager.run()
    compiled.run()
    for p, q in zip(eager.module.parameters(), compiled.module.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    # the compiled step resolved its expert matmuls once, as it was traced: its row still names them
    assert compiled.expert_matmul() == eager.expert_matmul() is not None
    torch._dynamo.reset()


@pytest.mark.slow  # compiles
def test_every_member_of_a_six_family_group_runs_compiled():
    """The families' blocks are one code object to the compiler, each family and grad mode a compilation of it:
    past dynamo's default limit of 8 the later members of a group ran eager, silently (the ninth was refused)."""
    from torch._dynamo.utils import counters

    from switchbench.bench.timing.benches import compile_blocks
    from switchbench.models.lm import LanguageModel
    from switchbench.models.presets import from_name

    torch._dynamo.reset()
    counters.clear()
    presets = [
        "tiny-transformer",
        "tiny-switchhead",
        "tiny-moa",
        "tiny-switchall",
        "tiny-gqa-kv2",
        "tiny-moh",
    ]
    for preset in presets:
        model = LanguageModel(from_name(preset).replace(dropout=0.0))
        tokens = torch.randint(0, model.cfg.vocab, (2, model.cfg.T + 1))
        with torch.no_grad():
            state = model(tokens[:, :-1]).state
        compile_blocks(model, "eager")
        model(tokens[:, :-1], state).loss(tokens[:, 1:]).backward()  # a training step's pass
        with torch.no_grad():
            model(tokens[:, :-1], state)  # and a forward's
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 2 * len(presets)
    torch._dynamo.reset()


@pytest.mark.slow  # times a group
def test_a_model_on_all_experts_stands_beside_the_floor_it_executes(tmp_path, capsys):
    """Computing every expert executes more than the useful MACs: SwitchHead's rows carry the ratio of executed
    MACs, its useful floor plus, per layer, the products of the experts no slot chose, counted by hand (V over the
    window of T tokens and T of memory, O over the T current ones); on a routed implementation there is none."""
    argv = [
        *TINY_PAIR_ON_CPU,
        "--scopes",
        "model",
    ]
    argv += ["--batch", "1", "--rounds", "1", "--warmup", "0", "--out", str(tmp_path), "--json"]
    cfg = PRESETS["tiny-switchhead"]
    unchosen = cfg.n_heads * (cfg.n_experts - cfg.k)
    per_layer = 2 * cfg.T * unchosen * cfg.d_model * cfg.d_head + cfg.T * unchosen * cfg.d_head * cfg.d_model
    extra = cfg.n_layers * per_layer / model_macs(PRESETS["tiny-transformer"])
    for impl in ("all_experts", "torch"):
        assert main([*argv, "--expert-matmul", impl]) == 0
        rows = json.loads(capsys.readouterr().out)["rows"]
        rows = [r for r in rows if r["preset"] == "tiny-switchhead" and r["scope"] == "model"]
        assert {r["what"] for r in rows} == {"train step", "forward"}
        for r in rows:
            if impl == "torch":
                assert "ratio_macs_executed" not in r
            else:
                assert r["ratio_macs_executed"] == pytest.approx(r["ratio_macs"] + extra, rel=1e-12)


def test_gpu_busy_counts_each_kernel_once_under_a_label(monkeypatch):
    """A record_function range (torch.optim's step, the expert matmul's labels) comes back from the profiler as a
    device event spanning its kernels, beside the kernels: one 2 ms kernel under AdamW's label is 2 ms of kernel
    time, not 4 (events as the profiler builds them on CUDA; the CPU has no device events to profile)."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from switchbench.bench.timing import timer

    def device_event(name: str, annotation: bool) -> FunctionEvent:
        return FunctionEvent(
            id=1, name=name, thread=0, start_us=0, end_us=2000, device_type=DeviceType.CUDA,
            is_user_annotation=annotation,
        )  # fmt: skip

    events = [
        device_event("multi_tensor_apply_kernel", False),
        device_event("Optimizer.step#AdamW.step", True),
    ]

    @contextmanager
    def profiled(activities):
        yield SimpleNamespace(events=lambda: events)

    monkeypatch.setattr(timer, "profiled", profiled)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert timer.kernel_ms(lambda: None) == 2.0


def test_a_layer_on_all_experts_stands_beside_the_floor_it_executes():
    """The layer rows carry their executed MACs too (they had none): SwitchHead's layer, the useful count plus the
    products of the experts no slot chose, by hand (V over the window of T tokens and T of memory, O over the T
    current ones); its forward 2 FLOPs a MAC, its forward+backward 6."""
    from switchbench.bench.cost.accounting import exact_cost
    from switchbench.ops.expert_matmul import choice as expert_matmul_choice

    cfg = PRESETS["tiny-switchhead"]
    unchosen = cfg.n_heads * (cfg.n_experts - cfg.k)
    extra = 2 * cfg.T * unchosen * cfg.d_model * cfg.d_head + cfg.T * unchosen * cfg.d_head * cfg.d_model
    with expert_matmul_choice.selected("all_experts"):
        benches = benches_module.layer_benches("tiny-switchhead", 1, "cpu", torch.float32)
    useful = exact_cost(cfg).batched_macs(1)
    assert {b.what: b.executed_flops for b in benches} == {
        "forward": 2 * (useful + extra),
        "forward+backward": 6 * (useful + extra),
    }


def test_only_members_of_one_pass_are_compared_for_their_attention_kernel():
    """XL on CUDA: SDPA runs its memory-efficient kernel for a training step and cuDNN's for a no-grad forward, in
    every member alike. Pooled by scope alone, every XL row read as mixed, and the summary called each ratio not
    comparable; a member that differs from the others in one pass is still marked."""
    rows = [
        {"preset": p, "scope": "model", "what": what, "status": "ok", "attention": kernel}
        for p in ("dense", "switchhead")
        for what, kernel in (("train step", "memory-efficient"), ("forward", "cuDNN"))
    ]
    speed._flag_mixed_attention(rows)
    assert not any("attention_mixed" in r for r in rows)
    rows[0]["attention"] = "math"  # dense's training step alone on another kernel
    speed._flag_mixed_attention(rows)
    assert [r.get("attention_mixed", False) for r in rows] == [True, False, True, False]
