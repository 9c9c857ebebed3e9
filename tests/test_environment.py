"""The commit a result records: the one SWITCHBENCH_COMMIT names (a copy sent to a node), else git's HEAD."""

import subprocess

import pytest

from switchbench.core import environment


@pytest.mark.parametrize("no_git", ["GIT_DIR", "PATH"])
def test_without_git_history_a_result_records_no_commit_unless_told_one(monkeypatch, tmp_path, no_git):
    # GIT_DIR at an empty folder: git runs and fails; PATH empty: there is no git to run
    monkeypatch.setenv(no_git, str(tmp_path) if no_git == "GIT_DIR" else "")
    monkeypatch.delenv("SWITCHBENCH_COMMIT", raising=False)
    assert environment.commit() is None
    monkeypatch.setenv("SWITCHBENCH_COMMIT", "0123abcd")
    assert environment.commit() == "0123abcd"


def test_a_checkout_records_its_head_and_the_variable_overrides_a_copy_s_own_history(monkeypatch):
    monkeypatch.delenv("SWITCHBENCH_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
    assert environment.commit().removesuffix("-dirty") == head.strip()
    monkeypatch.setenv("SWITCHBENCH_COMMIT", "0123abcd")
    assert environment.commit() == "0123abcd"
