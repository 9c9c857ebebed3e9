"""Result files: written whole or not at all, never over an earlier run."""

import collections
import contextlib
import errno
import glob
import io
import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pandas as pd

# replace_together's temporary files are .NAME.RANDOM.tmp; a run removes those of the files it writes.
TEMP_SUFFIX = ".tmp"


def replace_atomically(path: Path, write: Callable[[Path], object]) -> Path:
    """Have ``write`` fill a temporary file beside ``path``, then rename it into place: a reader sees the old
    file or the new one, never half of one."""
    return replace_together({Path(path): write})[0]


def replace_together(writers: dict[Path, Callable[[Path], object]]) -> list[Path]:
    """Fill a temporary file for every path, then rename them all into place in order: a run stopped while
    writing leaves every earlier file as it was (put an index such as metadata.json last), and a rename that
    fails (a file made immutable, a folder in its place) or is interrupted puts back the files renamed before it,
    each that could be kept under a second name (a hard link: not where the file system or its protection
    refuses one)."""
    temps, kept, done = {}, {}, []
    try:
        for path, write in writers.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_temps(path)
            temps[path] = _temp_beside(path)
            write(temps[path])
            os.chmod(temps[path], 0o644)  # mkstemp makes it private; results are for sharing
        try:
            for path, tmp in temps.items():
                kept[path] = _keep(path)
                done.append(path)  # before the rename: an interrupt lands after it, and it must be put back
                os.replace(tmp, path)
        except BaseException:
            for path in reversed(done):
                with contextlib.suppress(OSError):  # the rest still put back, the first error still raised
                    _put_back(path, kept[path])
            raise
    finally:
        for tmp in [*temps.values(), *kept.values()]:
            if isinstance(tmp, Path):
                tmp.unlink(missing_ok=True)
    return list(writers)


def _temp_beside(path: Path) -> Path:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    os.close(fd)
    return Path(tmp)


def _keep(path: Path) -> Path | bool:
    """A second name (a hard link) for what is at ``path`` (a symbolic link kept as one), to put it back; False
    where there was nothing, True where there was something that cannot be kept (a folder, or a file system
    without hard links)."""
    if not os.path.lexists(path):
        return False
    if path.is_dir() and not path.is_symlink():
        return True
    kept = _temp_beside(path)
    kept.unlink()
    try:
        os.link(path, kept, follow_symlinks=False)
    except (OSError, NotImplementedError):  # the latter: no link of a link on this platform
        return True
    return kept


def _put_back(path: Path, kept: Path | bool) -> None:
    """The file at ``path`` as it was before its rename (or as it is, where the rename did not happen): its kept
    name renamed over it, or (none before) removed."""
    if isinstance(kept, Path):
        os.replace(kept, path)
    elif not kept:
        path.unlink(missing_ok=True)


def writable_folder(folder: Path, flag: str = "--out") -> Path:
    """``folder`` if results can be written under it (it is, or can be made, a writable folder), else a
    one-line ValueError. The folder is made and a file created in it, then both removed: what is checked is
    what the work will do, so a place the mode bits allow but the file system refuses (/proc, a read-only
    mount) is found here, and a command that stops later leaves no empty folder behind."""
    folder = Path(folder)
    existing = _nearest_existing(folder, flag)
    refused = _refused(existing)
    if refused == FILE:
        where = "is a file" if existing == folder else f"is inside {existing}, a file"
        raise ValueError(f"{flag} {folder} {where}, not a folder")
    if refused:
        raise ValueError(f"{flag} {folder}: {existing} is not writable")
    _try_writing(folder, existing, ".switchbench-probe.", flag, folder)
    return folder


def writable_file(path: Path | str, flag: str = "--out") -> Path:
    """``path`` if a file can be written there, else a one-line ValueError; checked as
    :func:`writable_folder` checks, by making its folder and a temporary file beside it, then removing them. A
    path as typed that ends in a slash names a folder (Path would drop the slash and write a file of that name)."""
    if isinstance(path, str) and path.endswith(("/", os.sep)):
        raise ValueError(f"{flag} {path} names a folder; give a file name")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name")
    if path.exists() and not path.is_file():  # /dev/null, a FIFO: a rename would replace the node itself
        raise ValueError(f"{flag} {path} is not a regular file; give a file name")
    existing = _nearest_existing(path.parent, flag)
    refused = _refused(existing)
    if refused == FILE:
        raise ValueError(f"{flag} {path} is inside {existing}, a file, not a folder")
    if refused:
        raise ValueError(f"{flag} {path}: {existing} is not writable")
    _try_writing(path.parent, existing, f".{path.name}.", flag, path)
    return path


FILE, NOT_WRITABLE = "a file", "not writable"


