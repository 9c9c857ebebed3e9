"""The main job in a git checkout: a quick run writes only where git ignores, and every file says which commit
the job started from, before its own results changed the checkout."""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_report import CHROMIUM, browse

from switchbench.bench.cost import tables
from switchbench.cli import main
from switchbench.core.results import read_csv, write_csv
from switchbench.jobs import main_job

PROJECT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo: Path, *args: str) -> str:
    identity = ["-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "commit.gpgsign=false"]
    return subprocess.run(
        ["git", "-C", str(repo), *identity, *args], capture_output=True, text=True, check=True
    ).stdout


def git_state(repo: Path) -> str:
    """What environment.commit() records: HEAD, with -dirty when a tracked file changed or the package holds one git
    does not know."""
    changed = git(repo, "status", "--porcelain", "--untracked-files=no")
    unknown = git(repo, "ls-files", "--others", "--exclude-standard", "--", "switchbench")
    return git(repo, "rev-parse", "HEAD").strip() + ("-dirty" if changed or unknown else "")


@pytest.fixture
def checkout(tmp_path, monkeypatch) -> Path:
    """A git checkout with the project's .gitignore and committed results, as the working folder."""
    repo = tmp_path / "checkout"
    (repo / "results" / "tables").mkdir(parents=True)
    shutil.copy(PROJECT / ".gitignore", repo / ".gitignore")
    (repo / "results" / "tables" / "table1.csv").write_text("committed\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "committed results")
    monkeypatch.chdir(repo)
    return repo


def fake_steps(seen: list[dict]) -> tuple:
    """The job's steps reduced to what they write: the tables into the results folder, a log into the runs
    folder; each keeps the provenance it was given."""

    def writes(args, results: Path, runs: Path) -> dict:
        seen.append(args.provenance)
        write_csv(results / "tables" / "table1.csv", [{"rewritten": 1}])
        write_csv(runs / "run" / "log.csv", [{"step": 1}])
        return {"val_accuracy": 0.5, "majority_class": 0.2}

    names = [f"training {name}" for name in main_job._run_names()]
    return (
        main_job.Step("tables", writes),
        *(main_job.Step(name, writes) for name in names),
        main_job.Step("report", lambda args, results, runs: str(results / "report.html")),
    )


def test_a_quick_job_leaves_the_checkout_clean_and_names_its_folder(checkout, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(main_job, "STEPS", fake_steps(seen))
    monkeypatch.setattr(main_job, "commit", lambda: git_state(checkout))
    assert main(["all", "--quick"]) == 0
    assert git(checkout, "status", "--porcelain", "--untracked-files=all") == ""
    assert (checkout / "results" / "tables" / "table1.csv").read_text() == "committed\n"
    assert (checkout / "results-quick" / "tables" / "table1.csv").exists()
    assert (checkout / "runs-quick" / "run" / "log.csv").exists() and not (checkout / "runs").exists()
    last = capsys.readouterr().out.splitlines()[-1]
    assert "results-quick/" in last and "runs-quick/" in last
    assert seen[0] == {
        "job": "switchbench all --quick",
        "quick": True,
        "training_steps": {"listops": 100, "lm": 100},
        "commit": git_state(checkout),
    }


def test_a_full_job_records_the_commit_once_before_its_first_write(checkout, monkeypatch, capsys):
    seen, calls = [], []
    monkeypatch.setattr(main_job, "STEPS", fake_steps(seen))
    monkeypatch.setattr(main_job, "commit", lambda: calls.append(1) or git_state(checkout))
    clean = git_state(checkout)
    assert main(["all", "--json"]) == 0
    assert git_state(checkout) == clean + "-dirty"  # a full run refreshes results/ ...
    assert len(calls) == 1 and len(seen) == 4  # ... and every step was told the commit it started from
    assert all(
        s
        == {
            "job": "switchbench all",
            "quick": False,
            "training_steps": {"listops": main_job.LISTOPS_STEPS, "lm": 1500},
            "commit": clean,
        }
        for s in seen
    )


def test_a_full_job_keeps_its_models_among_the_results(checkout, monkeypatch):
    monkeypatch.setattr(main_job, "STEPS", fake_steps([]))
    monkeypatch.setattr(main_job, "commit", lambda: "abc")
    assert main(["all", "--json"]) == 0
    assert (checkout / "results" / "runs" / "run" / "log.csv").exists() and not (checkout / "runs").exists()
    kept = git(checkout, "status", "--porcelain", "--untracked-files=all")  # committed, not ignored
    assert "results/runs/run/log.csv" in kept


@pytest.mark.slow  # trains and analyses: the main job end to end
def test_a_full_job_continues_the_model_it_finds_and_a_quick_one_starts_afresh(tmp_path, monkeypatch):
    """The committed ListOps trio outlasts any one sitting: a full run picks a model up at its checkpoint and
    carries its log on; a quick run would analyse a stale model if it did, so it replaces it."""
    trainer = main_job._trainer("listops", "dense", 0)
    full, log = argparse.Namespace(quick=False, json=True), tmp_path / "listops-transformer-h8" / "log.csv"
    for steps in (3, 5):
        monkeypatch.setattr(main_job, "LISTOPS_STEPS", steps)
        result = trainer(full, tmp_path, tmp_path)
    assert read_csv(log)["step"].tolist() == [3, 5] and result["step"] == 5
    monkeypatch.setattr(main_job, "_steps", lambda args: {"listops": 2})
    trainer(argparse.Namespace(quick=True, json=True), tmp_path, tmp_path)
    assert read_csv(log)["step"].tolist() == [2]


@pytest.mark.slow  # a ListOps training
def test_a_quick_job_refuses_to_train_over_a_full_runs_model_before_any_step(tmp_path, monkeypatch, capsys):
    """`all --quick --runs DIR` with a full run's models in DIR replaced them (exit 0, no word); it is now refused
    before its first step, and the model is left as it was."""
    monkeypatch.setattr(main_job, "LISTOPS_STEPS", 3)
    main_job._trainer("listops", "dense", 0)(argparse.Namespace(quick=False, json=True), tmp_path, tmp_path)
    saved = tmp_path / "listops-transformer-h8" / "checkpoint.pt"
    before = saved.read_bytes()
    reached = []
    monkeypatch.setattr(main_job, "STEPS", (main_job.Step("tables", lambda *args: reached.append(1)),))
    argv = ["all", "--quick", "--runs", str(tmp_path), "--results", str(tmp_path / "results")]
    assert main(argv) == 2 and not reached and saved.read_bytes() == before
    assert capsys.readouterr().err == (
        f"switchbench all: error: --runs: {saved} was trained for 3 steps, and a quick run would replace it; "
        "give another --runs\n"
    )
    monkeypatch.setattr(main_job, "_steps", lambda args: {"listops": 3, "lm": 3})  # a quick run's own model
    main_job._check_trained(argparse.Namespace(quick=True), tmp_path)


def test_a_full_job_trains_listops_until_the_analysis_accuracy_holds(tmp_path, monkeypatch):
    """The issue's 85% (three evaluations in a row); a quick run and the text models train to their steps."""
    seen = []
    monkeypatch.setattr(main_job, "train", lambda cfg, out, **kwargs: seen.append(cfg) or {})
    for task, quick in (("listops", False), ("listops", True), ("lm", False)):
        main_job._trainer(task, "dense", 0)(argparse.Namespace(quick=quick, json=True), tmp_path, tmp_path)
    assert [cfg.stop_at for cfg in seen] == [0.85, None, None]


def test_the_jobs_cpu_trainings_run_on_one_thread(tmp_path, monkeypatch):
    """Beside busy neighbours a pool of one thread per core stalled a quick ListOps training to about 280 s."""
    threads = []
    monkeypatch.setattr(main_job, "train", lambda cfg, out, **kwargs: threads.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # as on a 2-core machine (the tests' workers run one thread each)
    try:
        main_job._trainer("listops", "dense", 0)(
            argparse.Namespace(quick=True, json=True), tmp_path, tmp_path
        )
        assert threads == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_tables_metadata_carries_the_jobs_provenance(tmp_path):
    row = {"preset": "p", "macs_vs_dense": 0.5}
    provenance = {
        "job": "switchbench all --quick",
        "quick": True,
        "training_steps": {"listops": 100, "lm": 100},
        "commit": "abc",
    }
    tables.write_tables(tmp_path, {"table1": [row]}, provenance)
    metadata = json.loads((tmp_path / "metadata.json").read_text())
    assert metadata.items() >= provenance.items() and metadata["command"] == "switchbench tables"


def copy_of_the_checkout(tmp_path: Path) -> Path:
    """The project's tracked files as they are now (uncommitted changes included), committed in a new
    repository: a fresh clone of this working tree."""
    if not (PROJECT / ".git").exists():
        pytest.skip("not a git checkout")
    copy = tmp_path / "clone"
    for name in git(PROJECT, "ls-files", "-z").split("\0"):
        if name and (PROJECT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(PROJECT / name, copy / name)
    git(copy, "init", "-q")
    git(copy, "add", "-A")
    git(copy, "commit", "-q", "-m", "clone")
    return copy


@pytest.mark.slow
def test_a_quick_main_job_in_a_fresh_clone(tmp_path):
    """README command 1 (its set-up's `switchbench all --quick`, held there by test_docs) in a clone: git status
    stays clean, every file names the clone's commit, quick, 100 steps; then the report, in the browser if there is
    one."""
    clone = copy_of_the_checkout(tmp_path)
    head = git(clone, "rev-parse", "HEAD").strip()
    job = subprocess.run(
        [sys.executable, "-m", "switchbench", "all", "--quick"],
        cwd=clone,
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": str(clone)},
    )
    assert job.returncode == 0, job.stderr[-2000:]
    assert "results-quick/" in job.stdout.splitlines()[-1]
    assert git(clone, "status", "--porcelain", "--untracked-files=all") == ""
    results, runs = clone / "results-quick", clone / "runs-quick"
    provenance = {
        "job": "switchbench all --quick",
        "quick": True,
        "training_steps": {"listops": 100, "lm": 100},
        "commit": head,
    }
    speed_runs = list((results / "speed").rglob("*.json"))
    assert len(speed_runs) == 1
    for metadata in (
        json.loads((results / "tables" / "metadata.json").read_text()),
        json.loads(speed_runs[0].read_text())["metadata"],
        json.loads((results / "analysis" / "listops" / "metadata.json").read_text()),
        json.loads((results / "analysis" / "text" / "metadata.json").read_text()),
    ):
        assert metadata.items() >= provenance.items(), metadata
    report = results / "report.html"
    page = report.read_text()
    for section in (
        "Compute and memory",
        "Cost against context length",
        "What the experts learn",
    ):
        assert section in page
    assert head in page and 'id="speed"' in page and "100 training steps, quick run" in page
    assert {p.name for p in runs.iterdir()} == {
        "listops-transformer-h8",
        "listops-switchhead-h2",
        "listops-transformer-h8-seed1",
        "lm-tiny-transformer",
        "lm-tiny-switchhead",
    }
    for task in ("listops", "text"):  # each analysis' explorer, linked from the report
        assert (results / "analysis" / task / "explorer.html").exists()
        assert f'/analysis/{task}/explorer.html">Routing explorer</a>' in page
    assert 'id="preferences-by-task"' in page
    assert (
        "listops-listops" not in page
        and "listops-listops" not in (results / "analysis" / "listops" / "summary.csv").read_text()
    )
    assert (
        results / "analysis" / "listops" / "similarity.csv"
    ).exists() and 'id="routing-listops-similarity"' in page
    if CHROMIUM is not None:
        pytest.importorskip("playwright")
        seen = browse(report, tmp_path / "screen.png")
        assert seen["errors"] == [] and seen["external"] == [] and all(seen["images"])
        assert seen["first"] == "summary" and seen["scroll"] <= seen["width"]
