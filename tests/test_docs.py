"""The README and docs/ show only what works: every `switchbench` command they show parses with the real command
line (the cheap ones run), every flag they name exists, the set-up commands are the ones CI and the main-job test
run, and every relative link reaches a file and its heading.

What counts as a command: a `switchbench ...` line (or `python -m switchbench ...`, `python3 -m
switchbench.wheelhouse ...`, `torchrun ... -m switchbench ...`) in a shell code block (```bash, ```sh or a bare
```), and any inline code span that starts with one, in a table or in prose. Inline spans are synopses: `[...]` is
optional (parsed included), `a|b` and `[x | y]` are alternatives (each parsed once), `X...` and a lone `...` mean
"more of the same" (parsed once), and a capitalised metavariable (PRESET, N, DIR, ...) is parsed with the stand-in
in STAND_INS. A line showing a placeholder nothing can stand in for (SKIPPED: `switchbench COMMAND: error: ...`
is a message format, not a command) is skipped and listed with its reason in pytest's summary."""

import argparse
import dataclasses
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from switchbench import cli
from switchbench.bench.command import config_from_args
from switchbench.bench.timing.speed import GROUPS
from switchbench.models.config import ModelConfig
from switchbench.models.presets import PRESETS
from switchbench.train.run import run_name

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "shell", ""}

# The capitalised metavariables of the synopses, and what is parsed in their place.
STAND_INS = {
    "PRESET": "tiny-switchhead",
    "FAMILY": "switchhead",
    "GROUP": "tiny",
    "N": "2",
    "SECONDS": "60",
    "DIR": "out",
    "FILE": "file.txt",
    "FILE.tar.gz": "evidence.tar.gz",
    "RUN": "run.json",
    "CHECKPOINT": "runs/lm-tiny-switchhead/checkpoint.pt",
    "TEXT": "hello",
    "V": "3.12",
    "TAG": "manylinux2014_x86_64",
    "BACKEND": "inductor",
    "REV": "HEAD~1",
    "FOLDER": "out",
    "$SINCE": "1795000000",  # a shell variable holding `date +%s`
}
# Placeholders nothing can stand in for: a line that shows one is skipped (and listed) rather than parsed.
SKIPPED = {"COMMAND": "a message format (docs/errors.md), not a command"}
# Commands run for real when a page shows them with concrete values (a second or two each, torch's import aside) ...
RUN_FAST = {"presets", "params", "count"}
# ... and these, slower, with stand-ins allowed and their output sent under tmp_path.
RUN_SLOW = {"sweep"}  # `tables --out DIR` runs in tests/test_accounting.py
# Flags the pages name that belong to other tools.
FOREIGN_FLAGS = {
    "--system-site-packages": "venv",
    "--no-index": "pip",
    "--find-links": "pip",
    "--nproc_per_node": "torchrun",
    "--nproc-per-node": "torchrun",
    "--standalone": "torchrun",
    "--benchmark-compare": "pytest-benchmark",
    "--benchmark-compare-fail": "pytest-benchmark",
    "--benchmark-disable": "pytest-benchmark",
    "--busy": "benchmarks/gate_reliability.py",
    "--neighbour": "benchmarks/gate_reliability.py",
}
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


@dataclasses.dataclass(frozen=True)
class Shown:
    """One command as a page shows it: the arguments after `switchbench`, still a synopsis."""

    page: str
    line: int
    text: str  # as the page shows it
    tokens: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"

    @property
    def skipped(self) -> str | None:
        words = {t.strip(":,.") for t in self.tokens}
        return next((f"{word}: {why}" for word, why in SKIPPED.items() if word in words), None)


# Reading the pages


def _split(text: str) -> tuple[list[tuple[str, int, list[str]]], str]:
    """The fenced blocks (info, first line's number, lines), and the text with each block's lines blanked."""
    blocks, prose, fence = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened[1]
            blocks.append((opened[2].lower(), number + 1, []))
            prose.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            else:
                blocks[-1][2].append(line)
            prose.append("")
        else:
            prose.append(line)
    return blocks, "\n".join(prose)


