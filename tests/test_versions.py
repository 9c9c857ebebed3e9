"""Libraries known not to work together, named by version: Triton's interpreter beside numpy (before Triton 3.7 a
loop's bound is a one-element array turned into an int, which numpy 2.4 refuses), against what the installed
interpreter does."""

import os
import subprocess
import sys

import pytest

from switchbench.core import versions


@pytest.mark.parametrize(
    ("triton", "numpy", "usable"),
    [
        ("3.6.0", "2.4.6", False),
        ("3.0.0", "2.4.0", False),
        ("3.6.0", "2.3.5", True),  # numpy only warns
        ("3.7.0", "2.4.6", True),  # Triton squeezes the array first
        ("3.9.0+git1a2b", "2.5.0", True),
        (None, "2.4.6", True),  # no Triton, nothing to interpret
    ],
)
def test_the_interpreter_s_known_failure_is_named_by_version(triton, numpy, usable):
    reason = versions.triton_interpreter_unusable(triton, numpy)
    assert (reason is None) == usable
    assert usable or ("numpy<2.4 or triton>=3.7" in reason and triton in reason and numpy in reason)


LOOP_KERNEL = """
import torch, triton, triton.language as tl

@triton.jit
def total(bounds, out):
    acc = 0
    for i in range(0, tl.load(bounds)):
        acc += i
    tl.store(out, acc)

out = torch.zeros(1, dtype=torch.int32)
total[(1,)](torch.tensor([4], dtype=torch.int32), out)
assert out.item() == 6
"""


@pytest.mark.slow  # a Triton kernel interpreted in a process of its own
def test_the_prediction_is_what_the_installed_interpreter_does():
    """A loop over a loaded bound, interpreted in a process of its own: it runs exactly when the versions installed
    here are not named as failing."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    ran = subprocess.run([sys.executable, "-c", LOOP_KERNEL], env=env, capture_output=True, text=True)
    assert (ran.returncode == 0) == (versions.triton_interpreter_problem() is None), ran.stderr[-400:]


@pytest.mark.parametrize("flag", ["--attention", "--expert-matmul", "--routing"])
def test_a_triton_flag_is_refused_in_one_line_where_the_interpreter_cannot_run(
    flag, monkeypatch, tmp_path, capsys
):
    """Triton 3.6 beside numpy 2.4, stood in for: the run stops before any work, naming the versions and the way
    out, instead of failing in the kernel's first loop."""
    from switchbench.bench import command
    from switchbench.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(
        command, "triton_interpreter_problem", lambda: versions.triton_interpreter_unusable("3.6.0", "2.4.6")
    )
    argv = ["speed", "--presets", "tiny-transformer", "tiny-switchhead", "--device", "cpu", flag, "triton"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "numpy<2.4 or triton>=3.7" in err and "Triton 3.6.0" in err
    assert not (tmp_path / "out").exists()
