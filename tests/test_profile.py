"""``switchbench profile``: shares that add up to the step, each unit of time counted once and put where it ran."""

import collections
import inspect
import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

from switchbench.bench.cost.accounting import model_macs
from switchbench.bench.timing import benches, profile
from switchbench.bench.timing.benches import model_benches
from switchbench.cli import main
from switchbench.models import family as registry
from switchbench.models.lm import LanguageModel
from switchbench.models.presets import PRESETS
from switchbench.ops.expert_matmul import all_experts
from switchbench.ops.expert_matmul import choice as expert_matmul_choice
from switchbench.ops.expert_matmul import op as expert_matmul
from switchbench.ops.expert_matmul.slot_rows import GATES_LABEL as GATES
from switchbench.ops.expert_matmul.slot_rows import WEIGHT_GRADIENT_LABEL
from switchbench.reports.report import load_profile, render


def _one_tiny_step(*extra: str) -> list[str]:
    """``switchbench profile`` of one tiny SwitchHead step on the CPU, without warm-up."""
    return ["profile", "tiny-switchhead", "--device", "cpu", "--steps", "1", "--warmup", "0", *extra]


def _shares(rows: list[dict], what: str = "train step") -> dict[str, float]:
    return {r["name"]: r["ms"] for r in rows if r["kind"] == "share" and r["what"] == what}


@pytest.mark.slow  # times a profiled step
def test_the_shares_add_up_to_the_step_timed_by_a_separate_clock():
    rows = profile.run(["tiny-switchhead"], ["train step"], 2, "cpu", torch.float32, steps=2, warmup=1, top=5)
    shares = _shares(rows)
    assert list(shares) == list(profile.SHARES)
    wall = rows[0]["ms_wall"]  # perf_counter around each profiled step, not the profiler's clock
    # The shares are the profiled step, no kernel counted twice (then they would add up to more), and that step
    # lies inside the timed one: what lies between them (entering the range, a preemption on a loaded machine: 2.7%
    # of a 35 ms step beside a busy CI run, and one time slice of 3 to 10 ms is a third of a 12 ms step) makes the
    # wall clock the longer, and only a range that misses most of the step would be under half of it
    assert sum(shares.values()) == pytest.approx(rows[0]["ms_profiled"])
    assert 0.5 * wall <= rows[0]["ms_profiled"] <= 1.01 * wall
    assert sum(r["fraction"] for r in rows if r["kind"] == "share") == pytest.approx(1.0)


def test_every_operator_is_counted_once():
    """The units are operators' self times, which fit inside the step's range; total times count a nested operator
    again in each of its parents (more than the self times here, where operators nest), so they are not the units."""
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
    assert sum(u.us for u in found) < step_us
    # No upper bound from total times: the host's own time between operators grows with the machine's load and
    # may exceed what nesting adds (a loaded CI machine's did); that operators nest here is what makes the
    # self times the only units that count each operator once.
    assert any(e.cpu_parent is not None and e.cpu_parent.name.startswith(profile.OPERATORS) for e in ops)


@pytest.mark.slow  # a subprocess or a timing: seconds each, in tox
def test_a_slower_expert_matmul_takes_a_larger_share(monkeypatch):
    def run() -> tuple[float, float]:
        """The expert matmul's forward time and the rest of the operators' time."""
        with expert_matmul_choice.selected("torch"):  # the implementation slowed below, whatever else is set
            rows = profile.run(["tiny-switchhead"], ["train step"], 2, "cpu", torch.float32, 2, 1, 5)
        shares = _shares(rows)
        rest = sum(shares.values()) - shares[profile.EXPERT_FORWARD] - shares["outside kernels"]
        return shares[profile.EXPERT_FORWARD], rest

    def ratio() -> float:
        """The least of each time over five runs: a busy machine only adds time, and not to every operator alike
        (a stall lands in one), so the minima, not a median of ratios, are what a run on a quiet machine gives."""
        expert, rest = zip(*(run() for _ in range(5)), strict=True)
        return min(expert) / min(rest)

    before = ratio()
    forward = expert_matmul.TorchExpertMatmul.forward

    def ten_times(*args):
        for _ in range(9):
            forward(*args)
        return forward(*args)

    monkeypatch.setattr(expert_matmul.TorchExpertMatmul, "forward", staticmethod(ten_times))
    after = ratio()
    # ten times the op's arithmetic: about 4.5 times the ratio here (the op's gathers and scatters are not
    # repeated); the share attributed elsewhere would leave it near 1
    assert after > 2.5 * before, (before, after)


