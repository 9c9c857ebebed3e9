"""The code a gate's baseline was recorded with, as a folder a timed run can start from: extracted from git at the
baseline's commit, or from the archive of that package committed beside the baseline.

git alone left the gate without a reference wherever a checkout lacks the commit: a shallow clone (a CI's default
fetch depth of 1 or 20 against a baseline 255 commits back), a copy without ``.git``, a repository owned by another
user (git refuses it: "dubious ownership"). The gate then fell back to the committed ratios, whose verdict depends
on the processor: unchanged code came within 10% of failing on a Xeon against an EPYC's ratios. The archive (about
300 KB, written by ``check --write`` and named in the baseline with its SHA-256) makes the reference available in
any checkout, so the verdict is the side-by-side one everywhere.
"""

import gzip
import hashlib
import io
import re
import subprocess
import tarfile
from pathlib import Path

import switchbench

# The folder holding the package that is running: the code under test (a checkout, or a worktree run with -m)
HERE = Path(switchbench.__file__).resolve().parents[1]


class NoReference(Exception):
    """The reference commit cannot be materialised here; the message says why."""


def is_commit_id(commit: str) -> bool:
    """Whether ``commit`` names one commit for good: a hash, not HEAD, a branch or a tag (the gate would time what
    it names then, the code under test itself), nor a hash with uncommitted changes (``-dirty``: the gate would
    time the commit without them)."""
    return re.fullmatch(r"[0-9a-f]{7,40}", commit) is not None


def materialise(commit: str, dest: Path, checkout: Path = HERE) -> Path:
    """The package as it was at ``commit``, extracted from git under ``dest``; the folder to run it from."""
    _extract(_package_tar(commit, checkout), dest)
    return dest


def package_archive(commit: str, checkout: Path = HERE) -> tuple[bytes, str]:
    """The package at ``commit`` as a gzipped tar, byte for byte the same for the same commit (no timestamps in the
    gzip header), and its SHA-256."""
    data = gzip.compress(_package_tar(commit, checkout), compresslevel=9, mtime=0)
    return data, hashlib.sha256(data).hexdigest()


def unpack_archive(archive: Path, sha256: str, dest: Path) -> Path:
    """The package in ``archive``, extracted under ``dest``, if its SHA-256 is ``sha256``: an archive that is not the
    one the baseline names (edited, truncated, another commit's) is no reference."""
    try:
        data = archive.read_bytes()
    except OSError as error:
        raise NoReference(f"cannot read the reference archive {archive}: {error.strerror}") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise NoReference(
            f"the reference archive {archive} is not the one the baseline names (its SHA-256 differs)"
        )
    _extract(gzip.decompress(data), dest)
    return dest


def _package_tar(commit: str, checkout: Path) -> bytes:
    """``git archive`` of the switchbench package at ``commit``."""
    found = _git(checkout, "cat-file", "-e", f"{commit}^{{commit}}")
    if found.returncode:
        why = _first_line(found.stderr)
        history = "a shallow clone or a copy?" if not why or "Not a valid" in why else why
        raise NoReference(f"commit {_short(commit)} is not in {checkout}'s history ({history})")
    if _git(checkout, "cat-file", "-e", f"{commit}:switchbench").returncode:
        raise NoReference(f"commit {_short(commit)} has no switchbench package")
    tar = _git(checkout, "archive", "--format=tar", commit, "switchbench")
    if tar.returncode:
        raise NoReference(f"git archive of {_short(commit)} failed: {_first_line(tar.stderr)}")
    return tar.stdout


def _short(commit: str) -> str:
    """A hash as git abbreviates it; any other name (a branch, a tag) whole."""
    return commit[:12] if is_commit_id(commit) else commit


def _git(checkout: Path, *args: str) -> subprocess.CompletedProcess:
    # safe.directory: reading a checkout another user owns (a CI container's) is what the gate does, not a risk
    command = ["git", "-c", "safe.directory=*", "-C", str(checkout), *args]
    try:
        return subprocess.run(command, capture_output=True)
    except OSError:
        raise NoReference("git is not installed") from None


def _first_line(stderr: bytes) -> str:
    lines = stderr.decode(errors="replace").strip().splitlines()
    return lines[0].removeprefix("fatal: ").removeprefix("error: ") if lines else ""


def _extract(tar: bytes, dest: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(dest, filter="data")
