"""``switchbench wheelhouse DIR``: the wheels an offline GPU node needs, built on a networked machine.

The node keeps its own torch and triton (built for its CUDA); pip must never replace them, so they are left out,
with the NVIDIA packages, and nothing here resolves them. Everything else the suite depends on, recursively, is
resolved on this machine and kept as a pure-Python wheel: switchbench itself, its build backend (so that
``pip install -e .`` builds on the node) and the source distributions (fvcore, iopath) built into wheels here.
Binary wheels are left out by default, since those that suit this machine may not suit the node (the node keeps
its numpy, pandas, matplotlib ...); ``--python-version`` and ``--platform`` fetch them for a named target instead.
The test tools are the exception: a node has no reason to carry them, so a binary one (hypothesis is built per
Python since 6.170) is always fetched for the GPU nodes' Python and platform, NODE_PYTHON and NODE_PLATFORMS.

Standard library and pip only: ``python3 -m switchbench.wheelhouse DIR`` runs from a bare checkout, without torch.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the command says so; the rest of the suite does not need it
    tomllib = None

# Built for the node's CUDA: the node keeps its own, and pip must not pull a CPU or other-CUDA build over them.
NODE_OWN = {"torch", "triton"}
NODE_OWN_PREFIXES = ("nvidia-",)

NODE_EXTRA = "node-test"  # the extra of what the evidence chain runs the tests with on a node
# The GPU nodes' Python and the platform tags they accept (docs/gpu-nodes.md): where the test tools' binary wheels
# are fetched for without a named target
NODE_PYTHON = "3.12"
NODE_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")


@dataclass(frozen=True)
class Resolved:
    """One distribution pip would install: its name, version and the file it would fetch (wheel or sdist)."""

    name: str
    version: str
    file: str

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Wheelhouse:
    folder: Path
    wheels: list[str]  # file names put in
    built: list[str]  # names of the distributions built here from source (switchbench, sdists)
    node_must_have: list[str]  # requirements and binary distributions left out


def canonical(name: str) -> str:
    """A distribution's name as pip compares names (PEP 503): ``Jinja2`` and ``jinja2`` are one."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return canonical(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def is_node_own(name: str) -> bool:
    return canonical(name) in NODE_OWN or canonical(name).startswith(NODE_OWN_PREFIXES)


def is_pure(file: str) -> bool:
    """Whether a wheel file suits any platform: ABI tag ``none`` and platform tag ``any`` (py3-none-any)."""
    if not file.endswith(".whl"):
        return False
    *_, abi, platform = file.removesuffix(".whl").split("-")
    return abi == "none" and platform == "any"


def select(resolved: list[Resolved]) -> tuple[list[Resolved], list[Resolved]]:
    """What to turn into wheels here (pure wheels and sdists) and the binary wheels left for the node; the
    node's own (torch, triton, NVIDIA) are in neither."""
    kept = [r for r in resolved if not is_node_own(r.name)]
    binary = [r for r in kept if r.file.endswith(".whl") and not is_pure(r.file)]
    return [r for r in kept if r not in binary], binary


@dataclass(frozen=True)
class Requirements:
    """What the switchbench checkout asks for: at run time and to run its tests on the node (the ``node-test``
    extra), split into the node's own and the rest; and to build."""

    node_own: list[str]
    rest: list[str]
    build: list[str]
    tools: frozenset[str]  # the names of the test tools: the node-test extra's, beside what the suite runs on


def read_requirements(source: Path) -> Requirements:
    path = source / "pyproject.toml"
    if tomllib is None:
        raise ValueError("reading pyproject.toml needs Python 3.11 or newer (tomllib)")
    if not path.is_file():
        raise ValueError(f"--source {source}: no pyproject.toml there; run this in the switchbench checkout")
    try:
        project = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--source {source}: {path} is not readable TOML ({error})") from None
    if project.get("project", {}).get("name") != "switchbench":
        raise ValueError(f"--source {source}: {path} is not switchbench's")
    try:  # the test suite's own needs too: evidence runs it on the node first
        suite, tests = (
            project["project"]["dependencies"],
            project["project"]["optional-dependencies"][NODE_EXTRA],
        )
        build = project["build-system"]["requires"]
    except KeyError as error:
        raise ValueError(f"--source {source}: {path} has no {error.args[0]!r} table or list") from None
    runtime = suite + tests
    own = [r for r in runtime if is_node_own(requirement_name(r))]
    tools = frozenset(map(requirement_name, tests)) - set(map(requirement_name, suite))
    return Requirements(own, [r for r in runtime if r not in own], build, tools)