def _refused(existing: Path) -> str | None:
    """Why nothing can be made below ``existing``, the nearest part of a path that exists (FILE, NOT_WRITABLE), or
    None. A folder that is gone since it was found is no refusal: a parallel check made it and removed it (the
    evidence chain starts three trainings at once into a new runs folder), and the making goes down from the
    folder above it."""
    try:
        mode = existing.stat().st_mode  # one call: a folder removed meanwhile is not taken for a file
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(mode):
        return FILE
    # os.access is false for a folder gone meanwhile too
    if not os.access(existing, os.W_OK | os.X_OK) and existing.exists():
        return NOT_WRITABLE
    return None


def _try_writing(folder: Path, existing: Path, prefix: str, flag: str, given: Path) -> None:
    """Make the folders from ``existing`` down to ``folder`` and a temporary file in it (for a file, named as
    replace_together names its temporary, so one left by a kill is removed by the next write), then remove all
    of them; a one-line ValueError where the file system refuses."""
    missing = [folder, *folder.parents]
    missing = missing[: missing.index(existing)]
    made, doing = [], ""
    try:
        for step in reversed(missing):
            doing = f"cannot make {step}"
            made += _make_folder(step)
        doing = f"cannot create a file in {folder}"
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=TEMP_SUFFIX)
        os.close(fd)
        os.unlink(tmp)
    except OSError as error:
        raise ValueError(f"{flag} {given}: {doing}: {error.strerror}") from None
    finally:
        for step in reversed(made):
            try:
                step.rmdir()
            except FileNotFoundError:  # a parallel check removed it, empty, as it removes its own
                continue
            # another process (a parallel run) is writing in it since: it is its folder now
            except OSError as error:
                if error.errno != errno.ENOTEMPTY:
                    raise
                break


def _make_folder(folder: Path, tries: int = 8) -> list[Path]:
    """Make ``folder``; -> the folders made, outermost first (none where it was there). A parallel check (the
    evidence chain starts three trainings at once into one new runs folder) removes the parent it made as this one
    goes down, even the one this check found there: that parent is made again (three processes at once needed a
    second time about once in 300, so a few ``tries``)."""
    try:
        folder.mkdir()
        return [folder]
    except FileExistsError:  # made meanwhile, or a/.. on the way to a/../b
        return []
    except FileNotFoundError:
        # tries spent: a missing part no parallel check explains (a dangling link on the way, say); or the root
        if tries <= 1 or folder.parent == folder:
            raise
        return _make_folder(folder.parent) + _make_folder(folder, tries - 1)


def _remove_stale_temps(path: Path) -> None:
    """The temporary files of ``path`` that a killed run left (ours: mkstemp's 8 random characters)."""
    for temp in path.parent.glob(f".{glob.escape(path.name)}.*{TEMP_SUFFIX}"):
        if len(temp.name) == len(path.name) + 2 + 8 + len(TEMP_SUFFIX):
            temp.unlink(missing_ok=True)


def _nearest_existing(path: Path, flag: str) -> Path:
    try:
        while not path.exists() and path != path.parent:
            path = path.parent
    except OSError as error:
        raise ValueError(f"{flag} {path}: {error.strerror}") from None
    return path


def write_atomic(path: Path, text: str) -> Path:
    return replace_atomically(path, lambda tmp: tmp.write_text(text))


def new_figure(**options):
    """A matplotlib Figure, made without pyplot (no global figure state, no backend choice). matplotlib is
    imported here, not at the top: 0.4 s at every command's start, which only the commands that draw should pay."""
    from matplotlib.figure import Figure

    return Figure(**options)


def save_figure(
    fig, stem: Path, dpi: int = 100, also: dict[Path, Callable[[Path], object]] | None = None
) -> list[Path]:
    """A matplotlib figure as STEM.png and STEM.svg, and the files of ``also`` (path -> writer, e.g. the numbers
    behind the figure and its metadata), all renamed into place together once every one is written: a run stopped
    on the way leaves the earlier set whole. A pyplot figure is closed."""
    box = _tight_box(fig)
    # the layout found for the box kept for both files: each savefig would run the layout engine again (two thirds
    # of the time saving 18 heat maps took)
    engine = fig.get_layout_engine()
    fig.set_layout_engine("none")

    def draw(fmt: str) -> Callable[[Path], object]:
        return lambda tmp: fig.savefig(tmp, format=fmt, dpi=dpi, bbox_inches=box)

    images = {Path(stem).with_suffix(f".{fmt}"): draw(fmt) for fmt in ("png", "svg")}
    try:
        written = replace_together(images | (also or {}))
    finally:
        fig.set_layout_engine(engine)
    if (
        "matplotlib.pyplot" in sys.modules
    ):  # a figure made with pyplot is closed (pyplot costs 0.7 s to import)
        sys.modules["matplotlib.pyplot"].close(fig)
    return written


def _tight_box(fig):
    """The box ``bbox_inches="tight"`` would crop ``fig`` to, found once for both formats: each savefig with
    "tight" lays the figure out and measures every text again (a fifth of a routing analysis' time)."""
    import matplotlib

    fig.draw_without_rendering()  # the layout engine places the axes first, as savefig does
    return fig.get_tightbbox().padded(matplotlib.rcParams["savefig.pad_inches"])