@pytest.mark.slow  # times a profiled step
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
    assert any(r["name"] == "aten::mm" and r["share"] == "dense GEMMs" for r in kernels)
    # the routers' GEMMs run with the projections that read the same input (layers/projections.py): dense GEMMs
    assert not any(r["name"] in ("aten::mm", "aten::addmm") and r["share"] == "routing" for r in kernels)
    assert {r["share"] for r in kernels if r["name"] == "aten::bmm"} >= {profile.EXPERT_FORWARD}
    dense = _shares(profile.run(["tiny-transformer"], ["train step"], 2, "cpu", torch.float32, 1, 1, 5))
    assert all(dense[name] == 0 for name in (*profile.SHARES[:3], "routing"))


# the Triton passes profiled in the interpreter: 12 s
@pytest.mark.parametrize("passes", [pytest.param("triton", marks=pytest.mark.slow), "torch"])
def test_the_gates_all_experts_applies_outside_its_op_land_in_the_expert_matmul_shares(passes, monkeypatch):
    """On all_experts SwitchHead's value projection is gated outside the op: that gating and its backward (a Triton
    kernel each way, or eager products and sums) are the expert matmul's (forward, input gradient), not the routing
    of the module around them."""
    if os.environ.get("TRITON_INTERPRET") != "1" and passes == "triton":
        pytest.skip("Triton runs on the CPU only in its interpreter")
    monkeypatch.setattr(all_experts, "fused", lambda t: passes == "triton")  # a CPU run is eager unless asked
    with expert_matmul_choice.selected("all_experts"):
        rows = profile.run(["tiny-switchhead"], ["train step"], 2, "cpu", torch.float32, 1, 1, 200)
    shares = collections.defaultdict(set)
    for r in rows:
        if r["kind"] == "kernel":
            shares[r["name"]].add(r["share"])
    if passes == "triton":
        assert shares["switchbench::gate_sum"] == {profile.EXPERT_FORWARD}
        assert shares["switchbench::gate_sum_backward"] == {profile.EXPERT_INPUT}
        return
    assert {profile.EXPERT_FORWARD, profile.EXPERT_INPUT} <= shares["aten::mul"]
    assert profile.EXPERT_FORWARD in shares["aten::sum"] and "routing" not in shares["aten::sum"]


@pytest.mark.slow  # times a profiled step
def test_the_grouped_gemm_path_lands_in_the_expert_matmul_shares(tmp_path, capsys):
    """On grouped_mm the forward, input-gradient and weight-gradient GEMMs each land in their share; the choice is
    recorded in the run's metadata."""
    with expert_matmul_choice.selected("grouped_mm"):
        rows = profile.run(["tiny-switchhead"], ["train step"], 2, "cpu", torch.float32, 1, 1, 50)
    grouped = {r["share"] for r in rows if r["kind"] == "kernel" and r["name"] == "aten::_grouped_mm"}
    assert grouped == set(profile.SHARES[:3])
    argv = _one_tiny_step("--expert-matmul", "grouped_mm", "--out", str(tmp_path), "--json")
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
        # the Triton weight-gradient kernel as an H100 profile saw it: in the backward op, outside the label
        (profile.Unit(1, "_grouped_outer_kernel", "", (profile.EXPERT_BACKWARD_OP,)), profile.EXPERT_WEIGHT),
        (profile.Unit(1, "_scatter_matmul_kernel", "", (profile.EXPERT_BACKWARD_OP,)), profile.EXPERT_INPUT),
        (
            profile.Unit(1, "k", "aten::bmm", (profile.EXPERT_BACKWARD_OP, WEIGHT_GRADIENT_LABEL)),
            profile.EXPERT_WEIGHT,
        ),
        (profile.Unit(1, "k", "aten::mm", (profile.MODULE_LABEL + "attention", "aten::mm")), "attention"),
        (profile.Unit(1, "k", "aten::mm", ("aten::linear", "aten::mm")), "dense GEMMs"),
        (
            profile.Unit(1, "k", "aten::copy_", (profile.MODULE_LABEL + "moe", "aten::copy_")),
            "copies and casts",
        ),
        (profile.Unit(1, "k", "aten::sigmoid", (profile.MODULE_LABEL + "moe", "aten::sigmoid")), "routing"),
        # gates applied outside the op (all_experts' value projection), forward and in the backward
        (
            profile.Unit(1, "k", "aten::mul", (profile.MODULE_LABEL + "moe", GATES, "aten::mul")),
            profile.EXPERT_FORWARD,
        ),
        (
            profile.Unit(
                1, "k", "aten::mul", (profile.MODULE_LABEL + "moe", GATES, f"{profile.BACKWARD_NODE}: M")
            ),
            profile.EXPERT_INPUT,
        ),
        (profile.Unit(1, "k", "aten::add", ("aten::add",)), "norms and elementwise"),
        (profile.Unit(1, "k", "", ("cudaMemsetAsync",)), "other"),
    ],
)
def test_share_rules(unit, expected):
    assert profile.share(unit) == expected


