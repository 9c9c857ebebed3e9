"""The ``switchbench`` command line: it only collects the commands, each declared beside what it runs."""

import argparse
import atexit
import gc
import os
import sys

from switchbench import wheelhouse
from switchbench.analysis import analyze, quality
from switchbench.bench.command import kernels_in_force
from switchbench.bench.cost import params, scaling, tables
from switchbench.bench.inference import decode
from switchbench.bench.kernels import bench as kernels
from switchbench.bench.kernels import check as kernel_check
from switchbench.bench.kernels import tune as kernel_tune
from switchbench.bench.timing import gate, profile, same_machine, speed
from switchbench.jobs import evidence, main_job
from switchbench.models import family as registry
from switchbench.models.config import LARGEST_INT
from switchbench.reports import report
from switchbench.train import run as train

DEBUG = "SWITCHBENCH_DEBUG"
DESCRIPTION = (
    "Benchmarks and analysis of Mixture-of-Experts attention: SwitchHead against dense, MoA, GQA and MoH in "
    "parameters, MACs, memory, wall-clock, quality and routing. `switchbench COMMAND --help` says more; "
    "`switchbench all --quick` runs the main job on the CPU."
)
COMMANDS = (
    params,
    tables,
    scaling,
    speed,
    gate,
    same_machine,
    decode,
    kernels,
    kernel_tune,
    kernel_check,
    profile,
    train,
    quality,
    analyze,
    report,
    main_job,
    evidence,
    wheelhouse,
)


def main(argv: list[str] | None = None) -> int:
    """The command line; ``argv`` None (sys.argv's) is a process run as the program, whose heap is settled first."""
    if argv is None:
        _settle_heap()
    broken = registry.load_errors()
    if broken:  # an installed attention family that does not load: say which, run nothing
        print(f"switchbench: error: {broken[0]}", file=sys.stderr)
        return 2
    parser = _parser()
    args = parser.parse_args(argv)
    empty = _empty_values(parser, args)
    if empty:  # `--out "$DIR"` with DIR unset: '' read as a path is the current folder, or the default
        print(f"switchbench {args.command}: error: {empty[0]} is empty; give a value", file=sys.stderr)
        return 2
    oversized = _oversized_values(parser, args)
    if oversized:  # a count or size past 32 bits would reach torch as an overflow, or start endless work
        flag, value = oversized[0]
        print(
            f"switchbench {args.command}: error: {flag} must be <= {LARGEST_INT}; got {value}",
            file=sys.stderr,
        )
        return 2
    threads, cores = getattr(args, "threads", None), os.cpu_count() or 1
    if threads is not None and threads > cores:  # past the cores, OpenMP runs out of threads or memory
        print(
            f"switchbench {args.command}: error: --threads must be <= {cores} (this machine's cores); got {threads}",
            file=sys.stderr,
        )
        return 2
    try:
        with kernels_in_force(args):
            return args.run(args) or 0
    except ValueError as error:
        print(f"switchbench {args.command}: error: {_one_line(str(error))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `switchbench presets | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        return 0
    except KeyboardInterrupt:  # files are written whole or not at all: nothing to clean up
        print(f"switchbench {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # a bug or the machine (a driver, a compiler): one line, the rest on request
        if os.environ.get(DEBUG):
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(
            f"switchbench {args.command}: failed: {type(error).__name__}: {first} ({DEBUG}=1 shows the traceback)",
            file=sys.stderr,
        )
        return 3


def _empty_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The flags (or positionals) given an empty string: no switchbench value means anything empty."""
    return [
        _name(action)
        for action in _command_actions(parser, args)
        if (value := getattr(args, action.dest, None)) == "" or (isinstance(value, list) and "" in value)
    ]


# Integers the 32-bit ceiling does not hold: a seed names a stream (torch takes 64 bits), and a token budget is a
# total that a full-scale run passes (its steps, which the kernels see, stay small)
NOT_SIZES = {"seed", "tokens"}


def _oversized_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[str, int]]:
    """The flags given a count or size past :data:`LARGEST_INT`, with the first such value of each."""
    found = []
    for action in _command_actions(parser, args):
        if action.dest in NOT_SIZES:
            continue
        value = getattr(args, action.dest, None)
        big = [v for v in (value if isinstance(value, list) else [value]) if _is_int(v) and v > LARGEST_INT]
        if big:
            found.append((_name(action), big[0]))
    return found


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _command_actions(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[argparse.Action]:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[args.command]._actions


def _name(action: argparse.Action) -> str:
    return action.option_strings[0] if action.option_strings else action.metavar or action.dest.upper()


def _one_line(message: str) -> str:
    """``message`` on one line: a newline in a path the user gave is shown escaped, as the shell would write it."""
    return message.replace("\r", "\\r").replace("\n", "\\n")


def _settle_heap() -> None:
    """Exempt what the imports made (torch, pandas, the commands) from the garbage collector, as gc.freeze's
    documentation suggests: a full collection then visits the command's own objects only. The benchmarks collect
    between members (to give dead tensors back to the device), and over the imports' 200,000 objects one took
    0.1 s: 50 of them were half of decode's 17 s on the CPU. Unfrozen at exit, for the last collection."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the flags are one --help away), as every other error is."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (--help lists the flags)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="switchbench", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(commands)
    for listed in commands._choices_actions:  # a command's page opens with its line of the list
        page = commands.choices[listed.dest]
        page.description = page.description or listed.help
    return parser


if __name__ == "__main__":
    sys.exit(main())