def new_run_stem(folder: Path, label: str) -> Path:
    """``folder/label``, or ``folder/label-2``, ... : the first stem that names nothing in the folder (its .json,
    .csv or figures; a folder of such a name made the rename fail after the work)."""
    stem, n = Path(folder) / label, 1
    while _taken(stem):
        n += 1
        stem = Path(folder) / f"{label}-{n}"
    return stem


def _taken(stem: Path) -> bool:
    """Whether a file or folder named ``stem.*`` or ``stem-summary.*`` (quality's) exists."""
    name = glob.escape(stem.name)
    return any(stem.parent.glob(f"{name}.*")) or any(stem.parent.glob(f"{name}-summary.*"))


def refuse_folders_named_as_files(folder: Path, suffixes: tuple[str, ...], flag: str = "--out") -> None:
    """A one-line ValueError where ``folder`` holds a folder named as a file of ``suffixes``: a command whose
    outputs' names depend on its inputs (an analysis' models) would fail renaming into it after the work."""
    taken = sorted(p for p in Path(folder).glob("*") if p.is_dir() and p.suffix in suffixes)
    if taken:
        raise ValueError(f"{flag} {folder}: {taken[0].name} is a folder where a file of that name goes")


def frame(rows: list[dict] | pd.DataFrame) -> pd.DataFrame:
    """Rows as a table with a column for every key of any row; integer columns stay integers where cells are
    missing (pandas would make them floats)."""
    if isinstance(rows, pd.DataFrame):
        return rows
    table = pd.DataFrame(rows)
    for name in table.columns:
        values = [row[name] for row in rows if row.get(name) is not None]
        if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            table[name] = table[name].astype("Int64")
    return table


def write_csv(path: Path, rows: list[dict] | pd.DataFrame) -> Path:
    """Rows as CSV, full precision, missing cells empty; written atomically."""
    return replace_atomically(path, csv_writer(rows))


def csv_writer(rows: list[dict] | pd.DataFrame) -> Callable[[Path], object]:
    """What :func:`write_csv` writes, as a writer for :func:`replace_together`."""
    return lambda path: frame(rows).to_csv(path, index=False)


def read_csv(path: Path) -> pd.DataFrame:
    """A CSV written by :func:`write_csv`, or shipped as package data; empty cells become missing values. A file
    whose last line has no end was cut off mid-row (every writer here ends its rows): a ValueError naming it, not a
    table whose last row is filled with missing values."""
    with path.open(newline="") as f:
        text = f.read()
    if text and not text.endswith(("\n", "\r")):
        raise ValueError(f"{path}: cut off mid-row (its last line has no end)")
    return pd.read_csv(io.StringIO(text))


def newest(folder: Path, pattern: str = "*.json") -> Path | None:
    """The newest run matching ``pattern`` under ``folder``, or None: by the time its metadata records, else by when
    the file was written (a checkout gives every committed file about one modification time, and rewriting a file's
    metadata makes it no newer a run)."""
    runs = (p for p in Path(folder).glob(pattern) if p.is_file())  # not a link to nothing, nor a folder
    files = sorted(runs, key=lambda p: (recorded_time(p), p.stat().st_mtime))
    return files[-1] if files else None


def recorded_time(path: Path) -> str:
    """The ISO time a run's JSON records in its metadata, or "" where it records none or cannot be read."""
    try:
        metadata = json.loads(Path(path).read_text()).get("metadata")
    except (OSError, ValueError, AttributeError):
        return ""
    return recorded(metadata) if isinstance(metadata, dict) else ""


def recorded(metadata: dict) -> str:
    """The ISO time ``metadata`` records, or "" (none, or not a text: runs are ordered by it)."""
    time = metadata.get("time", "")
    return time if isinstance(time, str) else ""


def save_run(folder: Path, label: str, metadata: dict, rows: list[dict], stem: Path | None = None) -> Path:
    """``label.json`` (metadata + rows) and ``label.csv`` (rows) under ``folder``, or over ``stem``'s two files (a
    run saved as it goes); returns the JSON path."""
    stem = stem or new_run_stem(folder, label)
    write_csv(stem.with_suffix(".csv"), rows)
    payload = json.dumps({"metadata": metadata, "rows": rows}, indent=2, allow_nan=False)  # strict JSON
    return write_atomic(stem.with_suffix(".json"), payload)


def nothing_measured(rows: list[dict], command: str, saved: Path, timed: str = "ms") -> int:
    """1, with one line on stderr, when no row of a run has a time (``timed``; every case OOM, skipped or wrong);
    else 0."""
    if any(timed in row for row in rows):
        return 0
    statuses = collections.Counter(row.get("status", "?") for row in rows if "status" in row)
    why = ", ".join(f"{n} {status}" for status, n in statuses.items()) or "no case ran"
    print(
        f"switchbench {command}: nothing measured: every case was OOM or unsupported ({why}); the rows are in "
        f"{saved}",
        file=sys.stderr,
    )
    return 1
