"""The speedup regression gate: a speed run's ratios and operator counts against a baseline.

A time ratio regresses when the distribution-free 95% interval of its median, from the run's per-round paired
ratios, lies wholly above its reference x (1 + tolerance). The reference is best a run of the baseline's code timed
on the same machine (``same_machine.py``), else the committed ratio, whose tolerance widens on a machine other than
the one that recorded it (``time_tolerance``). Memory and MAC ratios and operator calls are deterministic and gated
exactly: what a run measures (operator calls, a layer step's saved bytes) against the reference run where there is
one, the cost formulas' counts against the committed ones. With a reference run, each layer's time is held to the
reference's too (``layer_time_verdicts``). Exit codes: 0 pass, 1 regression, 2 unusable input.
"""

import collections
import json
import math
import statistics
from pathlib import Path

import pandas as pd

from switchbench.bench.timing.reference import NoReference, is_commit_id, package_archive
from switchbench.core.results import newest, replace_together, writable_file
from switchbench.core.schema import read_json, read_run
from switchbench.models.presets import PRESETS

TIME = "ratio_time"
# A layer's time over the reference code's, timed at once (the gate's side-by-side runs only), judged from
# MIN_PAIRS pairs of runs at least: one pair cannot tell noise from a slowdown
LAYER_TIME, MIN_PAIRS = "time_vs_reference", 2
EXACT = ("ratio_memory", "ratio_macs", "op_calls")
# Relative slack above the reference before a time ratio counts as a regression. Beside 4 and 6 busy processes on
# the 2-core machine, six gates of unchanged code stayed within 0.975 to 1.054 of the reference timed beside them,
# and six of a SwitchHead attention forward 1.5x slower were all caught (benchmarks/gate_reliability.py;
# docs/speed-and-gate.md, "The regression gate").
TOLERANCES = {TIME: 0.15, "ratio_memory": 0.0, "ratio_macs": 0.0, "op_calls": 0.0}
# A committed time ratio checked on another processor: the gate's SwitchHead/dense ratio moved by up to 26% (the
# top of a 95% interval) between two 2-core Xeon VMs, so only a regression beyond this shows through the machine.
CROSS_MACHINE_TOLERANCE = 0.4
CONFIDENCE = 0.95
# Settings a time ratio depends on: a run and its baseline must agree on them to be compared.
COMPARABLE = (
    "device",
    "dtype",
    "batch",
    "batches",  # each group's sequences a step: "batch" says only "fitted per group" where each was fitted
    "threads",
    "clock",
    "allocator",
    "compile",
    "attention",
    "attention_resolved",  # the kernel each kind of call ran: auto's choice moves with the device and the code
    "cuda_graphs",
    "routing",
    "expert_matmul",  # another implementation makes other ops: grouped_mm's op counts read as a regression
)
# Settings of the machine rather than of the benchmark: a reference run timed here is held to them, the baseline not
MACHINE_SETTINGS = ("device", "allocator")
# What a run recorded before a setting existed ran with
SETTING_DEFAULTS = {"attention": "auto", "cuda_graphs": False, "routing": "auto", "expert_matmul": "auto"}
ROW_FIELDS = ("preset", "scope", "what", "status")


