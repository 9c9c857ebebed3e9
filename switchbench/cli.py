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
from switchbench.reports import report
from switchbench.train import run as train

DEBUG = "SWITCHBENCH_DEBUG"
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
    try:
        with kernels_in_force(args):
            return args.run(args) or 0
    except ValueError as error:
        print(f"switchbench {args.command}: error: {error}", file=sys.stderr)
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
    command = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
        args.command
    ]
    return [
        action.option_strings[0] if action.option_strings else action.metavar or action.dest.upper()
        for action in command._actions
        if (value := getattr(args, action.dest, None)) == "" or (isinstance(value, list) and "" in value)
    ]


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
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="switchbench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
