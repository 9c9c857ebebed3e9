"""The kernel benchmark's cases, correctness gate and result files (on the CPU; timings mean nothing here)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from switchbench.bench.kernels import bench as kernels
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


def test_an_op_faster_than_its_dense_comparator_is_marked():
    """MoA's 262M query projection ran at 145% of the dense matmul of its shape on an H200, printed as a plain
    finding: an op doing the same MACs faster than dense says the comparator ran below its peak."""
    assert (
        kernels._against(1.45) == "145% !"
        and kernels._against(0.58) == "58%"
        and kernels._against(None) == ""
    )


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
    case = kernels.Case(
        "tiny",
        tokens=20,
        in_groups=2,
        slots=4,
        out_groups=1,
        experts_per_group=3,
        groups=2,
        d_in=24,
        d_out=20,
        gated=True,
    )
    rows = kernels.measure(case, "triton", "cpu", torch.float32)
    assert [r["pass"] for r in rows] == ["forward", "forward+backward"]
    assert all(r["max_rel_error"] < 1e-5 and r["ms"] > 0 for r in rows)
    assert rows[1]["tflops"] == pytest.approx(2 * 3 * case.macs / rows[1]["ms"] / 1e9)


def _replaced(name: str, run) -> dict:
    """PEERS with ``name`` timing ``run`` instead."""
    return dict(kernels.PEERS, **{name: dataclasses.replace(kernels.PEERS[name], run=run)})


def _scaled(name: str, factor: float):
    run = kernels.PEERS[name].run
    return lambda c, i: factor * run(c, i)


def test_a_wrong_kernel_is_not_timed(monkeypatch):
    case = kernels.Case("tiny", 8, 1, 2, 1, 3, 1, 16, 16, True)
    monkeypatch.setattr(kernels, "PEERS", _replaced("triton", _scaled("torch", 1.01)))
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
    assert {r["impl"] for r in saved["rows"]} == {
        "routing",
        "top-k",
        "routing (count)",  # the other method beside the one in force (Triton's off a GPU is not timed)
        "top-k (count)",
        "torch",
        "grouped_mm",
        "all_experts",
        "loop",
        "torch-kernel",
        "grouped_mm-kernel",
        "dense",
        "dense projection",
    }
    assert len(list(tmp_path.glob("*.csv"))) == 2
    assert not list(tmp_path.glob(".*.tmp"))


TINY = kernels.Case(
    "tiny",
    tokens=9,
    in_groups=2,
    slots=4,
    out_groups=1,
    experts_per_group=3,
    groups=2,
    d_in=24,
    d_out=20,
    gated=True,
)  # unaligned widths; an expert without tokens (k=2 of 3)


@pytest.mark.parametrize(
    "error", ["CUDA error: operation failed due to a previous error during capture", "CUDA out of memory"]
)
@pytest.mark.parametrize(
    "timed",
    [
        lambda graphs: kernels.measure(TINY, "all_experts", "cpu", torch.float32, graphs=graphs),
        lambda graphs: kernels.routing_rows(TINY, "cpu", torch.float32, graphs=graphs),
    ],
    ids=["op", "routing"],
)
def test_a_capture_that_fails_is_its_row_s_reason_and_out_of_memory_still_raises(timed, error, monkeypatch):
    """On an H200, torch 2.11 ended one implementation's capture with an error host_wait had not foreseen, and
    kernel-tune lost every row: that implementation (or routing) is now an uncapturable row saying why. Out of
    memory is a result the callers record (an OOM row), not a reason."""

    def failing(device, graphs=False):
        def ms(fn, grad_to_none=()):
            raise RuntimeError(error)

        return ms

    monkeypatch.setattr(kernels, "timer", failing)
    monkeypatch.setattr(kernels, "host_wait", lambda call: None)  # no sync seen: capturable, by that check
    if "memory" in error:
        with pytest.raises(RuntimeError, match="out of memory"):
            timed(True)
        return
    rows = timed(True)
    assert [(r["pass"], r["status"], r["reason"]) for r in rows] == [
        (p, "uncapturable", error) for p in kernels.PASSES
    ]
    with pytest.raises(RuntimeError, match="during capture"):  # no graphs: nothing was captured, a bug
        timed(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_timed_call_matches_its_float64_loop_in_output_and_every_gradient(dtype):
    """The whole op of each implementation (and the loop peer) and each kernel alone, off a GPU."""
    for impl in kernels.default_impls("cpu"):
        if impl in kernels.DENSE:
            continue
        inputs = kernels.make_inputs(TINY, "cpu", dtype)
        got, exact = kernels.outputs(TINY, inputs, impl), kernels.reference(TINY, inputs, impl)
        view = kernels.PEERS[impl].view
        expected = {"grad_x", "grad_weight", "grad_scores"} if view == "op" else {"grad_weight_aligned"}
        assert expected < set(got) and set(got) == set(exact), impl
        assert all(ref.dtype == torch.float32 for ref in exact.values())  # float64 loop, compared as fp32
        for name in got:
            scale = exact[name].abs().max()
            tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(
                got[name] / scale, exact[name] / scale, rtol=0, atol=tol, msg=f"{impl} {name}"
            )


def test_unaligned_widths_are_padded_not_refused(monkeypatch):
    """d_in 146 (262M MoA's d_head): grouped_mm pads to 16-byte rows. It is skipped only on a torch without it."""
    case = kernels.Case("odd", 8, 1, 2, 1, 3, 1, 146, 32, True)
    rows = kernels.measure(case, "grouped_mm", "cpu", torch.bfloat16)
    assert [r["status"] for r in rows] == ["ok", "ok"] and rows[0]["max_rel_error"] < 3e-2
    monkeypatch.setattr(
        kernels.expert_matmul_grouped, "unavailable", lambda *groups: "torch 2.3 has no grouped_mm"
    )
    assert all(
        r["skipped"] == "torch 2.3 has no grouped_mm"
        for r in kernels.measure(case, "grouped_mm-kernel", "cpu", torch.bfloat16)
    )


def test_a_kernel_wrong_only_in_its_gradients_is_not_timed(monkeypatch):
    def wrong_backward(case, inputs):
        y = kernels.PEERS["torch"].run(case, inputs)
        return y + 0.01 * (y - y.detach())  # the same output, gradients 1% too large

    case = kernels.Case("tiny", 8, 1, 2, 1, 3, 1, 16, 16, True)
    monkeypatch.setattr(kernels, "PEERS", _replaced("loop", wrong_backward))
    rows = kernels.measure(case, "loop", "cpu", torch.float32)
    assert {r["status"] for r in rows} == {"wrong"} and "grad_x relative error" in rows[0]["error"]


def test_a_wrong_row_is_recorded_and_the_command_exits_1(tmp_path, monkeypatch, capsys):
    """A failed check is a row and the sweep goes on (on an H100 it was a traceback and no file); exit 1."""
    monkeypatch.setattr(kernels, "PEERS", _replaced("loop", _scaled("torch", 1.01)))
    monkeypatch.setattr(kernels, "default_impls", lambda device, choice: ["loop", "dense"])
    monkeypatch.setattr(
        kernels, "cases", lambda size, batch: [kernels.Case("tiny", 8, 1, 2, 1, 3, 1, 16, 16, True)]
    )
    argv = _cli(tmp_path)
    assert main(argv) == 1
    captured = capsys.readouterr()
    rows = json.loads(Path(json.loads(captured.out)["saved"]).read_text())["rows"]
    assert {(r["impl"], r["status"]) for r in rows} == {
        ("routing", "ok"),
        ("top-k", "ok"),
        ("routing (count)", "ok"),
        ("top-k (count)", "ok"),
        ("loop", "wrong"),
        ("dense", "ok"),
    }
    assert captured.err.strip().startswith(
        "switchbench kernel-bench: loop on tiny is wrong: out relative error"
    )


def test_a_kernel_that_returns_nan_is_a_wrong_row_in_strict_json(tmp_path, monkeypatch, capsys):
    """NaN or infinity in an output is the worst error there is: a "wrong" row, saved as strict JSON (which has
    no NaN), not a crash when the run is written."""
    monkeypatch.setattr(kernels, "PEERS", _replaced("loop", _scaled("torch", float("nan"))))
    monkeypatch.setattr(kernels, "default_impls", lambda device, choice: ["loop", "dense"])
    monkeypatch.setattr(
        kernels, "cases", lambda size, batch: [kernels.Case("tiny", 8, 1, 2, 1, 3, 1, 16, 16, True)]
    )
    assert main(_cli(tmp_path)) == 1
    captured = capsys.readouterr()
    rows = json.loads(Path(json.loads(captured.out)["saved"]).read_text())["rows"]
    wrong = [r for r in rows if r["impl"] == "loop"]
    assert [r["status"] for r in wrong] == ["wrong", "wrong"] and "relative error nan" in wrong[0]["error"]
    assert all(r["max_rel_error"] is None for r in wrong)


def test_a_batch_no_case_fits_is_refused_before_it_starts(tmp_path, capsys, monkeypatch):
    """--batch 10000000 on the CPU used to be killed by the system at about 24 GB, with no message and no file;
    then it wrote a file of OOM rows and exited 1. Now nothing is built or written: one line, exit 2."""
    monkeypatch.setattr(kernels, "free_memory", lambda device: 2**30)
    smallest = min(kernels.estimated_bytes(case) for case in kernels.cases("47m", 10000000))
    argv = [
        "kernel-bench",
        "--sizes",
        "47m",
        "--batch",
        "10000000",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        "switchbench kernel-bench: error: no case fits the 1.0 GiB free: the smallest, 47m expert-sized, needs at "
        f"least {smallest / 2**30:.1f} GiB"
    ]
    assert not (tmp_path / "o").exists()


def test_the_memory_estimate_is_a_lower_bound_of_the_inputs():
    case = kernels.Case(
        "tiny",
        tokens=9,
        in_groups=2,
        slots=4,
        out_groups=1,
        experts_per_group=3,
        groups=2,
        d_in=24,
        d_out=16,
        gated=True,
    )
    inputs = kernels.make_inputs(case, "cpu", torch.float32)
    held = (
        sum(inputs[k].numel() for k in ("x", "weight", "scores", "rows", "projection_rows", "projection")) * 4
    )
    assert held <= kernels.estimated_bytes(case) <= held + 4 * 9 * 4 * 16  # plus one output row per slot


@pytest.mark.parametrize("size", ["47m", "262m"])
def test_the_dense_projection_does_the_useful_macs_reading_and_writing_each_row_once(size):
    """The MoE overhead's comparator, as a dense model's projection: a 262M SwitchHead token's row read once for all
    8 slots' 112 outputs, not once a slot (a [N S, 1024] @ [1024, 112] product is memory-bound)."""
    for case in kernels.cases(size, 2):
        m, k, n = case.projection_shape
        assert m * k * n == case.macs, case.name
        if case.in_groups <= case.out_groups:  # each input row read once
            assert (m, k) == (case.tokens * case.in_groups, case.d_in), case.name
        else:  # each output row written once
            assert (m, n) == (case.tokens * case.out_groups, case.d_out), case.name
    by_name = {c.name: c for c in kernels.cases("262m", 2)}
    # 2 sequences of 512 tokens, 1024 keys and values (XL's memory), 4 heads x k=2 slots of 112 channels
    assert by_name["262m switchhead-v"].projection_shape == (2048, 1024, 8 * 112)
    assert by_name["262m switchhead-o"].projection_shape == (1024, 8 * 112, 1024)


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
    rows = kernels.measure(TINY, "grouped_mm-kernel", "cpu", torch.bfloat16)
    assert [r["status"] for r in rows] == ["ok", "ok"] and rows[0]["max_rel_error"] < 1e-2
    got = kernels.outputs(TINY, kernels.make_inputs(TINY, "cpu", torch.bfloat16), "grouped_mm-kernel")
    assert set(got) == {"out", "grad_sorted", "grad_weight_aligned"} and got["out"].shape == (9 * 4, 32)
    monkeypatch.setattr(kernels, "PEERS", _replaced("grouped_mm-kernel", _scaled("grouped_mm-kernel", 1.05)))
    assert {r["status"] for r in kernels.measure(TINY, "grouped_mm-kernel", "cpu", torch.bfloat16)} == {
        "wrong"
    }


def test_a_peak_below_the_runs_dense_matmuls_gives_way_to_the_fastest(tmp_path, monkeypatch, capsys):
    """bf16 on a CPU without its support ran its square products slower than the cases' thin dense matmuls, and
    dense rows showed 158 to 444% "of peak". A dense matmul is what the peak measures: the fastest one of the run is
    then the yardstick, named in the metadata, and no dense row is above it."""
    monkeypatch.setattr(kernels, "cases", lambda size, batch: [TINY])
    monkeypatch.setattr(kernels, "matmul_peak_tflops", lambda device, dtype: 1e-12)
    assert main([*_cli(tmp_path)[:-1], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    dense = [r for r in out["rows"] if r["impl"] in kernels.DENSE]
    fastest = max(r["tflops"] for r in dense)
    assert out["metadata"]["matmul_peak_tflops"] == fastest
    assert out["metadata"]["matmul_peak_source"].startswith(f"dense {TINY.name} ")
    assert max(r["fraction_of_matmul_peak"] for r in dense) == 1.0
    assert all(
        r["fraction_of_matmul_peak"] == pytest.approx(r["tflops"] / fastest)
        for r in out["rows"]
        if "tflops" in r
    )


def test_op_and_kernel_rows_with_their_fractions_and_the_choice(tmp_path, monkeypatch, capsys):
    """For every implementation the whole op and the kernel alone, forward and forward+backward, each with its
    fraction of the dense matmul and of the measured peak; the choice recorded, and marked on the rows it picks."""
    monkeypatch.setattr(kernels, "cases", lambda size, batch: [TINY])
    monkeypatch.setattr(kernels, "matmul_peak_tflops", lambda device, dtype: 1e3)
    assert main([*_cli(tmp_path)[:-1], "--dtype", "bf16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(r["impl"], r["pass"]): r for r in out["rows"]}
    for impl in ("torch", "grouped_mm", "loop", "torch-kernel", "grouped_mm-kernel", *kernels.DENSE):
        for what in kernels.PASSES:
            r = rows[impl, what]
            assert r["status"] == "ok" and r["fraction_of_matmul_peak"] == pytest.approx(r["tflops"] / 1e3)
            assert r["vs_dense"] > 0 and r["vs_projection"] > 0
            assert impl in kernels.DENSE or r["max_rel_error"] < 3e-2
            projection = rows["dense projection", what]["ms"]
            assert r["vs_projection"] == pytest.approx(projection / r["ms"])
    assert [impl for (impl, what), r in rows.items() if r["chosen"]] == ["torch", "torch"]  # auto falls back
    # the MoE overhead: routing plus the chosen op, less the dense projection, as timed in this run
    for what in kernels.PASSES:
        routing, chosen, dense = (rows[impl, what] for impl in ("routing", "torch", "dense projection"))
        assert routing["view"] == "routing" and routing["method"] == "sort" and routing["vs_dense"] is None
        assert chosen["routing_ms"] == routing["ms"] == rows["routing", "forward"]["ms"]
        assert chosen["moe_overhead_ms"] == pytest.approx(routing["ms"] + chosen["ms"] - dense["ms"])
        assert "moe_overhead_ms" not in rows["grouped_mm", what]
    metadata = out["metadata"]
    assert metadata["expert_matmul"] == "auto" and "fell back" in metadata["expert_matmul_by_case"]["tiny"]
    assert main([*_cli(tmp_path)[:-1], "--dtype", "bf16", "--expert-matmul", "grouped_mm"]) == 0
    printed = capsys.readouterr().out
    assert "grouped_mm *" in printed and "torch" not in printed.split("\n", 1)[1]


def test_the_choice_is_checked_where_it_is_given(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        kernels.expert_matmul_grouped, "unavailable", lambda *groups: "torch 2.3 has no grouped_mm"
    )
    assert main([*_cli(tmp_path), "--expert-matmul", "grouped_mm"]) == 2
    assert "--expert-matmul grouped_mm: torch 2.3 has no grouped_mm" in capsys.readouterr().err


@pytest.mark.parametrize("groups, experts, k", [(3, 4, 2), (1, 6, 3), (2, 5, 1)])
def test_the_timed_routing_groups_each_tokens_top_k_of_each_group_by_expert(groups, experts, k):
    """kernel-bench's routing against a loop: each token's k largest logits in each group, on the flat expert axis
    (group g's experts after the g earlier groups'), its slots listed expert by expert in their flat order."""
    case = dataclasses.replace(
        TINY, tokens=7, in_groups=1, slots=groups * k, groups=groups, experts_per_group=experts
    )
    logits = kernels.router_logits(case, "cpu", torch.float32)
    routing = kernels._routing(case, logits)
    for n in range(case.tokens):
        for g in range(groups):
            ranked = sorted(range(experts), key=lambda e: -float(logits[n, g, e]))[:k]
            assert sorted(int(e) for e in routing.indices[n, g * k : (g + 1) * k]) == sorted(
                g * experts + e for e in ranked
            )
    flat = routing.indices.flatten().tolist()
    expected = sorted(range(len(flat)), key=lambda slot: (flat[slot], slot))
    assert routing.order.tolist() == expected
    counts = [flat.count(e) for e in range(groups * experts)]
    assert routing.offsets.tolist() == [sum(counts[:e]) for e in range(groups * experts + 1)]


def test_the_moe_overhead_counts_the_share_of_routing_its_op_reads():
    """A routed implementation pays for the top-k and the grouping of the slots, all_experts for the top-k alone;
    two projections driven by one router (``shared_by``) pay half of its routing each."""

    def row(case, impl, ms, view="op", **more):
        shape = {"shape_groups": 2, "shape_experts_per_group": 4, "shape_shared_by": 2 if case == "c" else 1}
        shape |= {"shape_tokens": 64}
        return {"case": case, "pass": "forward", "impl": impl, "view": view, "ms": ms} | shape | more

    rows = [
        *(row(case, "routing", 3.0, "routing", routing="routing") for case in "abc"),
        *(row(case, "top-k", 1.0, "routing", routing="top-k") for case in "abc"),
        *(row(case, "routing (count)", 0.1, "routing", routing="routing") for case in "abc"),  # not in force
        *(
            row(case, "dense", 99.0, "dense") for case in "abc"
        ),  # the op's shape: not the overhead's comparator
        *(row(case, "dense projection", 10.0, "projection") for case in "abc"),
        row("a", "triton", 12.0, chosen=True),
        row("b", "all_experts", 12.0, chosen=True),
        row("c", "triton", 12.0, chosen=True),
    ]
    kernels.moe_overhead(rows)
    routed, dense_all, shared = rows[-3:]
    assert (routed["routing_ms"], routed["moe_overhead_ms"]) == (3.0, 5.0)
    assert (dense_all["routing_ms"], dense_all["moe_overhead_ms"]) == (1.0, 3.0)
    assert (shared["routing_ms"], shared["moe_overhead_ms"]) == (1.5, 3.5)


@pytest.mark.parametrize("method", ["count", pytest.param("triton", marks=pytest.mark.slow)])  # interpreted
def test_the_routing_flag_is_in_force_and_recorded(method, tmp_path, monkeypatch, capsys):
    """--routing count (or triton): the timed routing ranks and groups by counting, and the run says so; the other
    methods are timed beside it, each row named by its method."""
    monkeypatch.delenv("SWITCHBENCH_ROUTING", raising=False)
    monkeypatch.setattr(kernels, "cases", lambda size, batch: [TINY])
    monkeypatch.setattr(kernels, "default_impls", lambda device, choice="auto": ["torch", "dense"])
    argv = _cli(tmp_path)
    if method == "triton" and torch.cuda.is_available():  # Triton runs on the CPU in its interpreter alone
        argv[argv.index("--device") + 1] = "cuda"
    assert main([*argv, "--routing", method]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["metadata"]["routing"] == out["metadata"]["routing_resolved"] == method
    routings = {r["impl"]: r["method"] for r in out["rows"] if r["view"] == "routing"}
    assert {routings["routing"], routings["top-k"]} == {method}  # the ones an op's routing share reads
    # and every other method this device times, beside it
    others = {
        m for m in ("sort", "count", "triton") if m != method and (m != "triton" or torch.cuda.is_available())
    }
    assert {impl: m for impl, m in routings.items() if "(" in impl} == {
        f"{name} ({m})": m for m in others for name in ("routing", "top-k")
    }


def test_a_bad_routing_in_the_environment_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("SWITCHBENCH_ROUTING", "radix")
    assert main(["presets"]) == 2
    err = capsys.readouterr().err
    assert "SWITCHBENCH_ROUTING: the routing must be one of auto, sort, count, triton; got 'radix'" in err
    assert len(err.strip().splitlines()) == 1


def test_cuda_graphs_need_a_cuda_device(tmp_path, capsys):
    assert main([*_cli(tmp_path), "--cuda-graphs"]) == 2
    assert "--cuda-graphs needs a CUDA device" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_each_call_replayed_from_a_cuda_graph_or_found_waiting_on_the_host(tmp_path, monkeypatch, capsys):
    """With --cuda-graphs the host-free calls are timed from a graph; the PyTorch op (its capacity read back) and the
    loop (its expert ends read back) cannot be captured, and say why instead of failing the run."""
    monkeypatch.setattr(kernels, "cases", lambda size, batch: [TINY])
    argv = ["kernel-bench", "--sizes", "47m", "--dtype", "bf16", "--device", "cuda", "--out", str(tmp_path)]
    assert main([*argv, "--cuda-graphs", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(r["impl"], r["pass"]): r for r in out["rows"]}
    assert out["metadata"]["cuda_graphs"] and out["saved"].endswith("-graphs.json")
    for what in kernels.PASSES:
        for impl in ("torch", "loop"):
            assert rows[impl, what]["status"] == "uncapturable" and rows[impl, what]["reason"]
        for impl in ("triton", "grouped_mm", "all_experts", "triton-kernel", "dense", "routing", "top-k"):
            assert rows[impl, what]["status"] == "ok" and rows[impl, what]["ms"] > 0