def _setting(metadata: dict, name: str):
    return metadata.get(name, SETTING_DEFAULTS.get(name))


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Order statistics x(k), x(n+1-k) bracketing the median with at least ``confidence``: k is the largest rank
    with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2; no assumption on the distribution."""
    x, n = sorted(values), len(values)
    k, below = 0, 0.0
    while k < n and below + math.comb(n, k) / 2**n <= (1 - confidence) / 2:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        raise ValueError(f"{n} rounds are too few for a {confidence:.0%} interval of the median")
    return x[k - 1], x[n - k]


def row_key(row: dict) -> str:
    return f"{row['preset']} | {row['scope']} | {row['what']}"


def _counted(key: str) -> bool:
    """Whether ``key`` names a row the cost formulas give (speed's count rows), not one a run timed."""
    return key.split(" | ")[1] == "count"


def _malformed(name: str, value) -> bool:
    """Whether a baseline's ``name`` cannot be ``value``: a ratio is a positive number, operator calls a count (a
    ratio of 0, or 1.5 calls, could only ever read as a regression)."""
    if not _is_number(value):
        return True
    return value < 0 or value != int(value) if name == "op_calls" else value <= 0


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive_numbers(values) -> bool:
    return isinstance(values, list) and bool(values) and all(_is_number(v) and v > 0 for v in values)


def load_run(path: Path) -> tuple[Path, dict]:
    """A speed run's JSON (a folder means the newest run under it), checked; its path and its content."""
    path = Path(path)
    if path.is_dir():
        folder, path = path, newest(path, "**/*.json")
        if path is None:
            raise ValueError(f"{folder}: no run (*.json) in this folder")
    run = read_run(path, "speed")
    problem = run_problem(run)
    if problem:
        raise ValueError(f"{path}: {problem}")
    return path, run


def run_problem(run) -> str | None:
    """Why ``run`` is not a usable speed run, or None."""
    if (
        not isinstance(run, dict)
        or not isinstance(run.get("metadata"), dict)
        or not isinstance(run.get("rows"), list)
    ):
        return "not a switchbench speed run (needs 'metadata' and 'rows')"
    if not run["rows"]:  # it was compared, and called measured differently (device None)
        return "a speed run without rows: nothing was measured"
    for i, row in enumerate(run["rows"]):
        missing = [f for f in ROW_FIELDS if not isinstance(row, dict) or not isinstance(row.get(f), str)]
        if missing:
            return f"row {i} has no {', '.join(missing)}: not a speed run (a kernel-bench run?)"
        bad = [name for name in (TIME, *EXACT) if name in row and not _is_number(row[name])]
        if TIME in row and "ratio_time_rounds" not in row:  # a run from before the gate read each round
            return f"row {i} ({row_key(row)}) has no per-round ratios (ratio_time_rounds): a run of an older switchbench"
        if TIME in row and not _positive_numbers(row["ratio_time_rounds"]):
            bad.append("ratio_time_rounds")
        if bad:
            return f"row {i} ({row_key(row)}) has a malformed {', '.join(bad)}"
    return None


def load_baseline(path: Path) -> dict:
    baseline = read_json(path, "baseline file")
    problem = baseline_problem(baseline)
    if problem:
        raise ValueError(f"{path}: {problem}")
    return baseline


def baseline_problem(baseline) -> str | None:
    """Why ``baseline`` cannot gate anything, or None."""
    parts = ("metadata", "tolerances", "ratios")
    if not isinstance(baseline, dict) or not all(isinstance(baseline.get(k), dict) for k in parts):
        return "not a switchbench baseline (needs 'metadata', 'tolerances' and 'ratios')"
    tolerances = baseline["tolerances"]
    if set(tolerances) != set(TOLERANCES) or not all(_is_number(t) and t >= 0 for t in tolerances.values()):
        return f"'tolerances' must give a number >= 0 for each of {', '.join(TOLERANCES)}"
    for key, entry in baseline["ratios"].items():
        if not isinstance(entry, dict) or not entry.keys() - {"baseline"}:
            return f"{key!r} holds no ratio or count"
        unknown = entry.keys() - {"baseline", *TOLERANCES}
        bad = [name for name in entry.keys() & TOLERANCES.keys() if _malformed(name, entry[name])]
        bad += ["baseline"] if not isinstance(entry.get("baseline", ""), str) else []
        if unknown or bad:
            return f"{key!r} has unknown or malformed {', '.join(sorted(unknown | set(bad)))}"
        ratios = entry.keys() - {"baseline", "op_calls"}
        if ratios and "baseline" not in entry:
            return f"{key!r} gives ratios without the preset they are relative to ('baseline')"
        if ratios and key.split(" | ")[0] == entry["baseline"]:
            return f"{key!r} is a ratio of {entry['baseline']} to itself, which cannot fail"
    shipped = baseline.get("reference_archive", {"file": "", "sha256": ""})
    if not (isinstance(shipped, dict) and all(isinstance(shipped.get(k), str) for k in ("file", "sha256"))):
        return "'reference_archive' must give the archive's 'file' and 'sha256'"
    if Path(shipped["file"]).name != shipped["file"]:  # beside the baseline, nowhere else
        return f"'reference_archive' names {shipped['file']!r}: a file beside the baseline, by its name alone"
    if not any(_switchhead_vs_dense(key, entry) for key, entry in baseline["ratios"].items()):
        return "holds no SwitchHead/dense time ratio: it would gate no speedup"
    return None


def _switchhead_vs_dense(key: str, entry: dict) -> bool:
    preset, base = PRESETS.get(key.split(" | ")[0]), PRESETS.get(entry.get("baseline"))
    return (
        TIME in entry
        and bool(preset and base)
        and (preset.attention, base.attention) == ("switchhead", "dense")
    )


def baseline_from(runs: list[dict], tolerances: dict[str, float] = TOLERANCES) -> dict:
    """The gated quantities of one or more runs of one benchmark: ratios against another preset and every row's
    operator calls. A time ratio is the median of the runs' medians, so no one run's shift sets the limit."""
    # the machine too: the committed ratios' tolerance holds on the machine that timed them, so they have one
    differ = [
        k
        for k in (*COMPARABLE, "machine", "commit")  # one commit: the gate times it again as the reference
        if len({repr(_setting(run["metadata"], k)) for run in runs}) > 1
    ]
    if differ:
        raise ValueError(f"the runs were measured differently ({', '.join(differ)})")
    if len({json.dumps(run, sort_keys=True) for run in runs}) < len(runs):
        raise ValueError("the same run is given twice: a baseline pools separate runs")
    rows: dict[str, list[dict]] = {}
    for run in runs:
        for row in run["rows"]:
            if row["status"] == "ok":
                rows.setdefault(row_key(row), []).append(row)
    lost = [f"{row_key(r)} ({r['status']})" for run in runs for r in run["rows"] if r["status"] != "ok"]
    if lost:  # dropped, the baseline would gate nothing of it again
        raise ValueError(
            f"{lost[0]!r} was not measured (and {len(lost) - 1} more): a baseline would not gate it"
        )
    ratios = {}
    for key, same in rows.items():
        if len(same) != len(runs):
            raise ValueError(f"{key!r} is measured in {len(same)} of the {len(runs)} runs")
        entry = _exact_entry(key, same)
        if same[0].get("baseline") and same[0]["baseline"] != same[0]["preset"]:
            entry["baseline"] = same[0]["baseline"]
            if TIME in same[0]:
                entry[TIME] = statistics.median(row[TIME] for row in same)
        else:
            entry = {k: v for k, v in entry.items() if k == "op_calls"}  # no ratio of a preset to itself
        if entry:
            ratios[key] = entry
    metadata = runs[0]["metadata"] | {
        "runs": len(runs),
        "rounds": [run["metadata"].get("rounds") for run in runs],
    }
    return {"metadata": metadata, "tolerances": tolerances, "ratios": ratios}


def _exact_entry(key: str, rows: list[dict]) -> dict:
    entry = {}
    for name in EXACT:
        values = {row[name] for row in rows if name in row}
        if len(values) > 1:
            raise ValueError(f"the runs disagree on the {name} of {key!r}: {sorted(values)}")
        entry |= {name: values.pop()} if values else {}
    return entry


def write_baseline(runs: list[dict], path: Path) -> tuple[Path, str]:
    """``runs`` as the new baseline at ``path``, and beside it the archive of the package at the runs' commit
    (``reference.py``), which it names, the two written together; refused when it would be unusable. Returns the
    path and a line on the archive: where the runs' code is no commit git can give (uncommitted changes, a node's
    copy of the checkout), the baseline is written without one, and the gate can only hold a run to its committed
    ratios."""
    path = Path(path)
    baseline = baseline_from(runs)
    problem = baseline_problem(baseline) or _too_few_rounds(runs)
    if problem:
        raise ValueError(f"refusing to write {path}: the runs' baseline {problem}")
    archive, writers = path.with_name(f"{path.stem}.reference.tar.gz"), {}
    try:
        data, sha256 = package_archive(commit_of(baseline["metadata"]))
        baseline["reference_archive"] = {"file": archive.name, "sha256": sha256}
        writers[archive] = lambda tmp: tmp.write_bytes(data)
        note = f"its package at {baseline['metadata']['commit'][:12]} as {archive}"
    except NoReference as error:
        note = f"no archive of its package ({error}): the gate will hold runs to its committed ratios"
    writers[path] = lambda tmp: tmp.write_text(json.dumps(baseline, indent=2))  # last: it names the archive
    replace_together(writers)
    return path, note


def commit_of(metadata: dict) -> str:
    """The commit whose code the runs measured, or NoReference: the gate times it again as its reference."""
    commit = metadata.get("commit")
    if not commit:
        raise NoReference("the runs name no commit")
    if commit.endswith("-dirty"):  # the commit without them would be timed as the reference
        raise NoReference(f"the runs were measured with uncommitted changes ({commit})")
    if not is_commit_id(commit):
        raise NoReference(f"the runs name {commit!r}, not a commit's hash")
    return commit


def _too_few_rounds(runs: list[dict]) -> str | None:
    """Why the runs' time ratios are too noisy to commit, or None: each needs the rounds a checked run needs for
    its interval (a baseline of 3-round runs was written, and a run like them could not be checked)."""
    for run in runs:
        for row in run["rows"]:
            if row["status"] == "ok" and TIME in row:
                try:
                    median_interval(row["ratio_time_rounds"])
                except ValueError as error:
                    return f"times {row_key(row)!r} in too few rounds ({error}); run speed with more --rounds"
    return None


def check(run: dict, baseline: dict, reference: dict | None = None) -> list[dict]:
    """One verdict per gated quantity of the baseline: reference value, measured, interval, limit, verdict. What a
    run measures is held to ``reference``'s (a run of the baseline's code on this machine) when given, else to the
    committed value; what the cost formulas count, to the committed value. A run that measured none of them is
    refused: it is a broken run, not a regression."""
    _comparable(run, baseline, "baseline", skip=MACHINE_SETTINGS if reference else ())
    if reference:
        _comparable(run, reference, "reference run")
    rows = _rows(run, baseline, "run")
    references = _rows(reference, baseline, "reference run") if reference else {}
    tolerances = tolerances_applied(baseline, run["metadata"].get("machine"), side_by_side=bool(reference))
    verdicts = []
    for key, entry in baseline["ratios"].items():
        ran_against = rows[key].get("baseline")
        if (
            "baseline" in entry
            and rows[key]["status"] == "ok"
            and ran_against not in (None, entry["baseline"])
        ):
            raise ValueError(
                f"the run's {key!r} is relative to {ran_against}, the baseline's to {entry['baseline']}"
            )
        for name in (n for n in entry if n != "baseline"):
            here = bool(reference) and _measured_by_a_run(key, name)
            expected = _reference_value(key, name, references[key]) if here else entry[name]
            verdict = _verdict(key, name, expected, rows[key], tolerances[name])
            if name != TIME and expected != entry[name]:
                verdict |= {"note": ELSEWHERE, "committed": entry[name]}
            verdicts.append(verdict)
    nothing = _measured_nothing(verdicts)
    if nothing:
        raise ValueError(nothing)
    return verdicts


def _comparable(run: dict, other: dict, name: str, skip: tuple[str, ...] = ()) -> None:
    ran, expected = run["metadata"], other["metadata"]
    differ = [
        f"{k} {_setting(ran, k)!r} vs {_setting(expected, k)!r}"
        for k in COMPARABLE
        if k not in skip and _setting(ran, k) != _setting(expected, k)
    ]
    if differ:
        raise ValueError(f"run and {name} were measured differently ({'; '.join(differ)}): not comparable")


def time_tolerance(baseline: dict, machine: dict | None) -> tuple[float, str]:
    """The tolerance of a committed time ratio checked on ``machine`` (a CPU fingerprint), and why."""
    recorded = baseline["metadata"].get("machine")
    if recorded == machine:  # both None: GPU runs, whose device name COMPARABLE has matched already
        return baseline["tolerances"][TIME], "this is the machine that recorded them"
    widened = max(baseline["tolerances"][TIME], CROSS_MACHINE_TOLERANCE)
    return widened, "this is another machine" if recorded else "the baseline names no machine"


def tolerances_applied(baseline: dict, machine: dict | None, side_by_side: bool = False) -> dict[str, float]:
    """The tolerances :func:`check` holds a run on ``machine`` to: the baseline's, with its time ratios' widened off
    the machine that recorded them, unless they are held to a reference run timed here side by side."""
    if side_by_side:
        return dict(baseline["tolerances"])
    return baseline["tolerances"] | {TIME: time_tolerance(baseline, machine)[0]}


def _rows(run: dict, baseline: dict, name: str) -> dict[str, dict]:
    rows = {row_key(r): r for r in run["rows"]}
    missing = [key for key in baseline["ratios"] if key not in rows]
    if missing:
        raise ValueError(
            f"the {name} has no row {missing[0]!r} (and {len(missing) - 1} more): not the baseline's benchmark"
        )
    return rows


def layer_time_verdicts(
    heads: list[dict], references: list[dict], baseline: dict, first_look: int | None = None
) -> list[dict]:
    """Each timed row of the baseline's benchmark (the dense and SwitchHead layers) against the same row of the
    reference code, pair by pair: ``heads[i]`` and ``references[i]`` ran at once on this machine. The gated ratios
    stand still when both layers slow down alike (a shared kernel, the harness), which this catches. Held to 1 +
    the time tolerance: a regression only where every pair of the first look (``first_look`` pairs, default all)
    is past it, the least of them shown as measured; where more pairs were timed after it, only if the median of
    all the pairs is past it too, the median shown. None from fewer than MIN_PAIRS pairs. A row a pair did not time
    has no verdict here: its other quantities report it."""
    first_look = first_look or len(heads)
    if first_look < MIN_PAIRS:  # a second look after one pair would stand on one pair of the first
        return []
    limit = 1 + baseline["tolerances"][TIME]
    verdicts = []
    for key in (k for k in baseline["ratios"] if not _counted(k)):
        times = [(_time(head, key), _time(ref, key)) for head, ref in zip(heads, references, strict=True)]
        if times and all(h and r for h, r in times):
            pairs = [h / r for h, r in times]
            second_look = len(pairs) > first_look
            measured = statistics.median(pairs) if second_look else min(pairs)
            regressed = min(pairs[:first_look]) > limit and (not second_look or measured > limit)
            verdicts.append(
                {
                    "ratio": key,
                    "quantity": LAYER_TIME,
                    "baseline": 1.0,
                    "measured": measured,
                    "pairs": pairs,
                    "low": None,
                    "high": None,
                    "limit": limit,
                    "verdict": "REGRESSION" if regressed else "ok",
                }
            )
    return verdicts


def _time(run: dict, key: str) -> float:
    """The median milliseconds of ``key``'s row in ``run``; 0 where it has none (not ok, or a run without times)."""
    row = next((r for r in run["rows"] if row_key(r) == key), {})
    return row.get("ms", 0.0) if row.get("status") == "ok" else 0.0


def _measured_by_a_run(key: str, name: str) -> bool:
    """Whether a run measures ``name`` of ``key`` (a time ratio, operator calls, a layer step's saved bytes), which
    belongs to this machine and PyTorch as much as to the code (an upgrade changes operator counts), rather than
    counting it from the cost formulas (MAC ratios, a count row's ratios), which belong to the code alone: a
    baseline may carry a recount that its commit's code does not give (cpu.json's MAC ratios do)."""
    return name != "ratio_macs" and not _counted(key)


def _reference_value(key: str, name: str, reference: dict) -> float:
    """What the baseline's code measured here."""
    if reference["status"] != "ok" or name not in reference:
        raise ValueError(f"the reference run did not measure the {name} of {key!r} ({reference['status']})")
    return reference[name]


def _verdict(key: str, name: str, expected: float, row: dict, tolerance: float) -> dict:
    limit = expected * (1 + tolerance) if tolerance else expected  # an exact count stays an integer
    verdict = {
        "ratio": key,
        "quantity": name,
        "baseline": expected,
        "measured": row.get(name),
        "low": None,
        "high": None,
        "limit": limit,
    }
    if row["status"] != "ok" or name not in row:
        return verdict | {"verdict": row["status"] if row["status"] != "ok" else "missing"}
    if name == TIME:
        verdict["low"], verdict["high"] = median_interval(row["ratio_time_rounds"])
        worse = verdict["low"] > limit
        # passes, but says so: the gate holds ratios, not times
        if verdict["high"] < expected / (1 + tolerance):
            verdict["note"] = BELOW
    else:
        worse = row[name] > limit + 1e-12 * abs(limit)  # exact, but for float rounding
    return verdict | {"verdict": "REGRESSION" if worse else "ok"}


BELOW = (
    "below its reference by more than the tolerance: a faster SwitchHead, or a slower dense layer (where the "
    "reference was timed here, the layers' time_vs_reference rows say which)"
)
ELSEWHERE = (
    "the baseline's code measures otherwise here than in the baseline (another PyTorch?): held to what it "
    "measures here"
)


def report(verdicts: list[dict]) -> str:
    """The verdicts as a plain-text table."""
    table = pd.DataFrame(
        {
            "row": v["ratio"],  # preset | scope | what: its quantities are ratios and counts
            "quantity": v["quantity"],
            "baseline": _number(v["baseline"]),
            "measured": _number(v["measured"]),
            "95% interval": "" if v["low"] is None else f"[{v['low']:.4f}, {v['high']:.4f}]",
            "limit": _number(v["limit"]),
            "verdict": v["verdict"] + ("*" if v.get("note") else ""),
        }
        for v in verdicts
    )
    notes = dict.fromkeys(v["note"] for v in verdicts if v.get("note"))
    return "\n".join([table.to_string(index=False), *(f"* {note}" for note in notes)])


def _number(value) -> str:
    if value is None:
        return "-"
    return f"{value:,}" if isinstance(value, int) else f"{value:.4f}"


def register(commands) -> None:
    """The ``check`` command."""
    parser = commands.add_parser(
        "check", help="gate a speed run against a baseline: exit 0 pass, 1 regression, 2 unusable input"
    )
    parser.add_argument(
        "run_files", nargs="+", metavar="RUN", help="a speed run's JSON, or a folder (its newest)"
    )
    parser.add_argument("--baseline", required=True, help="e.g. results/baselines/cpu.json")
    parser.add_argument(
        "--write", action="store_true", help="write the baseline from RUN (or several RUNs, pooled) instead"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=_run)


def _run(args) -> int:
    if args.write:
        writable_file(args.baseline, "--baseline")
    loaded = [load_run(path) for path in args.run_files]
    if args.write:
        _replaceable(Path(args.baseline), [path for path, _ in loaded])
        try:
            written, archive = write_baseline([run for _, run in loaded], Path(args.baseline))
        except ValueError as error:
            raise ValueError(f"{', '.join(str(path) for path, _ in loaded)}: {error}") from None
        runs = [str(path) for path, _ in loaded]
        summary = {"wrote": str(written), "reference": archive, "runs": runs}
        print(json.dumps(summary, indent=2) if args.json else f"wrote {written} and {archive}")
        return 0
    if len(loaded) > 1:
        raise ValueError(f"{args.run_files[1]}: check takes one RUN (several only with --write)")
    path, run = loaded[0]
    baseline = load_baseline(args.baseline)
    try:
        verdicts = check(run, baseline)
    except ValueError as error:
        raise ValueError(f"{path} against {args.baseline}: {error}") from None
    tolerance, why = time_tolerance(baseline, run["metadata"].get("machine"))
    against = f"against the committed ratios; time ratios with a tolerance of {tolerance:.0%} ({why})"
    applied = tolerances_applied(baseline, run["metadata"].get("machine"))  # the JSON said 15% where 40% held
    about = {"run": str(path), "baseline": args.baseline, "tolerances": applied}
    return print_verdicts(verdicts, against, about, args.json)


def _replaceable(target: Path, runs: list[Path]) -> None:
    """Refuse to write a baseline over one of its own runs or over any file that is not a baseline: `check --write
    --baseline RUN.json` replaced the run it read."""
    if not target.exists():
        return
    if target.resolve() in {path.resolve() for path in runs}:
        raise ValueError(f"--baseline {target} is one of the runs it would be written from")
    try:
        problem = baseline_problem(read_json(target, "baseline file"))
    except ValueError as error:
        problem = str(error)
    if problem:
        raise ValueError(f"--baseline {target} exists and is not a baseline ({problem}): it is left as it is")


def print_verdicts(verdicts: list[dict], against: str, about: dict, as_json: bool) -> int:
    """The verdicts as a table, or JSON with ``about``, and what they were checked against; the exit code."""
    regressed = sum(v["verdict"] == "REGRESSION" for v in verdicts)
    unmeasured = sum(v["verdict"] not in ("ok", "REGRESSION") for v in verdicts)
    if as_json:
        summary = {
            "against": against,
            "confidence": CONFIDENCE,
            "checks": verdicts,
            "regressions": regressed,
            "not_measured": unmeasured,
        }
        print(json.dumps(about | summary, indent=2))
    else:
        print(report(verdicts))
        print(against)
        counts = ((regressed, "regressed"), (unmeasured, "not measured"))
        failed = ", ".join(f"{n} {what}" for n, what in counts if n)
        print(f"{len(verdicts)} quantities checked: {'FAIL, ' + failed if failed else 'ok'}")
    return 1 if regressed or unmeasured else 0


def _measured_nothing(verdicts: list[dict]) -> str | None:
    """Why the verdicts judge nothing (no row of the run measured a gated quantity: every one errored, ran out of
    memory or is missing), or None: such a run is no evidence of a regression, but of a broken run."""
    measured = [v for v in verdicts if not _counted(v["ratio"])]  # count rows are the formulas', always there
    if not measured or any(v["verdict"] in ("ok", "REGRESSION") for v in measured):
        return None
    statuses = collections.Counter(v["verdict"] for v in measured)
    return f"the run measured none of the {len(measured)} quantities the baseline gates ({_counts(statuses)})"


def _counts(counter) -> str:
    return ", ".join(f"{n} {status}" for status, n in counter.most_common())
