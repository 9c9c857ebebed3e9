"""The commit a result records: git's, else the one SWITCHBENCH_COMMIT names (a copy sent to a node without .git)."""

import subprocess

import pytest

from switchbench.core import environment


@pytest.mark.parametrize("no_git", ["GIT_DIR", "PATH"])
def test_a_copy_without_git_history_records_the_commit_it_was_told(monkeypatch, tmp_path, no_git):
    # GIT_DIR at an empty folder: git runs and fails; PATH empty: there is no git to run
    monkeypatch.setenv(no_git, str(tmp_path) if no_git == "GIT_DIR" else "")
    monkeypatch.delenv("SWITCHBENCH_COMMIT", raising=False)
    assert environment.commit() is None
    monkeypatch.setenv("SWITCHBENCH_COMMIT", "0123abcd")
    assert environment.commit() == "0123abcd"


def test_a_git_checkout_records_its_own_head_whatever_the_variable_says(monkeypatch):
    monkeypatch.setenv("SWITCHBENCH_COMMIT", "0123abcd")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
    assert environment.commit().split("-")[0] == head.strip()