@pytest.mark.slow  # times a profiled step
def test_the_command_writes_a_run_and_the_report_shows_it_side_by_side(tmp_path: Path, capsys):
    """The dense member is a preset with a change (NAME:field=value), as every command that takes a preset takes one;
    profile used to refuse it."""
    out = tmp_path / "profile"
    args = [
        "profile",
        "tiny-transformer:d_ff=96",
        "tiny-switchhead",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--threads",
        "1",
    ]
    assert main([*args, "--forward", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["metadata"]["threads"] == 1
    saved = Path(printed["saved"])
    assert saved.parent == out / saved.parent.name and saved.with_suffix(".csv").exists()
    assert printed["metadata"]["presets"] == ["tiny-transformer:d_ff=96", "tiny-switchhead"]
    assert printed["metadata"]["expert_matmul"] == "auto" and printed["metadata"]["expert_matmul_resolved"]
    assert {(r["preset"], r["what"]) for r in printed["rows"]} == {
        (p, w) for p in ("tiny-transformer:d_ff=96", "tiny-switchhead") for w in ("train step", "forward")
    }
    for row in printed["rows"]:  # each row's MFU checkable from its file: the step's model FLOPs by hand
        cfg = (
            PRESETS["tiny-switchhead"] if row["preset"] == "tiny-switchhead" else PRESETS["tiny-transformer"]
        )
        passes = 3 if row["what"] == "train step" else 1
        flops = 2 * passes * model_macs(cfg.replace(d_ff=96) if cfg.model == "transformer" else cfg, 2)
        assert row["mfu"] == pytest.approx(
            flops / (row["ms_unprofiled"] / 1e3) / (row["matmul_peak_tflops"] * 1e12)
        )
    overhead = {r["what"]: r for r in printed["rows"] if r["kind"] == "moe overhead"}
    assert {r["preset"] for r in overhead.values()} == {"tiny-switchhead"} and set(overhead) == {
        "train step",
        "forward",
    }
    for what, r in overhead.items():  # its routing and expert-matmul shares, less the dense equivalent
        shares = _shares([x for x in printed["rows"] if x["preset"] == "tiny-switchhead"], what)
        assert r["moe_ms"] == pytest.approx(sum(shares[name] for name in profile.MOE_SHARES))
        assert (
            r["ms"] == pytest.approx(r["moe_ms"] - r["dense_equivalent_ms"]) and r["dense_equivalent_ms"] > 0
        )
        dense = next(
            x for x in printed["rows"] if x["preset"] == "tiny-transformer:d_ff=96" and x["what"] == what
        )
        # on the CPU against dense's profiled step, the clock its shares are on (it used the unprofiled one)
        assert r["dense_step_ms"] == dense["ms_profiled"] and r["dense_preset"] == dense["preset"]
        assert r["fraction_of_dense_step"] == pytest.approx(r["ms"] / dense["ms_profiled"])
    page = render({"profile": load_profile(tmp_path)}, {})
    assert "Where a training step" in page and page.count("tiny-switchhead<br>") == 2
    assert "MoE overhead: routing and expert matmul" in page
    assert (
        f"{100 * overhead['train step']['fraction_of_dense_step']:.1f}% of tiny-transformer:d_ff=96's step"
        in page
    )
    assert main([*args, "--top", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tiny-switchhead, train step: MoE overhead " in text
    listed = text.split("top 2 kernels of each step, per step:\n")[1].splitlines()[1:-1]  # below its header
    assert (
        sorted(line.split()[0] for line in listed)
        == ["tiny-switchhead"] * 2 + ["tiny-transformer:d_ff=96"] * 2
    )


@pytest.mark.parametrize(("device", "step_ms"), [("cuda", 300.0), ("cpu", 415.0)])
def test_the_overhead_stands_beside_dense_s_step_on_the_shares_clock(device, step_ms):
    """An H200's 262M profile: dense's step 301.3 ms unprofiled, 415.4 ms profiled (the profiler's host cost), and
    SwitchHead's overhead 37.4 ms of kernel time. On a GPU a kernel's time is the same under the profiler, so the
    overhead is 12.4% of the real step; on the CPU every operator's time carries the profiler's cost, so the
    profiled step is the one to divide by."""
    dense = {"preset": "c4-262m-transformer-h16", "what": "train step", "kind": "share", "name": "attention"}
    dense |= {"ms_unprofiled": 300.0, "ms_profiled": 415.0}
    overhead = {"preset": "c4-262m-switchhead-h4", "what": "train step", "kind": "moe overhead", "ms": 37.5}
    overhead |= {"moe_ms": 63.0, "dense_equivalent_ms": 25.5}
    rows = profile._beside_dense([dense, overhead], device)
    assert rows[1]["fraction_of_dense_step"] == pytest.approx(37.5 / step_ms)
    (line,) = profile.overhead_lines(rows)
    assert line.endswith(f", {100 * 37.5 / step_ms:.1f}% of c4-262m-transformer-h16's train step")


def test_the_expert_matmuls_of_a_preset_are_its_attention_s_and_its_mlp_s():
    """The cases the overhead's dense equivalent is timed on: none for dense; SwitchHead's V and O at 262M; SwitchAll's
    attention (SwitchHead's) and its sigma-MoE MLP; each at the batch asked for."""
    assert registry.layer_expert_matmuls(PRESETS["c4-262m-transformer-h16"], 8) == ()
    switchhead = registry.layer_expert_matmuls(PRESETS["c4-262m-switchhead-h4"], 8)
    assert [c.name for c in switchhead] == ["switchhead-v", "switchhead-o"]
    assert switchhead[1].tokens == 8 * PRESETS["c4-262m-switchhead-h4"].T
    switchall = [c.name for c in registry.layer_expert_matmuls(PRESETS["tiny-switchall"], 2)]
    assert switchall == ["switchhead-v", "switchhead-o", "sigma-moe-up", "sigma-moe-down"]


def test_the_overhead_is_the_moe_shares_less_every_layer_s_dense_equivalent(monkeypatch):
    passes = {"forward": 0.25, "forward+backward": 0.5}
    monkeypatch.setattr(profile, "dense_equivalent_ms", lambda case, device, dtype: passes)
    shares = [
        {"kind": "share", "name": name, "ms": ms}
        for name, ms in [
            ("routing", 2.0),
            (profile.EXPERT_FORWARD, 3.0),
            (profile.EXPERT_INPUT, 4.0),
            (profile.EXPERT_WEIGHT, 5.0),
            ("attention", 100.0),
        ]
    ] + [{"kind": "kernel", "name": "routing", "ms": 50.0}]
    dense = profile.dense_equivalent("tiny-switchhead", 2, "cpu", torch.float32)
    layers = PRESETS["tiny-switchhead"].n_layers
    assert dense == {p: layers * 2 * ms for p, ms in passes.items()}  # two cases, V and O
    row = profile.moe_overhead(shares, 40.0, "train step", dense)
    assert row["moe_ms"] == 14.0 and row["dense_equivalent_ms"] == layers * 2 * 0.5
    assert row["ms"] == 14.0 - layers and row["fraction"] == row["ms"] / 40.0
    assert profile.moe_overhead(shares, 40.0, "forward", dense)["dense_equivalent_ms"] == layers * 2 * 0.25
    assert profile.dense_equivalent("tiny-transformer", 2, "cpu", torch.float32) is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["no-such-preset"], "unknown preset 'no-such-preset'"),
        (["tiny-switchhead:d_ff=many"], "d_ff must be int; got 'many'"),
        (["tiny-switchhead", "--steps", "0"], "must be >= 1"),
        (["tiny-switchhead", "--fit-from", "0"], "must be >= 1"),
        (["tiny-switchhead", "--threads", "0"], "--threads must be >= 1"),
        (["tiny-switchhead", "--batch", "2", "--fit-from", "4"], "--batch and --fit-from: give one"),
        (["tiny-switchhead", "tiny-switchhead"], "tiny-switchhead is named twice"),  # the table showed one
    ],
)
def test_bad_input_is_one_line_and_exit_2(extra, message, capsys, tmp_path):
    start = time.perf_counter()
    assert main(["profile", *extra, "--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert time.perf_counter() - start < 5 and not any(tmp_path.iterdir())


def test_a_batch_that_cannot_fit_is_refused_before_any_work(capsys, tmp_path):
    assert (
        main(
            [
                "profile",
                "c4-262m-switchhead-h4",
                "--batch",
                "10000000",
                "--device",
                "cpu",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "try a smaller --batch" in capsys.readouterr().err


def test_a_backward_run_on_another_thread_is_counted_in_its_shares():
    """On CUDA autograd runs the backward on a device thread of its own, outside the thread of the step's label.
    On the CPU the same events come from a backward called on another thread, profiled on every thread."""
    cfg = PRESETS["tiny-switchhead"].replace(dropout=0.0)
    model = LanguageModel(cfg)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.T + 1), generator=torch.Generator().manual_seed(0))
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    labels = profile._Labels(profile.module_roles(model))
    with (
        labels,
        torch.profiler.profile(experimental_config=every_thread) as prof,
        torch.profiler.record_function(profile.STEP_LABEL),
    ):
        loss = model(tokens[:, :-1]).loss(tokens[:, 1:])
        worker = threading.Thread(target=loss.backward)
        worker.start()
        worker.join()
    events = list(prof.events())
    assert {e.thread for e in events if e.name.startswith("autograd::engine")} != {events[0].thread}
    found, step_us = profile.units(events, "cpu")
    shares, _ = profile.summarise(found, step_us, 1, 5)
    fractions = {r["name"]: r["fraction"] for r in shares}
    assert fractions[profile.EXPERT_INPUT] > 0 and fractions[profile.EXPERT_WEIGHT] > 0
    # every operator of both threads is a unit (no fraction of the step is asserted: the host's time between
    # operators, "outside kernels", is about half of this tiny step and grows with the machine's load)
    ops = [e for e in events if e.name.startswith(profile.OPERATORS)]
    backward = sum(e.self_cpu_time_total for e in ops if e.thread != events[0].thread)
    assert backward > 0 and len(found) == len(ops)
    assert sum(u.us for u in found) == pytest.approx(sum(e.self_cpu_time_total for e in ops))


def _event(id, name, start, end, thread=1, device=DeviceType.CPU, linked=0):
    # torch 2.11's events take no linked_correlation_id (the GPU node's): only a linked event passes one
    link = {"linked_correlation_id": linked} if linked else {}
    return FunctionEvent(
        id=id, name=name, thread=thread, start_us=start, end_us=end, device_type=device, **link
    )


@pytest.mark.skipif(
    "linked_correlation_id" not in inspect.signature(FunctionEvent).parameters,
    reason="this torch's profiler links no kernel to its launch (torch 2.11 has no linked_correlation_id)",
)
def test_a_cuda_kernel_takes_the_context_of_its_launch_on_the_backward_thread():
    """Profiler events as torch builds them on CUDA (autograd/profiler.py): the backward on a device thread; each
    kernel linked to its operator and sharing its correlation id with its launch, the runtime call. The Triton
    weight-gradient kernel is launched inside the weight-gradient label, which is no operator: it lands in the
    weight-gradient share, the input-gradient kernel of the same operator in its own."""
    step = _event(1, profile.STEP_LABEL, 0, 100)
    node = _event(2, "autograd::engine::evaluate_function: ExpertMatmulBackward", 10, 70, thread=2)
    op = _event(3, profile.EXPERT_BACKWARD_OP, 12, 65, thread=2)
    label = _event(4, WEIGHT_GRADIENT_LABEL, 30, 50, thread=2)
    launches = [
        _event(900, "cuLaunchKernel", 15, 16, thread=2, linked=3),
        _event(901, "cuLaunchKernel", 35, 36, thread=2, linked=3),
    ]
    kernels = [
        _event(900, "_scatter_matmul_kernel", 20, 30, thread=7, device=DeviceType.CUDA, linked=3),
        _event(901, "_grouped_outer_kernel", 40, 80, thread=7, device=DeviceType.CUDA, linked=3),
    ]
    for kernel in kernels:  # the operator holds both kernels too, as the profiler attaches them
        op.append_kernel(kernel.name, 0, kernel.time_range.elapsed_us())
    # on CUDA the step's label comes back a second time, as a device annotation over the kernels it launched
    step_on_gpu = _event(5, profile.STEP_LABEL, 20, 80, thread=7, device=DeviceType.CUDA)
    events = [step, node, op, label, *launches, *kernels, step_on_gpu]
    EventList(events)._build_tree()
    found, step_us = profile.units(events, "cuda")
    assert step_us == 100  # the host's range alone: the annotation counted too made every forward's step 2x
    assert sorted((u.name, profile.share(u), u.us) for u in found) == [
        ("_grouped_outer_kernel", profile.EXPERT_WEIGHT, 40),
        ("_scatter_matmul_kernel", profile.EXPERT_INPUT, 10),
    ]


@pytest.mark.parametrize("impl", expert_matmul.IMPLS)
def test_each_weight_gradient_range_is_of_an_operator_s_scope(impl, monkeypatch):
    """The profiler links a kernel to the innermost range of function scope open at its launch (its correlation id
    is pushed for those; a user-scoped range pushes another kind): with record_function's user scope, a Triton
    kernel launched straight inside the weight-gradient range was counted to the backward op around it, the input
    gradient. The range is of the scope the operators' own ranges have, in every implementation."""
    if impl == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton runs on the CPU only in its interpreter")
    # all_experts' Triton passes where the interpreter runs them (a CPU run is eager unless asked)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    monkeypatch.setattr(all_experts, "fused", lambda t: impl == "all_experts" and interpreted)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1, 8, generator=g, requires_grad=True)
    weight = torch.randn(3, 8, 4, generator=g, requires_grad=True)
    scores = torch.rand(6, 3, generator=g, requires_grad=True)
    indices = torch.randint(0, 3, (6, 2), generator=g)
    y = expert_matmul.expert_matmul(x, weight, expert_matmul.route(indices, 3), scores, 1, impl=impl)
    with torch.profiler.profile() as prof:
        y.sum().backward()
    scopes = {e.name: e.scope for e in prof.events()}
    assert scopes[WEIGHT_GRADIENT_LABEL] == scopes[profile.EXPERT_BACKWARD_OP]
    with torch.profiler.profile() as prof, torch.profiler.record_function("user"):
        pass
    assert {e.name: e.scope for e in prof.events()}["user"] != scopes[profile.EXPERT_BACKWARD_OP]


def test_without_linked_launches_a_kernel_in_the_weight_gradient_range_is_the_weight_gradient_s():
    """Without linked launches (torch 2.11) a kernel comes attached to the innermost function-scope range open at its
    launch (the scope test above holds the range to that scope): all_experts' lay-out kernel, run for both
    gradients, is counted to the input gradient under the backward op alone and to the weight gradient under the
    range, though no name tells them apart."""
    step = _event(1, profile.STEP_LABEL, 0, 100)
    op = _event(3, profile.EXPERT_BACKWARD_OP, 10, 60)
    weight_range = _event(4, WEIGHT_GRADIENT_LABEL, 30, 50)
    op.append_kernel("_lay_out_kernel", 0, 7)
    weight_range.append_kernel("_lay_out_kernel", 0, 5)
    events = [step, op, weight_range]
    EventList(events)._build_tree()
    found, _ = profile.units(events, "cuda")
    assert sorted((profile.share(u), u.us) for u in found) == [
        (profile.EXPERT_INPUT, 7),
        (profile.EXPERT_WEIGHT, 5),
    ]


def test_a_kernel_attached_to_two_host_events_of_one_correlation_id_is_counted_once():
    """Without linked launches (torch 2.11) a kernel is counted from the host event it is attached to, and the
    profiler attaches it to every event of its launch's correlation id: an overhead record given its operator's
    id (pytorch/pytorch#193924) counted the operator's kernels twice."""
    step = _event(1, profile.STEP_LABEL, 0, 100)
    op = _event(3, profile.EXPERT_BACKWARD_OP, 10, 60)
    overhead = _event(3, "Lazy Function Loading", 20, 21)  # the operator's correlation id
    other = _event(4, "aten::mm", 70, 80)
    for event, (name, us) in (
        (op, ("_scatter_matmul_kernel", 10)),
        (overhead, ("_scatter_matmul_kernel", 10)),
    ):
        event.append_kernel(name, 0, us)
    other.append_kernel("gemm", 0, 5)
    events = [step, op, overhead, other]
    EventList(events)._build_tree()
    found, _ = profile.units(events, "cuda")
    assert sorted((u.name, u.op, u.us) for u in found) == [
        ("_scatter_matmul_kernel", profile.EXPERT_BACKWARD_OP, 10),
        ("gemm", "aten::mm", 5),
    ]


def test_the_profiler_s_one_cycle_warning_is_no_error_here():
    """The suite turns warnings into errors; torch 2.11's notice that a profiler clears events at each cycle (seen
    on an H200 as speed counted operators) says nothing about one-cycle profiles and must not fail a GPU run."""
    import warnings

    warnings.warn(
        "Warning: Profiler clears events at the end of each cycle.Only events from the current cycle will be "
        "reported.To keep events across cycles, set acc_events=True.",
        UserWarning,
        stacklevel=1,
    )
    with pytest.raises(UserWarning):  # any other warning still fails
        warnings.warn("another warning", UserWarning, stacklevel=1)


def test_fit_from_halves_the_batch_until_every_preset_s_step_fits(monkeypatch):
    """--fit-from N: the largest of N, N/2, ... at which the estimate and a real step of every preset pass."""
    tried = []

    def estimate(preset, batch, scope, device, dtype):
        tried.append((preset, batch))
        return "too large" if batch > 16 else None

    monkeypatch.setattr(benches, "too_large", estimate)
    monkeypatch.setattr(benches, "model_benches", lambda *args: [SimpleNamespace(run=lambda: None)])
    presets = ["tiny-transformer", "tiny-switchhead"]
    assert profile.default_batch(presets, "cpu", torch.float32, fit_from=64) == 16
    assert [b for _, b in tried] == [64, 32, 16, 16] and profile.default_batch(
        presets, "cpu", torch.float32
    ) == 2


@pytest.mark.slow  # times a profiled step
def test_a_fitted_batch_is_recorded_with_where_it_started(tmp_path, capsys):
    assert main(_one_tiny_step("--fit-from", "4", "--out", str(tmp_path), "--json")) == 0
    metadata = json.loads(capsys.readouterr().out)["metadata"]
    assert metadata["batch"] == 4 and metadata["fit_from"] == 4


def test_autograd_summing_two_readers_gradients_is_the_same_share_in_every_family():
    """Where two operators read a layer's input, autograd adds their gradients inside the node's range but outside
    its call. That addition is the same work in dense and SwitchHead, and lands in the same share: it took the MoE
    layer's role in SwitchHead, and so the routing share (an H200 profile put one kernel of 2.2 ms in routing there
    and in norms for dense)."""

    def summed(preset: str) -> set[str]:
        step = {b.what: b for b in model_benches(preset, 1, "cpu", torch.float32)}["train step"]
        step.run()
        labels = profile._Labels(profile.module_roles(step.module))
        with labels, torch.profiler.profile() as prof, torch.profiler.record_function(profile.STEP_LABEL):
            step.run()
        found, _ = profile.units(list(prof.events()), "cpu")
        return {
            profile.share(u)
            for u in found
            if u.op == "aten::add" and u.context[-2].startswith(f"{profile.BACKWARD_NODE}: CatBackward0")
        }

    assert summed("tiny-transformer") == summed("tiny-switchhead") == {"norms and elementwise"}


def test_the_committed_gpu_profiles_count_each_step_once():
    """The shares of every committed GPU profile add up to its step, and that step is no longer than the host's
    clock around it (until 2026-11-29 the step counted its label's device annotation too: a forward twice)."""
    root = Path(__file__).resolve().parents[1] / "results" / "profile"
    runs = [json.loads(p.read_text()) for p in sorted(root.glob("*/*.json"))]
    steps = collections.defaultdict(list)
    for index, run in enumerate(r for r in runs if "cuda" in r["metadata"]):
        for row in run["rows"]:
            steps[(index, row["preset"], row["what"])].append(row)
    assert steps
    for rows in steps.values():
        step = rows[0]["ms_profiled"]
        assert step <= rows[0]["ms_wall"] * (1 + 1e-12)
        kernels = sum(r["ms"] for r in rows if r["kind"] == "share" and r["name"] != "outside kernels")
        shares = sum(r["ms"] for r in rows if r["kind"] == "share")
        assert shares == pytest.approx(max(step, kernels), rel=1e-9)
        assert sum(r["fraction"] for r in rows if r["kind"] == "share") == pytest.approx(1.0)
