"""Where and with what a measurement was taken: device, driver, versions, commit."""

import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch


def environment(device: str) -> dict:
    info = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "commit": commit(),
    }
    if device == "cuda":
        info["cuda"] = torch.version.cuda
        info["driver"] = _nvidia_driver()
    return info


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except ImportError:
        return None


def commit() -> str | None:
    """The commit ``SWITCHBENCH_COMMIT`` names, else the checkout's, with ``-dirty`` when it has changes; None
    outside a git checkout. The variable comes first: a copy of the tree sent to a GPU node may carry a git
    history of its own (one seen on a node had a snapshot commit of its own making), whose HEAD names nothing here."""
    if named := os.environ.get("SWITCHBENCH_COMMIT"):
        return named
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True
        )
    except OSError:
        return None
    if out.returncode:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