def resolve(requirements: list[str], work: Path) -> list[Resolved]:
    """Every distribution pip would install for ``requirements`` on this machine, recursively (nothing is
    installed: pip reads the metadata, and builds only that of source distributions)."""
    report = work / "resolved.json"
    _pip("install", "--dry-run", "--ignore-installed", "--report", str(report), *requirements)
    return [
        Resolved(
            item["metadata"]["name"], item["metadata"]["version"], _file_name(item["download_info"]["url"])
        )
        for item in json.loads(report.read_text())["install"]
    ]


def _file_name(url: str) -> str:
    return PurePosixPath(unquote(urlsplit(url).path)).name


def _pip(*args: str) -> None:
    """Runs pip for this interpreter, quietly; a failure is one line with pip's errors."""
    done = subprocess.run([sys.executable, "-m", "pip", *args, "--quiet"], capture_output=True, text=True)
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:]
        raise RuntimeError(f"pip {args[0]}: {' '.join(errors)}")


def build(
    folder: Path,
    source: Path,
    python_version: str | None = None,
    platforms=(),
    node_python: str = NODE_PYTHON,
) -> Wheelhouse:
    """Fill ``folder`` with the wheels the node needs; with a target (``python_version``, ``platforms``), the
    binary ones too, fetched for it; without one, the test tools' binary ones, fetched for ``node_python``."""
    requirements = read_requirements(source)
    made = _usable_folder(folder)
    try:
        return _build(folder, source, requirements, python_version, platforms, node_python)
    except BaseException:
        if made:  # a folder made for this run and left empty, or half-filled, would look like a wheelhouse
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _build(folder, source, requirements, python_version, platforms, node_python) -> Wheelhouse:
    target = bool(python_version or platforms)
    with tempfile.TemporaryDirectory() as work:
        to_build, binary = select(resolve(requirements.rest + requirements.build, Path(work)))
        built = _wheels(source, to_build, Path(work, "built"))
        # an sdist with compiled code builds a wheel for this machine only: the node must have that one too
        compiled = [w for w in built if not is_pure(w.name)]
        # without a target, the test tools' binary wheels alone, for the GPU nodes
        fetch = binary if target else [r for r in binary if canonical(r.name) in requirements.tools]
        where = (python_version, platforms) if target else (node_python, NODE_PLATFORMS)
        try:
            fetched = _binary_wheels(fetch, *where, Path(work, "target"))
        except RuntimeError as error:
            if not target or "No matching distribution" not in str(error):
                raise
            raise ValueError(_no_wheel_for(python_version, platforms, error)) from None
        kept = [w for w in built if w not in compiled] + fetched
        for wheel in kept:
            shutil.copy2(wheel, folder / wheel.name)
    left_out = [f"{r.name} (binary; {r.version} here)" for r in binary if r not in fetch]
    left_out += [f"{w.name.split('-')[0]} (compiled when built here: {w.name})" for w in compiled]
    from_source = ["switchbench"] + [r.name for r in to_build if not r.file.endswith(".whl")]
    own = [
        f"{r} (the node's own build, as are triton and the NVIDIA packages)" for r in requirements.node_own
    ]
    return Wheelhouse(folder, sorted(w.name for w in kept), from_source, own + left_out)


def _no_wheel_for(python_version: str | None, platforms, error: RuntimeError) -> str:
    """What to do when a named target has no wheel of a resolved version."""
    named = [f"--python-version {python_version}"] if python_version else []
    named += [f"--platform {platform}" for platform in platforms]
    found = str(error).split("ERROR: ")[-1]
    return (
        f"{' '.join(named)}: {found}; pip matches platform tags literally: give each the target accepts "
        f"(the GPU nodes': {', '.join(NODE_PLATFORMS)})"
    )


def _wheels(source: Path, resolved: list[Resolved], dest: Path) -> list[Path]:
    """The switchbench wheel of ``source``, and a wheel of each resolved distribution (sdists built here)."""
    _pip("wheel", "--no-deps", "--wheel-dir", str(dest), str(source), *(r.pin for r in resolved))
    return sorted(dest.glob("*.whl"))


