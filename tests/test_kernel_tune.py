"""kernel-tune's table for ``--expert-matmul auto``, written from synthetic timings (timing needs a GPU)."""

import json
from pathlib import Path

import pytest
import torch

from switchbench.bench.kernels import tune as kernel_tune
from switchbench.bench.kernels.bench import case_rows
from switchbench.cli import main
from switchbench.ops import tuned as tuning
from switchbench.ops.expert_matmul import choice
from switchbench.ops.expert_matmul.cases import Case

BIG, SMALL = "65536x1024x112 8of16 bfloat16 gates", "8192x412x76 6of10 bfloat16 gates"


def _row(
    bucket, case, impl, ms=None, what="forward+backward", status="ok", view="op", experts=1, shared_by=1
):
    row = {"bucket": bucket, "case": case, "impl": impl, "pass": what, "status": status, "view": view}
    shape = {
        "shape_tokens": 64,
        "shape_groups": 1,
        "shape_experts_per_group": experts,
        "shape_shared_by": shared_by,
    }
    return row | shape | ({"ms": ms} if ms is not None else {})


def _routed(case, impl, ms, view="op", shared_by=1):
    return _row(BIG, case, impl, ms, view=view, experts=4, shared_by=shared_by)


def _routing(case, name, method, ms, what="forward+backward", tokens=64, in_force="sort"):
    """A routing row as kernel-bench names it: by its routing alone for the method in force, else with its method."""
    row = _routed(case, name if method == in_force else f"{name} ({method})", ms, "routing")
    return row | {"routing": name, "method": method, "pass": what, "shape_tokens": tokens}


def test_the_fastest_implementation_timed_on_every_case_of_its_bucket():
    rows = [
        _row(BIG, "v b32", "torch", 9.0),
        _row(BIG, "v b64", "torch", 18.0),
        _row(BIG, "v b32", "grouped_mm", 4.0),
        _row(BIG, "v b64", "grouped_mm", 8.0),
        _row(BIG, "v b32", "triton", 1.0),
        _row(BIG, "v b64", "triton", status="wrong"),  # ruled out
        _row(BIG, "v b32", "triton", 0.1, what="forward"),  # forward alone decides nothing
        _row(SMALL, "o b8", "torch", status="OOM"),
        _row(SMALL, "o b8", "triton", status="skipped"),
    ]
    table = kernel_tune.fastest(rows)
    assert table == {"choices": {BIG: "grouped_mm"}, "ms": {BIG: {"torch": 27.0, "grouped_mm": 12.0}}}


def test_one_case_at_two_batches_in_one_bucket_counts_as_two():
    """kernel-tune times each case at several batches, whose slot counts may round to one bucket: an implementation
    wrong at one of them is ruled out, not summed over fewer cases than its rivals."""
    rows = [
        _row(BIG, "v", "triton", 2.0) | {"shape_tokens": 32},
        _row(BIG, "v", "triton", 4.0) | {"shape_tokens": 64},
        _row(BIG, "v", "all_experts", 3.0) | {"shape_tokens": 32},
        _row(BIG, "v", "all_experts", status="wrong") | {"shape_tokens": 64},
    ]
    assert kernel_tune.fastest(rows) == {"choices": {BIG: "triton"}, "ms": {BIG: {"triton": 6.0}}}


def test_each_time_counts_the_share_of_routing_its_implementation_reads():
    """A routed implementation pays for the top-k and the grouping of the slots, all_experts for the top-k alone;
    a router's routing is split between the projections it drives. Here all_experts is slower op to op (5 ms
    against 4) and faster with the routing (5 + 1/2 against 4 + 4/2 on the shared case, 5 + 1 against 4 + 4)."""
    for shared_by, winner in ((1, "all_experts"), (2, "all_experts"), (8, "triton")):
        rows = [
            _routing("v", "routing", "sort", 4.0) | {"shape_shared_by": shared_by},
            _routing("v", "top-k", "sort", 1.0) | {"shape_shared_by": shared_by},
            _routed("v", "triton", 4.0, shared_by=shared_by),
            _routed("v", "all_experts", 5.0, shared_by=shared_by),
        ]
        table = kernel_tune.fastest(rows)
        expected = {"triton": 4.0 + 4.0 / shared_by, "all_experts": 5.0 + 1.0 / shared_by}
        assert table == {"choices": {BIG: winner}, "ms": {BIG: expected}}
    # a case with one expert routes nothing; a routed case whose routing was not timed counts for no one
    rows = [_row(BIG, "one", "triton", 1.0), _row(BIG, "one", "all_experts", 2.0)]
    assert kernel_tune.fastest(rows)["ms"] == {BIG: {"triton": 1.0, "all_experts": 2.0}}
    assert kernel_tune.fastest([_routed("v", "triton", 1.0)]) == {"choices": {}, "ms": {}}


