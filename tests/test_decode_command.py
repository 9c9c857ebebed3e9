"""`switchbench decode`: every family's tiny presets, XL and RoPE, checked and then timed; cache sizes equal to a
hand count; floors, ratios and the largest batch from their definitions; bad input is one line and exit 2."""

import json
from pathlib import Path

import pytest
import torch

from switchbench.bench.command import slug
from switchbench.bench.inference import decode, sizing
from switchbench.bench.timing import speed
from switchbench.cli import main
from switchbench.core.environment import environment
from switchbench.models import family as registry
from switchbench.models.lm import LanguageModel, count_parameters
from switchbench.models.presets import PRESETS

FAST = ["--batches", "1", "2", "--contexts", "8", "--rounds", "2", "--warmup", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("decode")
    argv = ["decode", "--device", "cpu", *FAST, "--out", str(out), "--json"]
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(argv) == 0
    return json.loads(buffer.getvalue())


def hand_count(preset: str) -> int:
    """K and V numbers per token per layer, by family, times layers, times 4 bytes (fp32)."""
    cfg = PRESETS[preset]
    heads = {"gqa": lambda: cfg.opts.n_kv_heads, "moa": lambda: 1}.get(cfg.model, lambda: cfg.n_heads)()
    return 2 * heads * cfg.d_head * cfg.n_layers * 4


@pytest.mark.slow  # times every tiny preset (the fixture): 9 s
def test_every_tiny_preset_is_checked_timed_and_counted(run):
    rows = run["rows"]
    expected = {p for role in ("tiny", "tiny-rope") for p in registry.role_presets(role)}
    assert {r["preset"] for r in rows} == expected
    assert len(rows) == 2 * len(expected)  # two batches, one context
    for row in rows:
        assert row["status"] == "ok", row
        assert 0 <= row["max_abs_diff_vs_forward"] <= 1e-4
        assert row["kv_cache_bytes_per_token"] == row["kv_cache_bytes_per_token_measured"]
        assert row["kv_cache_bytes_per_token"] == hand_count(row["preset"])
        assert row["decode_ms"] > 0 and row["prefill_ms"] > 0 and row["decode_floor_ms"] > 0
        assert row["decode_tokens_per_s"] == pytest.approx(row["batch"] / row["decode_ms"] * 1e3)
        assert row["family"] == PRESETS[row["preset"]].family.label
        xl = PRESETS[row["preset"]].pos == "xl"
        assert (row["position_table_bytes"] > 0) == xl
        if xl:  # on the CPU XL computes its logits itself, every member alike: no mixed ratio
            assert row["attention_prefill"] == row["attention_decode"] == "explicit softmax"
            assert "attention_decode_mixed" not in row
    assert Path(run["saved"]).with_suffix(".csv").exists()


@pytest.mark.slow  # the timed run above
def test_ratios_stand_beside_their_floors(run):
    for row in run["rows"]:
        base = next(
            r
            for r in run["rows"]
            if (r["preset"], r["batch"], r["context"]) == (row["baseline"], row["batch"], row["context"])
        )
        assert row["ratio_decode_floor"] == pytest.approx(row["decode_floor_ms"] / base["decode_floor_ms"])
        assert row["ratio_kv_cache_bytes"] == pytest.approx(
            row["kv_cache_bytes_per_token"] / base["kv_cache_bytes_per_token"]
        )
        if row["preset"] == row["baseline"]:
            assert row["ratio_decode_time"] == 1.0
    gqa = next(r for r in run["rows"] if r["preset"] == "tiny-gqa-kv2")
    assert gqa["ratio_kv_cache_bytes"] == 0.5  # 2 of 4 key-value heads


@pytest.mark.slow  # the timed run above
def test_the_floor_is_bytes_at_the_bandwidth_or_macs_at_the_peak(run):
    meta = run["metadata"]
    for row in run["rows"]:
        memory = row["decode_bytes_read"] / (meta["memory_bandwidth_gbs"] * 1e6)
        compute = row["decode_macs"] * 2 / (meta["matmul_peak_tflops"] * 1e9)
        assert row["decode_floor_ms"] == pytest.approx(max(memory, compute))


def test_a_cells_members_on_different_attention_kernels_are_flagged_per_phase():
    rows = [
        {"preset": "dense", "attention_prefill": "flash", "attention_decode": "memory-efficient"},
        {"preset": "gqa", "attention_prefill": "flash", "attention_decode": "math"},
    ]
    flagged = decode._flag_mixed_attention(rows)
    assert all(r.get("attention_decode_mixed") for r in flagged)
    assert not any("attention_prefill_mixed" in r for r in flagged)
    assert "(mixed!)" in decode._printed(flagged[1] | {"ratio_decode_time": 1.5})["rel. decode"]


def test_resume_continues_only_a_run_whose_bytes_were_counted_alike():
    """A run stopped by older code counted a decode step's bytes otherwise: its cells and new ones in one file
    would stand beside each other on two floors."""
    metadata = {key: 1 for key in decode.SAME_GRID} | {"bytes_read": sizing.BYTES_READ}
    stopped = {"cells_done": 1, "cells": 4}
    older = {
        Path("old.json"): {"metadata": {k: v for k, v in metadata.items() if k != "bytes_read"} | stopped}
    }
    assert decode._unfinished(older, metadata) is None
    assert decode._unfinished({Path("new.json"): {"metadata": metadata | stopped}}, metadata) == Path(
        "new.json"
    )


def test_weights_read_by_hand():
    """Dense: every weight but the embedding and XL's position projection (a decoder reads its table of projected
    distances instead), plus the batch's embedding rows. SwitchHead: the V and O experts count the k of E per head
    a token uses, and at batch B the experts B tokens are expected to use, E (1 - (1 - k / E)^B) a head."""
    dense = PRESETS["tiny-transformer"]
    assert dense.pos == "xl"
    with torch.device("meta"):
        model = LanguageModel(dense)
    d, L = dense.d_model, dense.n_layers
    positions = L * d * dense.n_heads * dense.d_head  # [d_model, H d_head] a layer, without a bias
    assert sizing.weights_read(dense, 3) == count_parameters(model) - dense.vocab * d + 3 * d - positions
    sh = PRESETS["tiny-switchhead"]
    with torch.device("meta"):
        model = LanguageModel(sh)
    H, E, k, d, D = sh.n_heads, sh.n_experts, sh.k, sh.d_model, sh.d_head
    positions = sh.n_layers * d * H * D
    others = count_parameters(model) - sh.vocab * d - positions - sh.n_layers * 2 * H * E * d * D
    for batch in (1, 3, 64):  # V and O: [H E, d, D] and [H E, D, d]
        experts = H * E * (1 - (1 - k / E) ** batch)
        assert sizing.weights_read(sh, batch) == others + batch * d + round(sh.n_layers * 2 * experts * d * D)
    assert sizing.weights_read(sh, 1) == others + d + sh.n_layers * 2 * H * k * d * D  # each token's k of E


def test_weights_read_keeps_attention_and_mlp_experts_apart():
    """SwitchAll: SwitchHead's V and O (k of E a head, H k slots of H E) and the sigma-MoE's up and down (mlp_k of
    mlp_experts), each at its own rate even where their shapes agree (tiny: both 8 x 64 x 16 and 8 x 16 x 64)."""
    cfg = PRESETS["tiny-switchall"]
    H, E, k, d, D = cfg.n_heads, cfg.n_experts, cfg.k, cfg.d_model, cfg.d_head
    NE, G, K = cfg.mlp_experts, cfg.mlp_expert_size, cfg.mlp_k
    assert (H * E, d, D) == (NE, d, G)  # the case that collided
    with torch.device("meta"):
        model = LanguageModel(cfg)
    positions = cfg.n_layers * d * H * D
    experts = cfg.n_layers * 2 * (H * E * d * D + NE * d * G)
    others = count_parameters(model) - cfg.vocab * d - positions - experts
    for batch in (1, 4):
        attention = H * E * (1 - (1 - k / E) ** batch) * 2 * d * D
        mlp = NE * (1 - (1 - K / NE) ** batch) * 2 * d * G
        expected = others + batch * d + round(cfg.n_layers * (attention + mlp))
        assert sizing.weights_read(cfg, batch) == expected


@pytest.mark.parametrize("preset", ["tiny-transformer", "tiny-transformer-rope"])
def test_a_decoded_tokens_bytes_by_hand(preset):
    """One decoded token of dense at batch 2 after 8 cached tokens reads its weights (all but the embedding's other
    rows and XL's position projection), the batch's 9 tokens of K and V, and XL's table of 9 projected distances a
    layer, each counted here from the served model's parameters and the preset's heads. The floor's test rebuilt
    it from the row's own decode_bytes_read: a count without the cache, or of 8 keys or 8 distances, passed."""
    cfg, batch, context, width = PRESETS[preset], 2, 8, 4
    lm = decode.served(preset, context + 1, "cpu", torch.float32)
    member = decode.Member(preset, lm, batch, context)
    member.prefill()  # builds XL's table, as time_cell does before it times (its profiling left out: 4 s)
    member.decode()
    member.kernels = {"prefill": "", "decode": ""}
    member.prefill_macs = member.decode_macs = 0
    row = decode._row(member, {"prefill": [1.0], "decode": [1.0]}, width)
    params = dict(lm.named_parameters())
    weights = sum(
        p.numel() for n, p in params.items() if n != "stack.embedding.weight" and "pos_proj" not in n
    )
    weights += batch * cfg.d_model  # the batch's embedding rows
    keys = context + 1  # the cache read, the new token's own entry included
    cache = batch * keys * hand_count(preset)
    xl = cfg.pos == "xl"
    table = cfg.n_layers * cfg.n_heads * cfg.d_head * keys * width if xl else 0  # [H d_head] a distance
    assert xl == any("pos_proj" in n for n in params)
    assert row["decode_bytes_read"] == weights * width + cache + table
    # the table the decoder built is the one counted
    assert row["position_table_bytes"] == table == sizing.position_table_bytes(cfg, keys, width)


def test_max_batch_by_hand():
    cfg = PRESETS["c4-47m-switchhead-h2"]
    with torch.device("meta"):
        weights = count_parameters(LanguageModel(cfg)) * 2
    per_token = 2 * cfg.n_heads * cfg.d_head * cfg.n_layers * 2
    table = cfg.n_layers * cfg.n_heads * cfg.d_head * 512 * 2
    memory = 10 * 2**30
    assert sizing.max_batch(cfg, 512, memory, 2) == (memory - weights - table) // (512 * per_token)


@pytest.mark.slow  # times a pair
def test_a_wrong_decode_path_is_not_timed(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(
        decode, "decoding_check", lambda preset, device: 0.5 if "switchhead" in preset else 0.0
    )
    argv = ["decode", "tiny-transformer", "tiny-switchhead", "--device", "cpu", *FAST, "--out", str(tmp_path)]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    wrong = [r for r in rows if r["preset"] == "tiny-switchhead"]
    assert len(wrong) == 1 and wrong[0]["status"] == "wrong" and "decode_ms" not in wrong[0]


@pytest.mark.slow  # three presets decoded
def test_without_its_dense_baseline_a_group_gets_no_ratios(monkeypatch, tmp_path, capsys):
    """Dense refused (a wrong decode path here, or too large for the memory): SwitchHead must not become the
    baseline of the rest, its ratios read as theirs to dense."""
    monkeypatch.setattr(
        decode, "decoding_check", lambda preset, device: 0.5 if "transformer" in preset else 0.0
    )
    presets = ["tiny-transformer", "tiny-switchhead", "tiny-moa"]
    argv = ["decode", *presets, "--device", "cpu", *FAST, "--out", str(tmp_path), "--json"]
    assert main(argv) == 0
    timed = [r for r in json.loads(capsys.readouterr().out)["rows"] if "decode_ms" in r]
    assert {r["preset"] for r in timed} == {"tiny-switchhead", "tiny-moa"}
    assert not any("baseline" in r or "ratio_decode_time" in r for r in timed)


@pytest.mark.slow  # times a pair
def test_a_family_without_a_cache_is_a_row_not_an_error(monkeypatch, tmp_path, capsys):
    import dataclasses

    family = dataclasses.replace(registry.get("moh"), kv_cache=None)
    monkeypatch.setitem(registry._REGISTRY, "moh", family)
    argv = [
        "decode",
        "tiny-transformer",
        "tiny-moh",
        "--device",
        "cpu",
        *FAST,
        "--out",
        str(tmp_path),
        "--json",
    ]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["status"] for r in rows if r["preset"] == "tiny-moh"] == ["no decode path"]
    assert main(["decode", "tiny-moh", "--device", "cpu", *FAST, "--out", str(tmp_path)]) == 1
    assert "nothing measured" in capsys.readouterr().err


@pytest.mark.slow  # a preset decoded
def test_a_cell_too_large_is_refused_before_it_runs(monkeypatch, tmp_path, capsys):
    """A cell past the free memory is an OOM row beside those that fit; when none fits, the run is refused in one
    line before any model is built (it used to write a file of OOM rows and exit 1)."""
    monkeypatch.setattr(decode, "free_memory", lambda device: 2**26)
    huge = 10**6
    assert (
        sizing.peak_bytes(PRESETS["tiny-transformer"], huge, 9, 8, 4)
        > 2**26
        > sizing.peak_bytes(PRESETS["tiny-transformer"], 1, 9, 8, 4)
    )
    argv = ["decode", "tiny-transformer", "--device", "cpu", *FAST, "--out", str(tmp_path), "--json"]
    assert main([*argv, "--batches", "1", str(huge)]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["batch"]: r["status"] for r in rows} == {1: "ok", huge: "OOM"}
    assert main([*argv[:-3], "--out", str(tmp_path / "none"), "--batches", str(huge)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "switchbench decode: error: no case fits the 0.1 GiB free: the smallest, tiny-transformer at batch "
        f"{huge}, context 8, needs at least {sizing.peak_bytes(PRESETS['tiny-transformer'], huge, 9, 8, 4) / 2**30:.1f} GiB"
    ]
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["decode", "nope"], "unknown presets: nope"),
        (["decode", "--groups", "nope"], "unknown groups nope"),
        (["decode", "--batches", "4", "0"], "--batches must be >= 1; got 0"),
        (["decode", "--contexts", "-8"], "--contexts must be >= 1; got -8"),
        (
            ["decode", "--contexts", "2147483647"],
            "--contexts must be <= 2147483646 (a model is served one token longer); got 2147483647",
        ),  # named T
        (["decode", "--warmup", "-1"], "--warmup must be >= 0; got -1"),
        (["decode", "--memory-gib", "nan"], "--memory-gib must be"),
        (["decode", "--prefill-rounds", "0"], "--prefill-rounds must be >= 1; got 0"),
        (
            ["decode", "--rounds", "2", "--prefill-rounds", "4"],
            "--prefill-rounds (4) must be <= --rounds (2)",
        ),
        (["decode", "--memory-gib", "1e30"], "--memory-gib must be a positive number of GiB up to 2**20"),
        (["decode", "--threads", "0"], "--threads must be >= 1; got 0"),
        (  # --count ignored them: nothing is timed
            ["decode", "--count", "--rounds", "5", "--batches", "2", "--resume"],
            "--rounds, --batches, --resume: --count times nothing (it counts caches and largest batches)",
        ),
    ],
)
def test_bad_input(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_docs_table_of_cache_sizes_is_the_count():
    """docs/inference.md's table at 47M and 262M: each cell as `decode --count` counts it (bf16, 80 GiB)."""
    page = (Path(__file__).parents[1] / "docs" / "inference.md").read_text()
    shown = [line.split(" | ") for line in page.splitlines() if line.startswith(("| c4-", "| wikitext103-"))]
    groups = {g: speed.GROUPS[g] for g in ("47m", "262m")}
    counted = {r["preset"]: r for r in decode.count_rows(groups, (2048, 8192), 80 * 2**30, 2)}
    assert [cells[0].strip("| ") for cells in shown] == list(counted)
    for cells in shown:
        row = counted[cells[0].strip("| ")]
        assert cells[3] == f"{row['kv_cache_bytes_per_token']:,}"
        assert cells[5].strip(" |") == f"{row['max_batch_at_2048']:,} / {row['max_batch_at_8192']:,}"


def test_the_count_says_what_it_sized_for(capsys):
    """`decode --count` printed 147,456 bytes a token for 262M dense on a CPU machine (fp32) where the docs say 73,728
    (bf16), with no word of the dtype or the memory."""
    assert main(["decode", "--count", "--groups", "262m", "--dtype", "bf16", "--memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "bf16 cache (2 bytes a number)" and "73,728" in out
    assert (
        lines[-1] == "max batch: the most sequences whose caches fit 80 GiB (--memory-gib) beside the weights"
    )
    # memory below the weights: every max batch 0, and the note says what a 0 means (it stood without a word)
    assert main(["decode", "--count", "tiny-transformer", "--memory-gib", "1e-7"]) == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .endswith("(--memory-gib) beside the weights; 0: not one sequence's cache fits")
    )
    assert (
        main(["decode", "--count", "--groups", "262m", "--dtype", "fp32", "--memory-gib", "80", "--json"])
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    dense = next(r for r in rows if r["preset"] == "c4-262m-transformer-h16")
    assert (dense["dtype"], dense["memory_for_max_batch_bytes"]) == ("fp32", 80 * 2**30)
    assert dense["kv_cache_bytes_per_token"] == 2 * 73_728


def _decode_json(capsys, *argv: str) -> dict:
    assert main(["decode", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow  # times every tiny preset in bf16
def test_bf16_weights_and_cache_as_served(tmp_path, capsys):
    """Weights and cache in bf16 (no autocast): every family decodes, its residual stream in bf16 though the
    expert matmuls weigh by float32 gates, and its cache holds half the bytes of float32's."""
    out = _decode_json(capsys, "--device", "cpu", "--dtype", "bf16", *FAST, "--out", str(tmp_path))
    assert out["rows"] and all(r["status"] == "ok" for r in out["rows"])
    assert all(2 * r["kv_cache_bytes_per_token"] == hand_count(r["preset"]) for r in out["rows"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_path(tmp_path, capsys):
    """CUDA events, bf16, the Triton expert matmul and SDPA's kernels, on the tiny groups."""
    out = _decode_json(
        capsys, "--device", "cuda", "--batches", "1", "4", "--contexts", "64", "--out", str(tmp_path)
    )
    assert all(r["status"] == "ok" for r in out["rows"]) and out["metadata"]["cuda"]
    assert all(r["max_abs_diff_vs_forward"] <= 1e-4 for r in out["rows"])


def test_each_ratio_is_the_member_s_time_over_the_baseline_s_round_by_round():
    """Prefill and decode alike: the member's time over the dense baseline's of the same round, the median of those
    (under 1: faster); a group whose baseline was not timed gets none."""
    times = {
        "dense": {"prefill": [10.0, 20.0], "decode": [4.0, 8.0, 2.0]},
        "moe": {"prefill": [5.0, 5.0], "decode": [2.0, 2.0, 2.0]},
    }
    dense, moe = decode._with_ratios([{"preset": "dense"}, {"preset": "moe"}], times, "dense")
    assert moe["ratio_prefill_time"] == pytest.approx((0.5 + 0.25) / 2)
    assert moe["ratio_decode_time"] == pytest.approx(0.5)  # of 0.5, 0.25 and 1.0
    assert dense["ratio_decode_time"] == 1.0 and moe["baseline"] == "dense"
    assert (
        "ratio_decode_time" not in decode._with_ratios([{"preset": "moe"}], {"moe": times["moe"]}, "dense")[0]
    )


def test_decode_every_round_and_prefill_in_the_first_few():
    """Warm-up rounds decode only (the counted prefill warmed it); prefill is timed in the first prefill_rounds."""
    calls = []

    class Fake:
        def __init__(self, preset):
            self.preset = preset
            self.prefill = lambda: calls.append((preset, "prefill"))
            self.decode = lambda: calls.append((preset, "decode"))

    grid = decode.Grid({}, (1,), (8,), rounds=5, warmup=2, memory=1, prefill_rounds=3)
    times = decode._time_interleaved([Fake("a"), Fake("b")], lambda fn: fn() or 1.0, grid)
    assert {p: {w: len(t) for w, t in d.items()} for p, d in times.items()} == {
        p: {"prefill": 3, "decode": 5} for p in "ab"
    }
    assert calls.count(("a", "decode")) == 7 and calls.count(("a", "prefill")) == 3


@pytest.mark.slow  # times a pair twice
def test_a_run_stopped_midway_keeps_the_cells_it_measured(monkeypatch, tmp_path):
    """A GPU node's slice of time can end inside a long grid: every finished cell is on disk, with how many of the
    grid's cells that is, in the run's one pair of files."""
    time_cell, calls = decode.time_cell, []

    def stopped_at_the_second_cell(*args, **kwargs):
        calls.append(args[1:3])
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a SIGINT at the end of a slice would
        return time_cell(*args, **kwargs)

    monkeypatch.setattr(decode, "time_cell", stopped_at_the_second_cell)
    argv = ["decode", "tiny-transformer", "tiny-switchhead", "--device", "cpu", *FAST, "--out", str(tmp_path)]
    assert main(argv) == 130
    (saved,) = tmp_path.glob("*/*.json")
    run = json.loads(saved.read_text())
    assert (run["metadata"]["cells_done"], run["metadata"]["cells"]) == (1, 2)
    timed = [r for r in run["rows"] if "decode_ms" in r]
    assert {(r["preset"], r["batch"], r["context"]) for r in timed} == {
        ("tiny-transformer", 1, 8),
        ("tiny-switchhead", 1, 8),
    }
    assert all(r["decode_floor_ms"] > 0 for r in timed)  # saved beside its floors, as a finished run is
    assert len(list(tmp_path.glob("*/*.csv"))) == 1

    # --resume measures only the cell left, into the same files, and keeps the first cell's rows as they were
    calls.clear()
    monkeypatch.setattr(
        decode, "time_cell", lambda *args, **kwargs: calls.append(args[1:3]) or time_cell(*args, **kwargs)
    )
    assert main([*argv, "--resume"]) == 0
    assert calls == [(2, 8)] and list(tmp_path.glob("*/*.json")) == [saved]
    resumed = json.loads(saved.read_text())
    assert (resumed["metadata"]["cells_done"], resumed["metadata"]["cells"]) == (2, 2)
    assert [r["cells_done"] for r in resumed["metadata"]["resumed"]] == [1]
    kept = (
        "decode_ms",
        "decode_floor_ms",
        "prefill_floor_ms",
    )  # floors too: against the first part's yardsticks
    first = {(r["preset"], r["batch"]): [r[k] for k in kept] for r in resumed["rows"] if r.get("batch") == 1}
    assert first == {(r["preset"], r["batch"]): [r[k] for k in kept] for r in timed}
    for yardstick in decode.YARDSTICKS:
        assert resumed["metadata"][yardstick] == run["metadata"][yardstick]
        assert resumed["metadata"]["resumed"][0][f"{yardstick}_here"] > 0  # what the second part measured
    assert {r["batch"] for r in resumed["rows"] if "decode_ms" in r} == {1, 2}
    assert len(resumed["rows"]) == 4  # two presets x two cells, none twice

    # a finished run, or a stopped one of another grid, is not continued: --resume then starts a new run
    assert main([*argv, "--resume"]) == 0
    assert len(list(tmp_path.glob("*/*.json"))) == 2 and calls[-2:] == [(1, 8), (2, 8)]
    resumed["metadata"] |= {"contexts": [16], "cells_done": 1}
    (saved.parent / "other-grid.json").write_text(json.dumps(resumed))
    assert main([*argv, "--resume"]) == 0
    assert len(list(tmp_path.glob("*/*.json"))) == 4 and calls[-2:] == [(1, 8), (2, 8)]
    # nor one timed with other threads or kernels: its cells would stand under this run's settings
    for other in ({"threads": 7}, {"attention": "sdpa"}, {"routing_resolved": "count"}):
        stopped = run | {"metadata": run["metadata"] | {"cells_done": 1, **other}}
        (saved.parent / "other-settings.json").write_text(json.dumps(stopped))
        files = len(list(tmp_path.glob("*/*.json")))
        assert main([*argv, "--resume"]) == 0
        assert len(list(tmp_path.glob("*/*.json"))) == files + 1 and calls[-2:] == [(1, 8), (2, 8)]


def _run_with(metadata=None, row=None, **run) -> str:
    """A decode run's JSON, changed by ``metadata``, ``row`` (its one row's fields; None values dropped) and ``run``."""
    metadata = {"matmul_peak_tflops": 1.0, "memory_bandwidth_gbs": 1.0, "cells_done": 1, "cells": 2} | (
        metadata or {}
    )
    row = {"preset": "p", "family": "dense", "status": "ok", "group": "g", "batch": 1, "context": 8} | (
        row or {}
    )
    row = {k: v for k, v in row.items() if v is not None}
    return json.dumps({"metadata": {k: v for k, v in metadata.items() if v is not None}, "rows": [row]} | run)


DAMAGED_RUNS = {
    "not-json": "{broken",
    "a-list": "[]",
    "no-metadata": '{"metadata": 3}',
    "nested past the stack": "[" * 100_000 + "]" * 100_000,
    "an integer past 4,300 digits": "[" + "9" * 5000 + "]",
    "cells as text": _run_with({"cells_done": "1"}),
    "no peak": _run_with({"matmul_peak_tflops": None}),
    "a row without its group": _run_with(row={"group": None}),
    "a cell's batch as text": _run_with(row={"batch": "1"}),
    "a time as text": _run_with(row={"decode_ms": "fast"}),
    "rows an object": _run_with(rows={"a": 1}),
    "no rows": json.dumps({"metadata": {}}),
}


@pytest.mark.parametrize("content", DAMAGED_RUNS.values(), ids=DAMAGED_RUNS.keys())
def test_resume_names_a_file_in_the_folder_that_is_no_run(tmp_path, capsys, content):
    """--resume reads the folder's runs to find the one to continue: one it cannot read, or whose fields it reads
    are not of their kind, is named, with exit 2, and left as it was (it was a JSON error without the path, or a
    crash: exit 3, after measuring for a time as text)."""
    folder = tmp_path / slug(environment("cpu")["device"])  # where decode keeps this machine's runs
    monkey = folder / "fp32-decode.json"
    folder.mkdir()
    monkey.write_text(content)
    assert (
        main(["decode", "tiny-transformer", "--device", "cpu", *FAST, "--out", str(tmp_path), "--resume"])
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith(f"switchbench decode: error: --resume: {monkey}: ") and len(err.splitlines()) == 1
    assert err.rstrip().endswith("move it away, or run without --resume")
    assert monkey.read_text() == content


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda run: run["rows"][0].pop("prefill_macs"), "'prefill_macs' must be a number"),
        (lambda run: run["rows"][0].update(decode_ms=0), "must be finite and > 0"),
        (lambda run: run["rows"][0].update(context=10**30), "batch and context must be in"),
        (lambda run: run["metadata"].update(matmul_peak_tflops=0), "must be finite and > 0"),
    ],
)
def test_a_stopped_run_whose_rows_the_floors_cannot_read_is_refused_before_any_work(damage, says, tmp_path):
    """What --resume keeps, its floors are computed from again: a row without its counts, with a zero time, a
    context past any model, or a zero yardstick failed after a cell was timed (KeyError, ZeroDivisionError,
    OverflowError: exit 3)."""
    row = {"group": "tiny", "preset": "tiny-transformer", "family": "dense", "batch": 1, "context": 8}
    row |= {"status": "ok"}
    row |= dict.fromkeys(decode.FLOORED, 1.0)
    metadata = {"matmul_peak_tflops": 1.0, "memory_bandwidth_gbs": 1.0, "cells_done": 1, "cells": 2}
    run = {"metadata": metadata, "rows": [row]}
    decode._read_run(_saved(tmp_path / "ok.json", run))  # as a stopped run writes it
    damage(run)
    with pytest.raises(ValueError, match=says):
        decode._read_run(_saved(tmp_path / "run.json", run))


def _saved(path: Path, run: dict) -> Path:
    path.write_text(json.dumps(run))
    return path


def test_a_phase_faster_than_its_floor_ratio_is_marked_with_the_floor_and_the_peak_beside_it():
    """The committed CPU run has MoA's prefill at 0.512 of dense's against a floor ratio of 0.675, printed plainly,
    with neither the floor ratio nor the fraction of the peak beside it."""
    row = {"preset": "tiny-moa", "ratio_prefill_time": 0.512, "ratio_prefill_floor": 0.675}
    printed = decode._printed(row | {"prefill_fraction_of_matmul_peak": 0.0412})
    assert printed["rel. prefill"] == "0.51 (baseline suspect)" and printed["rel. prefill floor"] == "0.68"
    assert printed["prefill of peak"] == "4.1%"
    assert decode._printed(row | {"ratio_prefill_time": 0.7})["rel. prefill"] == "0.70"


@pytest.mark.parametrize("what", ["prefill", "decode"])
def test_a_ratio_just_below_its_floor_ratio_is_suspect_and_one_at_it_is_not(what):
    """The mark is the ratio against the floor ratio itself, no margin: 0.674 of dense's time against a floor
    ratio of 0.675 is a baseline below its floor (a mark at 0.8 of the floor ratio left it plain), 0.675 and
    above are not."""
    row = {"preset": "tiny-moa", f"ratio_{what}_floor": 0.675}
    for ratio, suspect in ((0.674, True), (0.675, False), (0.676, False)):
        r = row | {f"ratio_{what}_time": ratio}
        assert decode.below_floor(r, what) is suspect, ratio
        assert decode._printed(r)[f"rel. {what}"].endswith("(baseline suspect)") is suspect, ratio