def _binary_wheels(binary: list[Resolved], python_version, platforms, dest: Path) -> list[Path]:
    """The binary wheels of the versions resolved here, for the target Python and platforms."""
    if not binary:
        return []
    target = ["--python-version", python_version] if python_version else []
    target += [arg for platform in platforms for arg in ("--platform", platform)]
    _pip(
        "download", "--no-deps", "--only-binary=:all:", *target, "--dest", str(dest), *(r.pin for r in binary)
    )
    return sorted(dest.glob("*.whl"))


def _usable_folder(folder: Path) -> bool:
    """Make ``folder`` if need be, and check that it takes files; whether it was made."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file, not a folder")
    made = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{folder}: cannot make this folder ({error.strerror})") from None
    probe = folder / ".switchbench-probe"
    try:
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise ValueError(f"{folder}: cannot write there ({error.strerror})") from None
    return made


def describe(house: Wheelhouse, source: Path) -> str:
    """What was put in, what the node must already have, and the node's install command, last."""
    size = sum((house.folder / w).stat().st_size for w in house.wheels) / 1e6
    lines = [
        f"{len(house.wheels)} wheels in {house.folder} ({size:.1f} MB), built here from source: "
        f"{', '.join(house.built)}"
    ]
    lines += [f"  {w}" for w in house.wheels]
    lines += ["The node must already have (left out):"] + [f"  {r}" for r in house.node_must_have]
    lines += [
        f"On the node (copy {house.folder} and the checkout there), in the checkout, into the environment of the "
        "python3 that has the node's torch, triton and the packages above (a venv made from it with "
        "--system-site-packages would not see them where that python3 is itself a venv or a conda environment); "
        f"the {NODE_EXTRA} extra brings what the evidence chain's test steps need:",
        f"  python3 -m pip install --no-index --find-links {house.folder} -e '{source}[{NODE_EXTRA}]'",
    ]
    return "\n".join(lines)


def _path(text: str) -> Path:
    """A path given on the command line; an empty one (an unset variable) is no path, not the current folder."""
    if not text:
        raise argparse.ArgumentTypeError("empty; give a path")
    return Path(text)


def _python_version(text: str) -> str:
    if not re.fullmatch(r"3(\.\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a Python 3 version such as 3.12")
    return text


def _platform(text: str) -> str:
    # a wheel's platform tag is lower-case letters, digits and underscores (PEP 425: '-' and '.' made '_')
    if not re.fullmatch(r"[a-z0-9_]+", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a platform tag such as manylinux_2_28_x86_64")
    return text


DESCRIPTION = f"""\
Build, on a machine with network, the wheels an offline GPU node needs to install switchbench, then copy DIR and
the checkout to the node. torch, triton and NVIDIA's packages are left out: the node keeps its own. Pure-Python
dependencies are kept as wheels (source distributions built into wheels here); binary ones only for the Python
and platform named by --python-version and --platform, except the test tools', always fetched for Python
{NODE_PYTHON} on x86-64 Linux (the GPU nodes'). Needs only the standard library and pip."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "folder", metavar="DIR", type=_path, help="the wheelhouse folder (made if missing; wheels are added)"
    )
    parser.add_argument(
        "--source", type=_path, default=Path("."), help="the switchbench checkout (default: .)"
    )
    parser.add_argument(
        "--python-version", type=_python_version, help="also fetch binary wheels for this Python (e.g. 3.12)"
    )
    parser.add_argument(
        "--platform",
        action="append",
        default=[],
        dest="platforms",
        type=_platform,
        help="also fetch binary wheels for this platform tag; pip matches tags literally, so give "
        "each the node accepts: --platform manylinux_2_28_x86_64 --platform "
        "manylinux2014_x86_64",
    )


def register(commands) -> None:
    parser = commands.add_parser(
        "wheelhouse",
        help="build the wheels an offline GPU node needs (needs network)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    house = build(args.folder, args.source, args.python_version, args.platforms)
    print(describe(house, args.source))


def main(argv: list[str] | None = None) -> int:
    """``python3 -m switchbench.wheelhouse``: the command from a bare checkout, with the command line's exits."""
    parser = argparse.ArgumentParser(
        prog="python3 -m switchbench.wheelhouse",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    try:
        run(parser.parse_args(argv))
    except ValueError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        print(f"{parser.prog}: failed: {error}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