def test_the_fastest_routing_is_timed_on_every_case_and_its_times_are_the_shares():
    """The method whose routings (each case's top-k and grouping, and top-k alone, at each batch, once: they have
    no backward) sum to least, among those timed on all; the implementations' shares are then that method's."""
    rows = [
        _routing("v", name, method, base * scale * tokens / 64, what, tokens)
        for name, base in (("routing", 4.0), ("top-k", 1.0))
        for method, scale in (("sort", 1.0), ("count", 0.5), ("triton", 0.25))
        for tokens in (64, 128)
        for what in ("forward", "forward+backward")
        if not (method == "triton" and tokens == 128 and name == "top-k")  # one routing untimed: ruled out
    ]
    rows += [_routed("v", "triton", 4.0), _routed("v", "all_experts", 5.0)]
    table = kernel_tune.fastest(rows)
    assert table["routing"] == "count" and table["routing_ms"] == pytest.approx({"sort": 15.0, "count": 7.5})
    # the ops' shares: the count's routing at 64 tokens (2.0) and top-k (0.5), the rows' batch
    assert table["ms"] == {BIG: pytest.approx({"triton": 6.0, "all_experts": 5.5})}
    assert "routing" not in kernel_tune.fastest(
        [_routed("v", "triton", 4.0)]
    )  # nothing routed, nothing chosen


def test_the_rows_kernel_tune_times_make_a_table(monkeypatch):
    """Its timings as they are made (here on the CPU, which has no Triton): each implementation's op and the case's
    two routings, and a table whose sums are each op's time plus the routing it reads, split by ``shared_by``."""
    case = Case("v", 16, 1, 4, 2, 3, 2, 8, 8, True, shared_by=2)
    monkeypatch.setattr(kernel_tune, "tuned_cases", lambda size, batch: [case])
    monkeypatch.setattr(kernel_tune, "TIMED_IMPLS", ("torch", "all_experts"))
    # on a GPU each call is replayed from a CUDA graph; the CPU times it eagerly
    on_cpu = lambda case, device, dtype, impls, graphs: case_rows(case, "cpu", dtype, impls)  # noqa: E731
    monkeypatch.setattr(kernel_tune, "case_rows", on_cpu)
    rows = kernel_tune.time_implementations(["47m"], [1], torch.float32)
    ms = {(r["impl"], r["pass"]): r["ms"] for r in rows}
    table = kernel_tune.fastest(rows)
    (bucket,) = table["ms"]
    routing = {"torch": ms["routing", "forward+backward"], "all_experts": ms["top-k", "forward+backward"]}
    expected = {impl: ms[impl, "forward+backward"] + routing[impl] / 2 for impl in routing}
    assert table["ms"][bucket] == pytest.approx(expected)
    assert table["choices"] == {bucket: min(expected, key=expected.get)}


