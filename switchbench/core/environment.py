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
    else:
        info["machine"] = cpu_fingerprint()
    return info


def cpu_fingerprint() -> dict:
    """What a CPU time ratio depends on besides the code: the processor model, its caches, the vector instructions
    PyTorch's kernels dispatch to, and the logical cores. Equal fingerprints do not prove one machine (a VM may show
    a generic model name); unequal ones prove two."""
    return {
        "model": _cpuinfo("model name") or platform.processor() or platform.machine(),
        "caches": _caches(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
    }


def describe_machine(fingerprint: dict) -> str:
    """A :func:`cpu_fingerprint` in words: 'AMD EPYC 7B13 (2 cores, AVX2, L1d 32K, L1i 32K, L2 512K, L3 32768K)'."""
    about = [f"{fingerprint.get('cores')} cores", fingerprint.get("capability"), fingerprint.get("caches")]
    return f"{fingerprint.get('model')} ({', '.join(str(a) for a in about if a)})"


def _cpuinfo(field: str) -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next(
        (line.split(":", 1)[1].strip() for line in lines if line.split(":")[0].strip() == field), None
    )


def _caches() -> str | None:
    """Level, kind and size of each of CPU 0's caches (Linux), e.g. 'L1d 48K, L1i 32K, L2 2048K, L3 307200K'."""
    caches = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        caches.append(f"L{level}{dict(Data='d', Instruction='i').get(kind, '')} {size}")
    return ", ".join(caches) or None


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except ImportError:
        return None


CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout holding the package, when it runs from one


def commit(root: Path = CHECKOUT) -> str | None:
    """The commit ``SWITCHBENCH_COMMIT`` names, else the checkout's at ``root``, with ``-dirty`` when its code may
    differ from the commit's: a tracked file changed, or a file git does not know inside the package (a module it
    would import). Output a user keeps in the checkout (an --out folder) is not a change. None outside a git
    checkout. The variable comes first: a copy of the tree sent to a GPU node may carry a git history of its own
    (one seen on a node had a snapshot commit of its own making), whose HEAD names nothing here."""
    if named := os.environ.get("SWITCHBENCH_COMMIT"):
        return named

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)

    try:
        head = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        unknown = git("ls-files", "--others", "--exclude-standard", "--", "switchbench").stdout.strip()
    except OSError:
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("-dirty" if changed or unknown else "")


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
