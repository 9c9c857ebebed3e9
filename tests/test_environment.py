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


def test_output_kept_in_a_checkout_is_not_a_change_but_code_is(tmp_path, monkeypatch):
    """A fresh clone with a user's untracked out/ folder recorded `-dirty`; a module git does not know inside the
    package, or a tracked file changed, still does."""
    monkeypatch.delenv("SWITCHBENCH_COMMIT", raising=False)

    def git(*args):
        config = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
        return subprocess.run(
            ["git", "-C", str(tmp_path), *config, *args], capture_output=True, text=True
        ).stdout

    git("init", "-q")
    (tmp_path / "switchbench").mkdir()
    (tmp_path / "switchbench" / "core.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "first")
    head = git("rev-parse", "HEAD").strip()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "run.json").write_text("{}")
    assert environment.commit(tmp_path) == head
    (tmp_path / "switchbench" / "plugin.py").write_text("y = 2\n")
    assert environment.commit(tmp_path) == head + "-dirty"
    (tmp_path / "switchbench" / "plugin.py").unlink()
    (tmp_path / "switchbench" / "core.py").write_text("x = 2\n")
    assert environment.commit(tmp_path) == head + "-dirty"