def test_the_written_table_is_what_auto_reads(tmp_path, monkeypatch):
    table = kernel_tune.fastest([_row(BIG, "v", "torch", 3.0), _row(BIG, "v", "triton", 2.0)])
    before = {"about": "kept", "tables": [{"device": "NVIDIA A100-SXM4-80GB", "choices": {BIG: "torch"}}]}
    written = kernel_tune.merged(before, "NVIDIA H100 80GB HBM3", table)
    path = tmp_path / "auto.json"
    path.write_text(json.dumps(written))
    devices = [t["device"] for t in written["tables"]]
    assert written["about"] == "kept" and devices == ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"]
    monkeypatch.setattr(choice, "auto_tables", lambda: tuple(json.loads(path.read_text())["tables"]))
    monkeypatch.setattr(choice, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert choice.lookup(torch.device("cuda", 0), BIG, "auto") == choice.Resolution("triton", "measured")
    assert choice.lookup(torch.device("cuda", 0), SMALL, "auto").reason == "fallback"


def test_auto_routes_by_the_method_measured_fastest_on_this_gpu(monkeypatch):
    from switchbench.bench.command import kernel_metadata
    from switchbench.ops.expert_matmul.op import ENV_ROUTING, routing_method, routing_selected

    monkeypatch.delenv(ENV_ROUTING, raising=False)
    tables = ({"device": H100, "choices": {}, "routing": "triton"}, {"device": A100, "choices": {}})
    monkeypatch.setattr(choice, "auto_tables", lambda: tables)
    # where no routing was timed, the sort
    for gpu, method in ((H100, "triton"), (A100, "sort"), ("NVIDIA B200", "sort")):
        monkeypatch.setattr(choice, "device_name", lambda device, gpu=gpu: gpu)
        with routing_selected("auto"):
            assert routing_method("cuda") == method
            assert kernel_metadata("auto", "cuda")["routing_resolved"] == method  # what a run records
        with routing_selected("count"):
            assert routing_method("cuda") == "count"


def test_the_package_tables_are_where_the_models_read_them():
    from importlib.resources import files

    data = files("switchbench.ops.expert_matmul") / "data"
    assert kernel_tune.AUTO_TABLE.resolve() == Path(str(data / choice.AUTO_FILE)).resolve()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_kernel_tune_needs_a_gpu(capsys):
    assert main(["kernel-tune"]) == 2
    assert "autotunes on a CUDA GPU" in capsys.readouterr().err


H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"


def test_a_run_that_measured_part_of_the_table_or_nothing_keeps_the_rest(tmp_path):
    """A re-run at one size, or one stopped between writing configurations and timing, replaces only what it
    measured: the shipped table is never emptied by a later, smaller run."""
    path = tmp_path / "tuned.json"
    first = {
        "scatter_matmul": {"a": "M64 N64 K64 w4 s4", "b": "M128 N64 K64 w4 s4"},
        "grouped_outer": {"c": "x"},
    }
    path.write_text(
        json.dumps({"about": "kept", "tables": [{"device": A100, "configs": {"scatter_matmul": {}}}]})
    )
    for configs in (first, {}, {"scatter_matmul": {"a": "M128 N128 K64 w8 s3"}}):  # all; nothing; one size
        kernel_tune._update(path, kernel_tune.read_tables(path), H100, {"configs": configs})
    tables = {t["device"]: t for t in json.loads(path.read_text())["tables"]}
    assert tables[H100]["configs"] == {
        "scatter_matmul": {"a": "M128 N128 K64 w8 s3", "b": "M128 N64 K64 w4 s4"},
        "grouped_outer": {"c": "x"},
    }
    assert tables[A100]["configs"] == {"scatter_matmul": {}}


@pytest.mark.parametrize(
    "content, says",
    [
        ("{bad", "not a readable table file"),
        ("[]", "the file must be an object"),
        ('{"tables": {}}', "the file: 'tables' must be a list"),
        ('{"tables": [{"configs": {}}]}', "table 0: 'device' must be text"),
    ],
)
@pytest.mark.parametrize("flag", ["--out", "--auto-out"])
def test_a_damaged_table_is_named_before_the_tuning(flag, content, says, tmp_path, monkeypatch, capsys):
    """Both tables are read before the GPU work: a damaged one failed after it, unnamed (or exit 3)."""
    monkeypatch.setattr(kernel_tune, "device_from_args", lambda device: "cuda")
    monkeypatch.setattr(kernel_tune, "tune", lambda *args: pytest.fail("tuned before reading the tables"))
    table = tmp_path / "table.json"
    table.write_text(content)
    argv = ["kernel-tune", "--out", str(tmp_path / "out.json"), "--auto-out", str(tmp_path / "auto.json")]
    argv[argv.index(flag) + 1] = str(table)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"switchbench kernel-tune: error: {table}: ") and says in err and err.count("\n") == 1
    )
    assert table.read_text() == content


def test_retuning_autotunes_shapes_the_table_already_holds(monkeypatch):
    """kernel-tune must autotune (and so record) every shape: a launch that read this GPU's table would record
    nothing, and the table written back would lose it."""
    triton_path = pytest.importorskip("switchbench.ops.expert_matmul.triton_kernels")
    saved = triton_path.CONFIGS["scatter_matmul"][0]
    key = "1024x64x64 bfloat16"
    table = {"device": "H100", "configs": {"scatter_matmul": {key: triton_path.config_label(saved)}}}
    monkeypatch.delenv(tuning.ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(tuning, "tables", lambda: (table,))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "H100")
    tuning.ahead_of_time.cache_clear()
    cuda = torch.device("cuda", 0)
    assert triton_path._config("scatter_matmul", key, cuda) is saved
    with tuning.retuning():
        assert triton_path._config("scatter_matmul", key, cuda) is None
    assert triton_path._config("scatter_matmul", key, cuda) is saved
    tuning.ahead_of_time.cache_clear()


