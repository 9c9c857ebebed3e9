"""--expert-matmul on every command that runs expert matmuls: accepted, in force, and recorded in the run's
metadata (speed and kernel-bench: tests/test_speed.py and tests/test_kernel_bench.py)."""

import json

import pytest

from switchbench.cli import _parser, main
from switchbench.ops.expert_matmul import choice as expert_matmul_choice
from switchbench.train import checkpoint

COMMANDS = ("speed", "kernel-bench", "train", "quality", "all", "profile")
REQUIRED = {"profile": ["tiny-switchhead"]}  # positional arguments


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_the_flag_and_defaults_to_the_environment_or_auto(command, monkeypatch, capsys):
    monkeypatch.delenv(expert_matmul_choice.ENV_IMPL, raising=False)
    argv = [command, *REQUIRED.get(command, [])]
    assert _parser().parse_args(argv).expert_matmul == "auto"
    assert _parser().parse_args([*argv, "--expert-matmul", "grouped_mm"]).expert_matmul == "grouped_mm"
    monkeypatch.setenv(expert_matmul_choice.ENV_IMPL, "torch")
    assert _parser().parse_args(argv).expert_matmul == "torch"
    with pytest.raises(SystemExit):
        _parser().parse_args([*argv, "--expert-matmul", "cublas"])
    assert "invalid choice: 'cublas'" in capsys.readouterr().err


def test_a_bad_environment_is_refused_before_any_command_runs(monkeypatch, capsys):
    monkeypatch.setenv(expert_matmul_choice.ENV_IMPL, "cublas")
    assert main(["presets"]) == 2
    assert (
        "SWITCHBENCH_EXPERT_MATMUL=cublas: must be one of auto, torch, triton, grouped_mm, all_experts"
        in capsys.readouterr().err
    )


def _resolved(metadata: dict) -> set:
    return {(r["impl"], r["reason"]) for r in metadata["expert_matmul_resolved"].values()}


def test_train_runs_on_the_choice_and_records_it(tmp_path, capsys):
    argv = [
        "train",
        "--task",
        "lm",
        "--model",
        "switchall",
        "--steps",
        "2",
        "--batch",
        "2",
        "--eval-every",
        "2",
        "--device",
        "cpu",
        "--expert-matmul",
        "grouped_mm",
        "--out",
        str(tmp_path / "run"),
        "--json",
    ]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["expert_matmul"] == "grouped_mm" and _resolved(printed) == {("grouped_mm", "named")}
    assert len(printed["expert_matmul_resolved"]) >= 3  # attention V and O, the MLP's up and down
    saved = checkpoint.load(tmp_path / "run" / "checkpoint.pt")["train"]
    assert saved["expert_matmul"] == "grouped_mm" and saved["expert_matmul_resolved"]
    assert expert_matmul_choice.resolutions() == {}  # out of force after the command


@pytest.mark.slow  # trains
def test_quality_runs_on_the_choice_and_records_it(tmp_path, capsys):
    argv = [
        "quality",
        "--families",
        "switchhead",
        "--seeds",
        "2",
        "--steps",
        "1",
        "--batch",
        "2",
        "--device",
        "cpu",
        "--expert-matmul",
        "grouped_mm",
        "--out",
        str(tmp_path),
        "--json",
    ]
    assert main(argv) == 0
    metadata = json.loads(capsys.readouterr().out)["metadata"]
    assert metadata["expert_matmul"] == "grouped_mm" and _resolved(metadata) == {("grouped_mm", "named")}
    assert metadata["expert_matmul_fallback"] == "triton on CUDA (torch for float64), torch elsewhere"


def test_auto_says_where_it_fell_back(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(expert_matmul_choice.ENV_IMPL, raising=False)
    argv = [
        "train",
        "--task",
        "lm",
        "--model",
        "switchhead",
        "--steps",
        "1",
        "--batch",
        "2",
        "--eval-every",
        "1",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main(argv) == 0
    fell_back = (
        "expert matmul auto -> torch (auto fell back, no measured entry: "
        "triton on CUDA (torch for float64), torch elsewhere)"
    )
    assert fell_back in capsys.readouterr().out