def _spans(prose: str) -> list[tuple[int, str]]:
    """Inline code spans with their line numbers, whitespace collapsed (a span may wrap), table pipes unescaped."""
    spans, offset = [], 0
    for paragraph in re.split(r"(\n\s*\n)", prose):
        for match in SPAN.finditer(paragraph):
            line = prose.count("\n", 0, offset + match.start()) + 1
            spans.append((line, " ".join(match[2].replace("\\|", "|").split())))
        offset += len(paragraph)
    return spans


def _arguments(tokens: list[str]) -> list[str] | None:
    """The switchbench arguments of one shell command, or None when it runs something else."""
    while tokens and re.fullmatch(r"[A-Za-z_]\w*=\S*", tokens[0]):  # VAR=value before the command
        tokens = tokens[1:]
    if tokens[:1] == ["switchbench"]:
        return tokens[1:]
    for i, token in enumerate(tokens[:-1]):
        if token == "-m" and tokens[i + 1] == "switchbench":
            return tokens[i + 2 :]
        if token == "-m" and tokens[i + 1] == "switchbench.wheelhouse":
            return ["wheelhouse", *tokens[i + 2 :]]
    return None


def _shell_commands(lines: list[str]) -> list[tuple[int, list[str]]]:
    """(line offset, shell words) of every command of a shell block: continuations joined, comments dropped, split
    at &&, ||, ; and |."""
    commands, pending, start = [], "", 0
    for offset, line in enumerate(lines):
        start = offset if not pending else start
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        command: list[str] = []
        for word in [*shlex.split(pending, comments=True), "&&"]:
            if word in {"&&", "||", ";", "|"}:
                if command:
                    commands.append((start, command))
                command = []
            else:
                command.append(word)
        pending = ""
    return commands


def _page_text(page: Path) -> tuple[str, list, str]:
    name = page.relative_to(ROOT).as_posix()
    blocks, prose = _split(page.read_text())
    return name, blocks, prose


def shown_commands() -> list[Shown]:
    shown = []
    for page in PAGES:
        name, blocks, prose = _page_text(page)
        for info, first, lines in blocks:
            if info in SHELL_BLOCKS:
                for offset, words in _shell_commands(lines):
                    arguments = _arguments(words)
                    if arguments:
                        shown.append(Shown(name, first + offset, shlex.join(words), tuple(arguments)))
        for line, span in _spans(prose):
            arguments = _arguments(re.findall(r"\[|\]|[^\s\[\]]+", span))
            if arguments:
                shown.append(Shown(name, line, span, tuple(arguments)))
    return shown


SHOWN = shown_commands()


# Synopses


def _group(tokens: list[str], i: int, closing: str | None) -> tuple[list[list], int]:
    """Alternatives up to `closing`: a list of sequences whose items are words or nested alternatives."""
    alternatives: list[list] = []
    sequence: list = []
    while i < len(tokens) and tokens[i] != closing:
        token = tokens[i]
        if token == "[":
            inner, i = _group(tokens, i + 1, "]")
            sequence.append(inner)
        elif token == "|":
            alternatives.append(sequence)
            sequence = []
        elif "|" in token:  # dense|switchhead|moa
            sequence.append([[word] for word in token.split("|")])
        else:
            sequence.append(token)
        i += 1
    if closing and i == len(tokens):
        raise ValueError("a '[' without its ']'")
    return [*alternatives, sequence], i


def _width(alternatives: list[list]) -> int:
    nested = [_width(item) for sequence in alternatives for item in sequence if not isinstance(item, str)]
    return max([len(alternatives), *nested])


def _pick(alternatives: list[list], k: int) -> list[str]:
    words: list[str] = []
    for item in alternatives[k % len(alternatives)]:
        words += [item] if isinstance(item, str) else _pick(item, k)
    return words


