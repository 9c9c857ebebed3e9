"""The built wheel adds one import name and runs from any folder, its data read as package data."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist, source = tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("source")
    # built from a copy: setuptools builds in the tree's build/ and egg-info, and another worker's test may be
    # building the same tree with pip at the same moment (this build once failed so, in CI)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "switchbench", source / "switchbench", ignore=shutil.ignore_patterns("__pycache__")
    )
    build = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(source)]
    subprocess.run(build, check=True, capture_output=True)
    (path,) = dist.glob("switchbench-*.whl")
    return path


@pytest.mark.slow
def test_wheel_holds_one_top_level_name_and_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"switchbench"}
    for data in (
        "bench/data/published_tables.csv",
        "train/data/tempest.txt",
        "reports/templates/report.html.j2",
        "analysis/templates/explorer.html.j2",
        "analysis/templates/explorer.js",
        "analysis/templates/explorer.css",
        "ops/expert_matmul/data/expert_matmul_auto.json",
        "ops/data/tuned_configs.json",
    ):
        assert f"switchbench/{data}" in names


@pytest.mark.slow
def test_wheel_in_a_fresh_environment_counts_from_another_folder(wheel, tmp_path):
    """`count` of the headline layer: the published cells from the wheel's data, its counters on a real module
    (`tables` does the same for all 32 layers, 15 s more; tests/test_accounting.py runs it)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # The dependencies come from this environment (no download); a path listed in a .pth file is not itself
    # scanned for .pth files, so this environment's editable switchbench stays invisible there.
    Path(site, "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # --ignore-installed: the editable switchbench of this environment is visible through the .pth file
    pip = [python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", str(wheel)]
    subprocess.run(pip, check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run(
        [python, "-c", "import switchbench; print(switchbench.__file__)"],
        cwd=elsewhere,
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    assert where.startswith(site)
    count = subprocess.run(
        [venv / "bin" / "switchbench", "count", "c4-262m-switchhead-h4", "--json"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        env=env,
    )
    assert count.returncode == 0, count.stderr
    views = json.loads(count.stdout)
    assert {(r["table"], r["macs"], r["mem"]) for r in views["published"]} == {("2", "2.4G", "5.6M")}
    assert views["macs_exact"] == views["macs_fvcore"] == views["macs_flop_counter"]
    assert not list(elsewhere.iterdir())  # nothing written where it ran
