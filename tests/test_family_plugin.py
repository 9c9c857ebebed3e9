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


# Several commands in turn in one fresh interpreter, as a shell runs them one after another: an interpreter's start,
# torch's import and the custom op's first call are about 4 s a command.
SESSION = """
import contextlib, io, json, sys
from switchbench.cli import main
done = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    done.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(done))
"""


def _session(env, cwd, *argvs: list[str]) -> list[str]:
    """What each command printed; every one must succeed."""
    ran = subprocess.run(
        [sys.executable, "-c", SESSION, json.dumps(argvs)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stderr
    done = json.loads(ran.stdout)
    for argv, each in zip(argvs, done, strict=True):
        assert each["code"] == 0, f"switchbench {' '.join(argv)}: {each['stderr']}"
    return [each["stdout"] for each in done]


@needs("fvcore")
def test_presets_params_and_count(env, tmp_path):
    tiny = ("tiny-sharedqk", "tiny-sharedqk-rope")
    presets, mine, dense, *counts = _session(
        env,
        tmp_path,
        ["presets", "--json"],
        *(["params", name, "--json"] for name in ("listops-sharedqk-h8", "listops-transformer-h8")),
        *(["count", name, "--json"] for name in tiny),
    )
    names = {row["preset"] for row in json.loads(presets)}
    assert {"tiny-sharedqk", "tiny-sharedqk-rope", "listops-sharedqk-h8"} <= names
    mine, dense = json.loads(mine), json.loads(dense)
    assert mine["per_layer"]["attention_plus_mlp"] == dense["per_layer"]["attention_plus_mlp"]
    assert mine["per_layer"]["attention"] < dense["per_layer"]["attention"]
    for name, count in zip(tiny, counts, strict=True):
        views = json.loads(count)
        assert views["macs_exact"] == views["macs_fvcore"] == views["macs_flop_counter"], name
        assert views["mem_exact"] == views["mem_saved_floats"], name
        assert views["macs_paper"] is None  # the paper has no such family


@pytest.mark.slow
def test_speed_train_and_analyze(env, tmp_path):
    speed = ["speed", "--groups", "tiny-rope", "--scopes", "layer", "--batch", "1", "--rounds", "2"]
    speed += ["--warmup", "1", "--out", str(tmp_path / "speed"), "--json"]
    train = ["--task", "listops", "--steps", "2", "--eval-every", "2", "--batch", "4"]
    checkpoints = [str(tmp_path / model / "checkpoint.pt") for model in ("dense", "shared_qk")]
    timed, *_ = _session(
        env,
        tmp_path,
        speed,
        *(
            ["train", *train, "--model", model, "--out", str(tmp_path / model)]
            for model in ("dense", "shared_qk")
        ),
        ["analyze", *checkpoints, "--out", str(tmp_path / "analysis")],
    )
    rows = [r for r in json.loads(timed)["rows"] if r["preset"] == "tiny-sharedqk-rope"]
    assert rows and all(r["status"] == "ok" for r in rows)
    analysis = json.loads((tmp_path / "analysis" / "metadata.json").read_text())
    presets = [checkpoint["train"]["preset"] for checkpoint in analysis["checkpoints"]]
    assert presets == ["listops-transformer-h8", "listops-sharedqk-h8"]  # the plug-in's model, analysed
    assert {"explorer.html", "attention_maxima.png", "similarity.csv"} <= set(analysis["files"])


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