def variants(tokens: tuple[str, ...]) -> tuple[list[list[str]], bool]:
    """The argument lists a synopsis stands for (each alternative in one of them), and whether a stand-in was
    used. A capitalised word without a stand-in is an error: declare it in STAND_INS."""
    tree, _ = _group(list(tokens), 0, None)
    result, stood_in = [], False
    for k in range(_width(tree)):
        argv = []
        for word in _pick(tree, k):
            if word == "...":
                continue
            word = word.removesuffix("...")
            if word in STAND_INS:
                word, stood_in = STAND_INS[word], True
            elif re.fullmatch(r"[A-Z][A-Z0-9_.]*", word):
                raise ValueError(f"placeholder {word!r} has no stand-in (add it to STAND_INS)")
            argv.append(word)
        if argv not in result:
            result.append(argv)
    return result, stood_in


# Checking one command


class Refused(Exception):
    """What argparse would have printed before exiting with status 2."""


def _parser() -> argparse.ArgumentParser:
    return cli._parser()


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _refuse(self, message):
    raise Refused(f"{self.prog}: {message}")


def parse(argv: list[str]) -> argparse.Namespace:
    with mock.patch.object(cli._Parser, "error", _refuse):
        return _parser().parse_args(argv)


def _run_folder_is_a_preset(path: str) -> bool:
    """runs/<run>/...: <run> is what `train` names a run of some preset (task prefix, -seed<N>)."""
    name = Path(path).parts[1]
    seed = re.search(r"-seed(\d+)$", name)
    return any(
        run_name(task, preset, int(seed[1]) if seed else 0) == name
        for task in ("listops", "lm")
        for preset in PRESETS
    )


def check(argv: list[str]) -> None:
    """Parse as `switchbench` would, then the names argparse takes as free strings: presets, speed groups, the
    configuration (ModelConfig validates it), the runs an analysis reads."""
    try:
        args = parse(argv)
    except Refused as refused:
        # `switchbench check` in prose names the command; its required arguments are shown elsewhere
        if len(argv) == 1 and argv[0] in _commands(_parser()) and "arguments are required" in str(refused):
            return
        raise
    presets = [args.preset] if getattr(args, "preset", None) else []
    presets += getattr(args, "presets", None) or []
    unknown = [p for p in presets if p not in PRESETS]
    assert not unknown, f"unknown presets {unknown}"
    groups = [g for g in getattr(args, "groups", None) or [] if g not in GROUPS]
    assert not groups, f"unknown speed groups {groups}"
    if all(hasattr(args, field.name) for field in dataclasses.fields(ModelConfig)):
        config_from_args(args)  # ValueError on an unknown preset or a value out of range
    runs = [a for a in argv if Path(a).parts[:1] == ("runs",) and len(Path(a).parts) > 2]
    assert all(_run_folder_is_a_preset(r) for r in runs), f"run folders of no preset: {runs}"


@pytest.mark.parametrize("shown", SHOWN, ids=str)
def test_every_command_shown_parses(shown):
    if shown.skipped:
        pytest.skip(f"{shown}: {shown.skipped}")
    try:
        argvs, _ = variants(shown.tokens)
    except ValueError as error:
        pytest.fail(f"{shown}: {error}")
    for argv in argvs:
        try:
            check(argv)
        except (Refused, ValueError, AssertionError) as error:
            pytest.fail(
                f"{shown}\n  parsed as: switchbench {shlex.join(argv)}\n  {type(error).__name__}: {error}"
            )


def test_only_message_formats_are_skipped():
    skipped = [f"{s}  ({s.skipped})" for s in SHOWN if s.skipped]
    assert all(s.page == "docs/errors.md" for s in SHOWN if s.skipped), "skipped:\n" + "\n".join(skipped)


def test_the_pages_show_every_command_and_the_readme_lists_them_all():
    names = set(_commands(_parser()))
    assert {s.tokens[0] for s in SHOWN if not s.skipped} >= names
    table = [s for s in SHOWN if s.page == "README.md" and _is_table_row(s)]
    assert {s.tokens[0] for s in table} == names, "the README's table of commands misses some"


def _is_table_row(shown: Shown) -> bool:
    return (ROOT / shown.page).read_text().splitlines()[shown.line - 1].startswith("| `switchbench ")


