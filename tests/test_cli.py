"""The command line's last line of defence: an unexpected failure is one line and exit 3, never a traceback."""

import pytest

from switchbench.bench.kernels import bench as kernels
from switchbench.cli import main


def _compiler_error(*args, **kwargs):
    raise RuntimeError("Both operands must be same dtype. Got fp32 and bf16\nat tl.dot(a, b)")


def test_an_unexpected_failure_is_one_line_and_exit_3(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kernels, "run", _compiler_error)
    # set on a GPU node, it shows the traceback instead
    monkeypatch.delenv("SWITCHBENCH_DEBUG", raising=False)
    assert main(["kernel-bench", "--device", "cpu", "--out", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "switchbench kernel-bench: failed: RuntimeError: Both operands must be same dtype. Got fp32 and bf16 "
        "(SWITCHBENCH_DEBUG=1 shows the traceback)"
    ]


def test_the_traceback_on_request(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "run", _compiler_error)
    monkeypatch.setenv("SWITCHBENCH_DEBUG", "1")
    with pytest.raises(RuntimeError, match="same dtype"):
        main(["kernel-bench", "--device", "cpu", "--out", str(tmp_path)])


@pytest.mark.slow  # a subprocess or a timing: seconds each, in tox
def test_a_reader_that_stops_early_is_no_failure():
    """`switchbench presets | head -1`: the closed pipe ends the command quietly, exit 0."""
    import fcntl
    import subprocess
    import sys

    argv = [sys.executable, "-m", "switchbench", "presets"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        fcntl.fcntl(process.stdout.fileno(), 1031, 4096)  # F_SETPIPE_SZ: a pipe smaller than the table
        assert process.stdout.readline().startswith(b"preset")
        process.stdout.close()
        assert process.wait(timeout=120) == 0
        assert process.stderr.read() == b""


@pytest.mark.slow  # a subprocess
def test_a_command_starts_without_what_only_some_commands_need():
    """Every command imports the whole command line; Dynamo (1.6 s), seaborn and pyplot (0.7 s each) and matplotlib
    itself (0.4 s) wait for the commands that compile or draw. Many tests and every evidence step start a command."""
    import subprocess
    import sys

    heavy = ("torch._dynamo", "seaborn", "matplotlib")
    probe = f"import sys, switchbench.cli; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
