"""Installed libraries known not to work together, named before any work starts. Read from the packages' metadata,
so that asking imports none of them (the test runner's controller asks before it imports torch)."""

import re
from importlib import metadata


def installed(package: str) -> str | None:
    """The installed version of ``package``, or None."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, ...]:
    """'3.6.0+gitabc' -> (3, 6, 0): the leading numbers of a version."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def triton_interpreter_unusable(triton: str | None, numpy: str | None) -> str | None:
    """Why Triton ``triton``'s interpreter cannot run the suite's kernels beside numpy ``numpy``, or None. Before
    Triton 3.7 it reads a loop's bound by converting a one-element array to an int, which numpy 2.4 refuses:
    every kernel with a loop stops with a TypeError (numpy 1.25 to 2.3 only warn)."""
    if triton is None or numpy is None or release(triton) >= (3, 7) or release(numpy) < (2, 4):
        return None
    return (
        f"needs numpy<2.4 or triton>=3.7 to interpret its kernels on the CPU "
        f"(Triton {triton}'s interpreter fails on every loop under numpy {numpy})"
    )


def triton_interpreter_problem() -> str | None:
    """:func:`triton_interpreter_unusable` of the versions installed here."""
    return triton_interpreter_unusable(installed("triton"), installed("numpy"))


# Triton's interpreter multiplies bf16 blocks wrongly: tl.dot of two 16 x 16 bf16 blocks came out 2.5e10 off under
# Triton 3.9 (fp16 and fp32 exact; elementwise bf16 right), every value finite, so nothing downstream noticed: a
# bf16 speed run on the CPU with Triton's attention saved "ok" rows with logits 4 off
NO_BF16_DOT = (
    "takes no bf16 on the CPU: Triton's interpreter multiplies bf16 matrices wrongly (use fp32 or fp16)"
)


def interpreted_bf16_dot(device_type: str, dtype_name: str) -> bool:
    """Whether a Triton kernel that multiplies matrices would run in the interpreter on bf16 (``dtype_name``, as
    torch prints it, so that asking imports no torch)."""
    return device_type == "cpu" and dtype_name in ("torch.bfloat16", "bf16")
