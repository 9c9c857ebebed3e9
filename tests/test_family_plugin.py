"""A family from outside the package (tests/families/shared_qk.py), installed as a separate distribution would be:
an entry point in the ``switchbench.families`` group. Every command takes it: presets, params, count (its exact
cost equal to the counters), speed on the CPU, train and analyze; a plug-in that fails to load is one line, exit 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from optional import needs

FAMILIES = Path(__file__).parent / "families"
# Every test starts switchbench in a fresh interpreter with the plug-in installed: seconds each, run in tox
pytestmark = pytest.mark.slow


def _install(site: Path, entry: str) -> dict:
    """A distribution's metadata on a path entry, as pip leaves it: its entry points make the family found."""
    info = site / "switchbench_shared_qk-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: switchbench-shared-qk\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[switchbench.families]\nshared_qk = {entry}\n")
    path = os.pathsep.join(filter(None, [str(site), str(FAMILIES), os.environ.get("PYTHONPATH")]))
    return os.environ | {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    return _install(tmp_path_factory.mktemp("site"), "shared_qk:FAMILY")


def _run(env, cwd, *argv: str, ok: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "switchbench", *argv],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if ok:
        assert done.returncode == 0, done.stderr
    return done


@needs("fvcore")
def test_presets_params_and_count(env, tmp_path):
    names = {row["preset"] for row in json.loads(_run(env, tmp_path, "presets", "--json").stdout)}
    assert {"tiny-sharedqk", "tiny-sharedqk-rope", "listops-sharedqk-h8"} <= names
    mine, dense = (
        json.loads(_run(env, tmp_path, "params", name, "--json").stdout)
        for name in ("listops-sharedqk-h8", "listops-transformer-h8")
    )
    assert mine["per_layer"]["attention_plus_mlp"] == dense["per_layer"]["attention_plus_mlp"]
    assert mine["per_layer"]["attention"] < dense["per_layer"]["attention"]
    for name in ("tiny-sharedqk", "tiny-sharedqk-rope"):
        views = json.loads(_run(env, tmp_path, "count", name, "--json").stdout)
        assert views["macs_exact"] == views["macs_fvcore"] == views["macs_flop_counter"], name
        assert views["mem_exact"] == views["mem_saved_floats"], name
        assert views["macs_paper"] is None  # the paper has no such family


@pytest.mark.slow
def test_speed_train_and_analyze(env, tmp_path):
    speed = _run(
        env,
        tmp_path,
        "speed",
        "--groups",
        "tiny-rope",
        "--scopes",
        "layer",
        "--batch",
        "1",
        "--rounds",
        "2",
        "--warmup",
        "1",
        "--out",
        str(tmp_path / "speed"),
        "--json",
    )
    rows = [r for r in json.loads(speed.stdout)["rows"] if r["preset"] == "tiny-sharedqk-rope"]
    assert rows and all(r["status"] == "ok" for r in rows)
    for model in ("dense", "shared_qk"):
        _run(
            env,
            tmp_path,
            "train",
            "--task",
            "listops",
            "--model",
            model,
            "--steps",
            "2",
            "--eval-every",
            "2",
            "--batch",
            "4",
            "--out",
            str(tmp_path / model),
        )
    checkpoints = [str(tmp_path / model / "checkpoint.pt") for model in ("dense", "shared_qk")]
    _run(env, tmp_path, "analyze", *checkpoints, "--out", str(tmp_path / "analysis"))
    explorer = (tmp_path / "analysis" / "explorer.html").read_text()
    assert '"name": "shared_qk"' in explorer or "shared_qk" in explorer
    assert (tmp_path / "analysis" / "attention_maxima.png").stat().st_size > 0


def test_a_plugin_that_fails_to_load_is_one_line_and_exit_2(tmp_path):
    env = _install(tmp_path / "site", "no_such_module:FAMILY")
    done = _run(env, tmp_path, "presets", ok=False)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "switchbench: error: attention family plug-in 'shared_qk' (no_such_module:FAMILY) failed to load: "
        "No module named 'no_such_module'"
    )


def test_decode_reports_a_plug_in_without_a_cache(env, tmp_path):
    """The plug-in declares no KV cache: `decode` says so in its row and times the others."""
    argv = [
        "decode",
        "tiny-transformer",
        "tiny-sharedqk",
        "--device",
        "cpu",
        "--batches",
        "1",
        "--contexts",
        "8",
    ]
    done = _run(env, tmp_path, *argv, "--rounds", "1", "--json")
    rows = {r["preset"]: r for r in json.loads(done.stdout)["rows"]}
    assert rows["tiny-sharedqk"]["status"] == "no decode path"
    assert rows["tiny-transformer"]["status"] == "ok"