def test_every_flag_the_pages_name_exists():
    parser = _parser()
    ours = {flag for sub in _commands(parser).values() for a in sub._actions for flag in a.option_strings}
    named: dict[str, str] = {}
    for page in PAGES:
        name, blocks, prose = _page_text(page)
        texts = [span for _, span in _spans(prose)]
        texts += ["\n".join(lines) for info, _, lines in blocks if info in SHELL_BLOCKS]
        for text in texts:
            for flag in FLAG.findall(text):
                named.setdefault(flag, name)
    unknown = {flag: page for flag, page in named.items() if flag not in ours and flag not in FOREIGN_FLAGS}
    assert not unknown, f"flags no switchbench command has (page where first named): {unknown}"


def _without_out(argv: list[str]) -> list[str]:
    return [*argv[: argv.index("--out")], *argv[argv.index("--out") + 2 :]] if "--out" in argv else argv


def _to_run(kinds: set[str], stand_ins: bool) -> list[list[str]]:
    """The distinct commands of these kinds the pages show, as parsed (their first variant); with stand-ins only
    where allowed; `--out` left out, the test gives its own."""
    runs = []
    for shown in SHOWN:
        if shown.skipped or shown.tokens[0] not in kinds:
            continue
        try:
            argvs, stood_in = variants(shown.tokens)
        except ValueError:  # test_every_command_shown_parses says why
            continue
        argv = _without_out(argvs[0])
        if (stand_ins or not stood_in) and argv not in runs:
            runs.append(argv)
    return runs


def _run(argv: list[str], cwd: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    """`switchbench ARGV` in ``cwd``, in this process (an interpreter's start and torch's import are 3 to 5 s a
    command; tests/test_main_job.py runs `python -m switchbench` as a user does): exit code, stdout, stderr."""
    monkeypatch.chdir(cwd)
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow  # seconds each, in tox
@pytest.mark.parametrize("argv", _to_run(RUN_FAST, stand_ins=False), ids=shlex.join)
def test_the_cheap_commands_run(argv, tmp_path, monkeypatch, capsys):
    code, out, err = _run(argv, tmp_path, monkeypatch, capsys)
    assert code == 0 and out.strip(), f"switchbench {shlex.join(argv)}: {err[-2000:]}"
    assert not list(tmp_path.iterdir()), "a cheap command wrote files"


@pytest.mark.slow
@pytest.mark.parametrize("argv", _to_run(RUN_SLOW, stand_ins=True), ids=shlex.join)
def test_the_slower_commands_run_into_tmp(argv, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    code, _, err = _run([*argv, "--out", str(out)], tmp_path, monkeypatch, capsys)
    assert code == 0, f"switchbench {shlex.join(argv)}: {err[-2000:]}"
    assert any(out.iterdir())


# The set-up


def test_the_readme_set_up_is_what_ci_and_the_main_job_test_run():
    """Two commands: the first installs the pinned CPU torch (tox's pin) and runs `switchbench all --quick`, which
    tests/test_main_job.py runs in a clone; the second is the line .ci/run runs."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Set-up: two commands\n", 1)[1].split("\n## ", 1)[0]
    blocks, _ = _split(section)
    commands = [line for info, _, lines in blocks if info == "bash" for line in lines]
    commands = [line for line in commands if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 2, commands
    main_job, tests = commands
    assert main_job.endswith("&& switchbench all --quick")
    pin = re.search(r"torch==[\d.]+", (ROOT / "tox.ini").read_text())
    assert pin and f"pip install {pin[0]} -e ." in main_job
    ci = [
        line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")
    ]
    assert ci[-1] == tests


# Links


def anchors(page: Path) -> Iterator[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    _, prose = _split(page.read_text())
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", prose, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def _tracked() -> set[str] | None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True)
    return set(listed.stdout.split("\0")) if listed.returncode == 0 else None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_reaches_a_file_and_its_heading(page):
    _, prose = _split(page.read_text())
    tracked = _tracked()
    broken = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        relative = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else None
        if relative is None or not file.exists():
            broken.append(f"{target}: no such file in the checkout")
        elif tracked is not None and file.is_file() and relative not in tracked:
            broken.append(f"{target}: not in git (a link to it breaks in a clone)")
        elif anchor and file.suffix == ".md" and anchor not in set(anchors(file)):
            broken.append(f"{target}: no heading #{anchor} in {relative}")
    assert not broken, broken
