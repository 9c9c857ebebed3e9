"""``switchbench wheelhouse``: what goes into the wheelhouse of an offline GPU node, and what the node keeps."""

import json
from pathlib import Path

import pytest

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
]


def test_the_nodes_own_are_left_out_and_binary_wheels_set_apart():
    to_build, binary = wheelhouse.select(RESOLVED)
    assert [r.name for r in to_build] == ["fvcore", "Jinja2", "tzdata"]
    assert [r.name for r in binary] == ["numpy"]


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
            items = [{"metadata": {"name": r.name, "version": r.version},
                      "download_info": {"url": f"https://files.example/{r.file}"}} for r in RESOLVED]  # fmt: skip
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
    monkeypatch.setattr(wheelhouse, "_pip", _fake_pip(compiled_sdist="fvcore"))
    assert main(["wheelhouse", str(tmp_path / "house"), "--source", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "house").iterdir()) == [
        "Jinja2-3.1.6-py3-none-any.whl", "switchbench-0.1.0-py3-none-any.whl", "tzdata-2026.6-py3-none-any.whl",
    ]  # fmt: skip
    must_have = out.split("The node must already have (left out):\n")[1].split("\nOn the node")[0]
    assert [line.split()[0] for line in must_have.splitlines()] == ["torch>=2.4", "numpy", "fvcore"]
    assert out.splitlines()[-1] == f"  pip install --no-index --find-links {tmp_path / 'house'} -e {ROOT}"


def test_a_target_gets_its_binary_wheels(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(wheelhouse, "_pip", _fake_pip())
    argv = ["wheelhouse", str(tmp_path), "--source", str(ROOT), "--python-version", "3.12",
            "--platform", "manylinux2014_x86_64"]  # fmt: skip
    assert main(argv) == 0
    assert (tmp_path / "numpy-2.4.6-cp312-cp312-manylinux2014_x86_64.whl").exists()
    assert (tmp_path / "fvcore-0.1.5.post20221221-py3-none-any.whl").exists()
    assert not list(tmp_path.glob("torch*")) and not list(tmp_path.glob("triton*"))
    must_have = capsys.readouterr().out.split("(left out):\n")[1].split("\nOn the node")[0]
    assert [line.split()[0] for line in must_have.splitlines()] == ["torch>=2.4"]


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


def test_a_source_that_is_not_the_checkout_is_exit_2(tmp_path, capsys):
    assert main(["wheelhouse", str(tmp_path / "house"), "--source", str(tmp_path)]) == 2
    assert "no pyproject.toml there" in capsys.readouterr().err
