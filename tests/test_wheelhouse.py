"""``switchbench wheelhouse``: what goes into the wheelhouse of an offline GPU node, and what the node keeps."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from switchbench import wheelhouse
from switchbench.cli import main
from switchbench.wheelhouse import Resolved

ROOT = Path(__file__).resolve().parents[1]

RESOLVED = [
    Resolved("torch", "2.11.0", "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl"),
    Resolved("triton", "3.6.0", "triton-3.6.0-cp312-cp312-manylinux_2_27_x86_64.whl"),
    Resolved(
        "nvidia_cublas_cu12", "12.8.4.1", "nvidia_cublas_cu12-12.8.4.1-py3-none-manylinux_2_27_x86_64.whl"
    ),
    Resolved("numpy", "2.4.6", "numpy-2.4.6-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"),
    Resolved("fvcore", "0.1.5.post20221221", "fvcore-0.1.5.post20221221.tar.gz"),
    Resolved("Jinja2", "3.1.6", "jinja2-3.1.6-py3-none-any.whl"),
    Resolved("tzdata", "2026.6", "tzdata-2026.6-py2.py3-none-any.whl"),
    # a test tool built per Python (6.170 on): not on a node, so fetched for it
    Resolved("hypothesis", "6.170.17", "hypothesis-6.170.17-cp311-cp311-manylinux2014_x86_64.whl"),
]


def test_the_nodes_own_are_left_out_and_binary_wheels_set_apart():
    to_build, binary = wheelhouse.select(RESOLVED)
    assert [r.name for r in to_build] == ["fvcore", "Jinja2", "tzdata"]
    assert [r.name for r in binary] == ["numpy", "hypothesis"]


@pytest.mark.parametrize(
    ("file", "pure"),
    [
        ("tqdm-4.70.1-py3-none-any.whl", True),
        ("python_dateutil-4.0.0-py2.py3-none-any.whl", True),
        ("nvidia_nccl_cu12-2.27.3-py3-none-manylinux_2_18_x86_64.whl", False),  # no ABI, one platform
        ("pyyaml-6.0.3-cp312-cp312-manylinux2014_x86_64.whl", False),
        ("fvcore-0.1.5.post20221221.tar.gz", False),
    ],
)
def test_a_pure_wheel_has_no_abi_and_any_platform(file, pure):
    assert wheelhouse.is_pure(file) is pure


def test_requirements_of_the_checkout():
    requirements = wheelhouse.read_requirements(ROOT)
    assert requirements.node_own == ["torch>=2.4"]
    assert "fvcore>=0.1.5" in requirements.rest and not any("torch" in r for r in requirements.rest)
    assert {"pytest>=8", "hypothesis>=6"} <= set(requirements.rest)  # the node runs the tests first
    assert {"pytest", "hypothesis"} <= requirements.tools and "jinja2" not in requirements.tools
    assert requirements.build == ["setuptools>=68"]  # pip install -e . builds with it on the node


@pytest.mark.parametrize("name", ["torch", "Triton", "nvidia-cudnn-cu12", "nvidia_nccl_cu12"])
def test_the_nodes_own_by_name(name):
    assert wheelhouse.is_node_own(name)
    assert not wheelhouse.is_node_own("torchvision") and not wheelhouse.is_node_own("jinja2")


def _fake_pip(compiled_sdist: str | None = None):
    """pip as the helper calls it, offline: a resolution of RESOLVED, and wheels named as pip names them."""

    def pip(command, *args):
        if command == "install":
            report = Path(args[args.index("--report") + 1])
            items = [
                {
                    "metadata": {"name": r.name, "version": r.version},
                    "download_info": {"url": f"https://files.example/{r.file}"},
                }
                for r in RESOLVED
            ]
            report.write_text(json.dumps({"install": items}))
            return
        dest = Path(args[args.index("--dest" if command == "download" else "--wheel-dir") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        for pin in (a for a in args if "==" in a):
            name, version = pin.split("==")
            tags = (
                "cp312-cp312-manylinux2014_x86_64"
                if command == "download" or name == compiled_sdist
                else "py3-none-any"
            )
            (dest / f"{name}-{version}-{tags}.whl").write_bytes(b"wheel")
        if command == "wheel":
            (dest / "switchbench-0.1.0-py3-none-any.whl").write_bytes(b"wheel")

    return pip


def test_a_wheelhouse_of_pure_wheels_names_what_the_node_must_have(tmp_path, monkeypatch, capsys):
    """Pure wheels, and a binary test tool's fetched for the GPU nodes' Python and platforms (the node keeps its
    numpy): without it pip installed nothing there, the tests' requirement unmet."""
    fake, downloads = _fake_pip(compiled_sdist="fvcore"), []

    def pip(command, *args):
        downloads.extend([args] if command == "download" else [])
        fake(command, *args)

    monkeypatch.setattr(wheelhouse, "_pip", pip)
    assert main(["wheelhouse", str(tmp_path / "house"), "--source", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "house").iterdir()) == [
        "Jinja2-3.1.6-py3-none-any.whl",
        "hypothesis-6.170.17-cp312-cp312-manylinux2014_x86_64.whl",
        "switchbench-0.1.0-py3-none-any.whl",
        "tzdata-2026.6-py3-none-any.whl",
    ]
    (args,) = downloads
    assert args[args.index("--python-version") + 1] == "3.12" and "manylinux_2_28_x86_64" in args
    must_have = out.split("The node must already have (left out):\n")[1].split("\nOn the node")[0]
    assert [line.split()[0] for line in must_have.splitlines()] == ["torch>=2.4", "numpy", "fvcore"]
    assert (
        out.splitlines()[-1]
        == f"  python3 -m pip install --no-index --find-links {tmp_path / 'house'} -e '{ROOT}[node-test]'"
    )


