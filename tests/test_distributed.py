"""Several processes under torchrun (gloo, two ranks): a data-parallel step equals one process's step on the whole
batch (float64), `train` and `speed` run under torchrun and write once, and one process is unchanged."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from switchbench.core import distributed
from switchbench.core.results import read_csv

TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
needs_torchrun = pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun not installed")
TESTS = Path(__file__).parent


def torchrun(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
    }
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_one_process_is_the_identity():
    world = distributed.ONE
    assert distributed.share(6, world) == slice(0, 6)
    assert distributed.gathered("x", world) == ["x"] and distributed.anywhere(True, world)
    model = torch.nn.Linear(2, 2)
    assert distributed.wrap(model, world) is model


def test_shares_are_equal_and_in_rank_order():
    shares = [distributed.share(6, distributed.World(3, rank)) for rank in range(3)]
    assert shares == [slice(0, 2), slice(2, 4), slice(4, 6)]
    with pytest.raises(ValueError, match="multiple of the 4 processes"):
        distributed.share(6, distributed.World(4, 0))


@pytest.mark.slow
@needs_torchrun
@pytest.mark.parametrize("preset", ["tiny-transformer", "tiny-switchhead"])
def test_a_data_parallel_step_is_the_whole_batch_step(preset):
    """Same weights on both ranks, and the update of one process on the whole batch, in float64 (the families
    without auxiliary losses: those are means over each rank's tokens)."""
    out = json.loads(torchrun(str(TESTS / "ddp_step.py"), preset).stdout)
    assert out["world_size"] == 2 and out["between_ranks"] == 0.0
    assert out["against_one_process"] <= 1e-10 and out["moved"] > 1e-3  # the step did move the weights


@pytest.mark.slow
@needs_torchrun
def test_train_under_torchrun_writes_once_the_one_process_model(tmp_path):
    argv = ["train", "--task", "lm", "--preset", "tiny-transformer", "--steps", "3", "--batch", "4"]
    argv += ["--eval-every", "3", "--json"]
    done = torchrun("-m", "switchbench", *argv, "--out", str(tmp_path / "two"))
    assert done.stdout.count('"run"') == 1  # rank 0 alone prints
    alone = subprocess.run(
        [sys.executable, "-m", "switchbench", *argv, "--out", str(tmp_path / "one")],
        capture_output=True,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},  # as torchrun runs each rank: the same summation order
    )
    assert alone.returncode == 0, alone.stderr[-2000:]
    two, one = (
        torch.load(tmp_path / n / "checkpoint.pt", weights_only=True)["model"] for n in ("two", "one")
    )
    assert max((two[k] - one[k]).abs().max().item() for k in one) <= 1e-5
    log = (tmp_path / "two" / "log.csv").read_text().splitlines()
    assert len(log) == 2 and "mfu" in log[0]
    # the logged loss is the whole batch's, as one process logs it, not rank 0's half
    two, one = (read_csv(tmp_path / n / "log.csv")["loss"].item() for n in ("two", "one"))
    assert two == pytest.approx(one, rel=1e-5)


@pytest.mark.slow
@needs_torchrun
def test_speed_under_torchrun_records_the_world_and_per_device_throughput(tmp_path):
    """The issue's command: two CPU processes, the tiny group, quick settings (3 rounds: each rank's import and
    models are most of its 10 s)."""
    argv = [
        "speed",
        "--device",
        "cpu",
        "--groups",
        "tiny",
        "--quick",
        "--rounds",
        "3",
        "--json",
        "--out",
        str(tmp_path),
    ]
    done = torchrun("-m", "switchbench", *argv)
    out = json.loads(done.stdout[done.stdout.index("{") :])
    meta = out["metadata"]
    assert (meta["world_size"], meta["backend"], len(meta["rank_devices"])) == (2, "gloo", 2)
    steps = [r for r in out["rows"] if r.get("what") == "train step"]
    assert steps and all(r["tokens_per_s_per_device"] > 0 and r["fraction_of_matmul_peak"] > 0 for r in steps)
    assert len(list(tmp_path.rglob("*.json"))) == 1  # written once, by rank 0