def test_json_is_what_the_two_tables_now_hold_for_this_gpu(tmp_path, monkeypatch, capsys):
    """kernel-tune --json prints, alone on stdout, the configurations and auto's choices it wrote for this GPU
    (timing stood in for: it needs one), as the files then read back."""
    configs = {"scatter_matmul": {"1024x64x64 bfloat16": "M64 N64 K64 w4 s4"}}
    auto = {"choices": {"262m-v": "triton"}, "routing": "triton", "routing_ms": {"triton": 0.5, "sort": 1.5}}
    monkeypatch.setattr(kernel_tune, "device_from_args", lambda choice: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    monkeypatch.setattr(kernel_tune, "tune", lambda sizes, batches, dtype: configs)
    monkeypatch.setattr(kernel_tune, "time_implementations", lambda sizes, batches, dtype: [])
    monkeypatch.setattr(kernel_tune, "fastest", lambda rows, earlier: auto)
    out, auto_out = tmp_path / "tuned.json", tmp_path / "auto.json"
    assert main(["kernel-tune", "--json", "--out", str(out), "--auto-out", str(auto_out)]) == 0
    printed = json.loads(capsys.readouterr().out)

    def this_gpu(path):
        return next(t for t in json.loads(path.read_text())["tables"] if t["device"] == H100)

    assert printed["device"] == H100 and printed["configs"] == this_gpu(out)["configs"] == configs
    assert printed["auto"].items() <= this_gpu(auto_out).items() and printed["auto"]["routing"] == "triton"
    assert (printed["out"], printed["auto_out"]) == (str(out), str(auto_out))


def test_a_run_per_size_ranks_the_routings_of_every_size():
    """The chain tunes 47M, then 262M, in two runs: the second ranks the routings over both sizes' cases, the first
    run's kept in the table, not over its own alone (count wins at 47M by 4 ms, sort at 262M by 0.1: count)."""
    small = [_routing("47m v", "routing", m, ms, "forward") for m, ms in (("count", 1.0), ("sort", 5.0))]
    first = kernel_tune.fastest(small)
    assert first["routing"] == "count"
    large = [_routing("262m v", "routing", m, ms, "forward") for m, ms in (("count", 9.1), ("sort", 9.0))]
    assert kernel_tune.fastest(large)["routing"] == "sort"  # alone
    both = kernel_tune.fastest(large, first["routing_case_ms"])
    assert both["routing"] == "count" and both["routing_ms"] == pytest.approx({"count": 10.1, "sort": 14.0})


def test_every_expert_matmul_a_speed_group_trains_has_a_tuned_bucket():
    """kernel-tune times the cases of each size's speed group, its RoPE presets' too (other head widths: 64 at
    45M, 100 at 244M), so auto has a measured choice for every training step the chain times, not a fallback."""
    from switchbench.bench.cost import scaling
    from switchbench.models import family as registry
    from switchbench.models.presets import PRESETS

    for size, roles in scaling.SIZES.items():
        tuned = {choice.case_bucket(c, torch.bfloat16) for c in kernel_tune.tuned_cases(size, 8)}
        trained = {
            choice.case_bucket(c, torch.bfloat16)
            for family in registry.families()
            if family.expert_matmuls
            for role in roles
            if role in family.roles
            for c in family.expert_matmuls(PRESETS[family.roles[role]], 8)
        }
        assert trained <= tuned, sorted(trained - tuned)


def test_kernel_tune_says_which_implementation_was_wrong_and_exits_1(tmp_path, monkeypatch, capsys):
    """An implementation that fails its float64 check is left out of its bucket, and the run says so: exit 1 and a
    line naming it, the tables written (timing stood in for: it needs a GPU)."""
    wrong = {
        "status": "wrong",
        "impl": "grouped_mm",
        "case": "262m switchhead-v",
        "error": "relative error 3e-01",
    }
    monkeypatch.setattr(kernel_tune, "device_from_args", lambda choice: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    monkeypatch.setattr(kernel_tune, "tune", lambda sizes, batches, dtype: {})
    monkeypatch.setattr(kernel_tune, "time_implementations", lambda sizes, batches, dtype: [wrong])
    monkeypatch.setattr(kernel_tune, "fastest", lambda rows, earlier: {"choices": {}})
    out, auto_out = tmp_path / "tuned.json", tmp_path / "auto.json"
    assert main(["kernel-tune", "--out", str(out), "--auto-out", str(auto_out)]) == 1
    assert (
        "kernel-tune: grouped_mm on 262m switchhead-v is wrong: relative error 3e-01"
        in capsys.readouterr().err
    )
    assert out.exists() and auto_out.exists()


def test_one_file_for_both_tables_is_refused_before_the_tuning(tmp_path, monkeypatch, capsys):
    """--out and --auto-out naming one file: the second table's write would drop the first's configurations."""
    monkeypatch.setattr(kernel_tune, "device_from_args", lambda choice: "cuda")
    monkeypatch.setattr(kernel_tune, "tune", lambda *args: pytest.fail("tuned before the check"))
    both = str(tmp_path / "tables.json")
    assert main(["kernel-tune", "--out", both, "--auto-out", both]) == 2
    assert "--out and --auto-out both name" in capsys.readouterr().err