def test_a_target_gets_its_binary_wheels(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(wheelhouse, "_pip", _fake_pip())
    argv = [
        "wheelhouse",
        str(tmp_path),
        "--source",
        str(ROOT),
        "--python-version",
        "3.12",
        "--platform",
        "manylinux2014_x86_64",
    ]
    assert main(argv) == 0
    assert (tmp_path / "numpy-2.4.6-cp312-cp312-manylinux2014_x86_64.whl").exists()
    assert (tmp_path / "fvcore-0.1.5.post20221221-py3-none-any.whl").exists()
    assert not list(tmp_path.glob("torch*")) and not list(tmp_path.glob("triton*"))
    must_have = capsys.readouterr().out.split("(left out):\n")[1].split("\nOn the node")[0]
    assert [line.split()[0] for line in must_have.splitlines()] == ["torch>=2.4"]


def _no_wheels(command, *args):
    """pip finding no wheel for the target: as it fails for a platform tag no wheel carries (linux_x86_64)."""
    if command == "download":
        raise RuntimeError("pip download: ERROR: No matching distribution found for numpy==2.4.6")
    _fake_pip()(command, *args)


@pytest.mark.parametrize("existing", [False, True], ids=["made for the run", "there before"])
def test_a_target_without_wheels_is_exit_2_and_leaves_no_folder_behind(
    existing, tmp_path, monkeypatch, capsys
):
    """`--platform linux_x86_64` gave exit 3 and an empty folder that looked like a wheelhouse. A folder that was
    there before keeps what it held."""
    monkeypatch.setattr(wheelhouse, "_pip", _no_wheels)
    house = tmp_path / "house"
    if existing:
        house.mkdir()
        (house / "kept-1.0-py3-none-any.whl").write_bytes(b"wheel")
    argv = ["wheelhouse", str(house), "--source", str(ROOT), "--platform", "linux_x86_64"]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "--platform linux_x86_64: No matching distribution found for numpy==2.4.6" in line
    assert "manylinux_2_28_x86_64" in line
    assert [p.name for p in tmp_path.iterdir()] == (["house"] if existing else [])
    assert not existing or [p.name for p in house.iterdir()] == ["kept-1.0-py3-none-any.whl"]


def test_without_a_target_pip_failing_is_the_machine_s_exit_3(tmp_path, monkeypatch, capsys):
    """The GPU nodes' own tags not found means the index or the network, not the user's input."""
    monkeypatch.setattr(wheelhouse, "_pip", _no_wheels)
    assert main(["wheelhouse", str(tmp_path / "house"), "--source", str(ROOT)]) == 3
    assert "No matching distribution" in capsys.readouterr().err and not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("where", "message"),
    [
        (lambda tmp: tmp / "file", "is a file, not a folder"),
        (lambda tmp: tmp / "file" / "inside", "cannot make this folder"),
    ],
)
def test_a_folder_that_is_not_one_is_exit_2_in_one_line(tmp_path, capsys, where, message):
    (tmp_path / "file").write_text("")
    assert main(["wheelhouse", str(where(tmp_path)), "--source", str(ROOT)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("switchbench wheelhouse: error: ") and message in line


@pytest.mark.parametrize("tag", ["bad tag", "manylinux-2-28", "Linux_x86_64"])
def test_a_platform_that_is_no_tag_is_refused_before_pip(tag, tmp_path, capsys):
    """Given to pip, it was matched against no wheel, offline after a long wait for the index."""
    with pytest.raises(SystemExit) as refused:  # argparse's own exit, as for any flag's type
        main(["wheelhouse", str(tmp_path / "w"), "--platform", tag])
    assert refused.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"{tag!r} is not a platform tag" in line and not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "pyproject, says",
    [
        (None, "no pyproject.toml there"),
        ("name = [", "pyproject.toml is not readable TOML"),  # it named no file
        ('[project]\nname = "switchbench"\n', "pyproject.toml has no 'dependencies' table or list"),  # exit 3
    ],
)
def test_a_source_that_is_not_the_checkout_is_exit_2(pyproject, says, tmp_path, capsys):
    if pyproject is not None:
        (tmp_path / "pyproject.toml").write_text(pyproject)
    assert main(["wheelhouse", str(tmp_path / "house"), "--source", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and not (tmp_path / "house").exists()


def _installed_with_requirements(names: list[str]) -> list[importlib.metadata.Distribution]:
    """The distributions ``names`` installed here, and those they require here, recursively."""
    found, todo = {}, list(names)
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        if wheelhouse.canonical(dist.metadata["Name"]) not in found:
            found[wheelhouse.canonical(dist.metadata["Name"])] = dist
            requirements = (Requirement(r) for r in dist.requires or [])
            todo += [r.name for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    return list(found.values())


def _node_site(folder: Path, names: list[str]) -> Path:
    """A site folder of links to this environment's installed files of ``names`` and their requirements."""
    folder.mkdir()
    for dist in _installed_with_requirements(names):
        tops = {Path(f).parts[0] for f in dist.files} - {"..", "__pycache__"}
        for top in tops - {p.name for p in folder.iterdir()}:
            (folder / top).symlink_to(Path(dist.locate_file(top)))
    return folder


def _registry_reachable(tmp_path: Path) -> bool:
    probe = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "--dest",
        str(tmp_path),
        "tabulate",
    ]
    return subprocess.run(probe, capture_output=True).returncode == 0


# What pip says when the registry, not the recipe, failed (after its retries): a package it found a moment ago is
# then listed with no versions at all
REGISTRY_FAILURES = (
    "from versions: none",
    "Max retries exceeded",
    "ConnectionError",
    "Read timed out",
    "Temporary failure in name resolution",
    "HTTP error 5",
)


@pytest.mark.slow
def test_the_readme_recipe_installs_offline_from_the_wheelhouse_beside_the_nodes_own_torch(tmp_path):
    """The node's own python is emulated by a fresh virtual environment (an H100 node's python3 was one) that sees,
    through a .pth file, a folder of links to this environment's torch with what torch requires, and the binary
    packages the helper says the node must already have (numpy, pandas, matplotlib ...). The recipe installs into
    that environment itself, with its own python.
    It lacks everything else, fvcore and its dependencies and switchbench included. pip reads no configuration
    (no index, no find-links of this machine) and is given --no-index: the wheelhouse alone must complete it."""
    if not _registry_reachable(tmp_path / "probe"):
        pytest.skip("the package registry is unreachable: the wheelhouse is built from it")
    # the emulated node runs this machine's Python: the test tools' binary wheels are fetched for it
    this_python = f"{sys.version_info.major}.{sys.version_info.minor}"
    # built from a copy: pip builds in the tree's build/ and egg-info, which other workers' tests read
    source = tmp_path / "source"
    shutil.copytree(
        ROOT / "switchbench", source / "switchbench", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    try:
        house = wheelhouse.build(tmp_path / "wheelhouse", source, node_python=this_python)
    except RuntimeError as error:  # the registry answered the probe; a failure of its own now is no finding
        if not any(sign in str(error) for sign in REGISTRY_FAILURES):
            raise
        pytest.skip(f"the package registry failed mid-build: {error}")
    files = {wheelhouse.canonical(w.split("-")[0]): w for w in house.wheels}  # name-version-tags.whl
    assert {"switchbench", "fvcore", "iopath", "yacs", "termcolor", "tabulate", "setuptools"} <= set(files)
    tools = wheelhouse.read_requirements(ROOT).tools
    assert "hypothesis" in files and "pytest" in tools
    assert all(
        (wheelhouse.is_pure(w) or n in tools) and not wheelhouse.is_node_own(n) for n, w in files.items()
    )
    node_own = [wheelhouse.requirement_name(line) for line in house.node_must_have]
    assert node_own[0] == "torch" and "numpy" in node_own

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    node_site = _node_site(tmp_path / "node-site", node_own)
    Path(site, "node.pth").write_text(f"{node_site}\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PIP_CONFIG_FILE": os.devnull}
    # with the node-test extra, as the recipe says: the chain's test steps need pytest-reportlog (an H100 lacked it)
    pip = [
        python,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--find-links",
        str(house.folder),
        "switchbench[node-test]",
    ]
    done = subprocess.run(pip, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def on_the_node(*command):
        return subprocess.run(command, cwd=elsewhere, capture_output=True, text=True, env=env)

    where = on_the_node(
        python,
        "-c",
        "import fvcore, hypothesis, pytest_reportlog, switchbench, torch as t;"
        "print(switchbench.__file__, fvcore.__file__, t.__file__)",
    ).stdout.split()
    assert where[0].startswith(site) and where[1].startswith(site)  # from the wheelhouse
    assert where[2].startswith(str(node_site))  # the node's own
    presets = on_the_node(venv / "bin" / "switchbench", "presets")
    assert presets.returncode == 0 and "tiny-switchhead" in presets.stdout, presets.stderr
    count = on_the_node(venv / "bin" / "switchbench", "count", "tiny-switchhead", "--json")
    assert count.returncode == 0, count.stderr
    views = json.loads(count.stdout)
    assert (
        views["macs_fvcore"] == views["macs_exact"] == views["macs_flop_counter"]
    )  # fvcore of the wheelhouse
