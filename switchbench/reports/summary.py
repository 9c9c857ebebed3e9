"""The report's first section: each claim of the paper beside this suite's number, with a verdict.

A claim is reproduced when the number is within the claim's tolerance (package data, with the published
numbers and the text the paper prints them as); each line links to the section it comes from and is present
only when that section is. A verdict needs a measurement that can decide it: a quick run's accuracy, or a
similarity whose reference (two seeds of one model) is as noisy as the effect, is no verdict either way.
"""

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from switchbench.bench.published import CLAIMS, TABLES
from switchbench.bench.timing.speed import below_floor, scores_ratio
from switchbench.core.results import read_csv
from switchbench.reports import labels

HEADLINE = ("table2", "c4-262m-switchhead-h4")  # the abstract's 44% / 27%: C4 262M, Table 2
# Quality at equal parameters, WikiText-103: each family's published rows (table, metric, heads or None for the
# only row) and the verdicts that agree with the paper's claim; None: the paper reports the rows, claims nothing.
QUALITY_CLAIMS = {
    "switchhead": (1, "val_ppl", None, ("matches", "better")),
    "switchall": (3, "test_ppl", None, ("matches", "better")),
    "moa": (1, "val_ppl", 4, None),
}
# The authors' ListOps training (their NDR set-up, which the SwitchHead analysis reuses): 200k steps of batch 512.
# A run that saw fewer examples and falls short of the claim has not been trained enough to contradict it.
PAPER_LISTOPS_EXAMPLES = 200_000 * 512
# Below this mean correlation two seeds of one model share no attention pattern, so there is none to reproduce.
REFERENCE_MIN_R = 0.5


@dataclass(frozen=True)
class Line:
    claim: str
    paper: str
    ours: str
    verdict: str
    reproduced: bool | None  # None: nothing to compare with
    link: str


def _claims() -> dict[str, dict]:
    return {row["claim"]: row for row in read_csv(CLAIMS).to_dict("records")}


def _verdict(ours: float, paper: float, tolerance: float, points: bool = True) -> tuple[str, bool]:
    """'reproduced' within tolerance, else 'differs' and by how much: percentage points of a ratio shown as a
    percentage, or the plain difference of a ratio printed as a fraction."""
    gap = ours - paper
    if abs(gap) <= tolerance:
        return "reproduced", True
    return (f"differs: {100 * gap:+.1f} pp" if points else f"differs: {gap:+.2f}"), False


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def lines(loaded: dict) -> list[Line]:
    return [line for _, part in parts(loaded) for line in part()]


def parts(loaded: dict) -> list[tuple[str, Callable[[], list[Line]]]]:
    """The summary's parts, each named by what it reads and computed on call, so the report can leave out one
    whose results lack a field it reads (a run of another version) and keep the rest."""
    claims, found = _claims(), []
    if "tables" in loaded:
        found.append(("tables", lambda: _headline(loaded["tables"]["tables"], claims)))
    if "speed" in loaded:
        found.append(("speed", lambda: _wallclock(loaded["speed"], claims["wallclock_ratio"])))
    if "kernels" in loaded:
        found.append(("kernels", lambda: _kernel(loaded["kernels"], claims["kernel_fraction"])))
    if "quality" in loaded:
        found.append(("quality", lambda: _quality(loaded["quality"])))
    for analysis in loaded.get("analysis", []):
        found.append(
            (
                f"analysis {analysis.get('folder', '')}".strip(),
                lambda analysis=analysis: [
                    *_accuracy(analysis, claims["listops_accuracy"]),
                    *_similarity(analysis, claims["attention_similarity"]),
                    *_dead_experts(analysis),
                ],
            )
        )
    return found


def _headline(tables: dict, claims: dict) -> list[Line]:
    table, preset = HEADLINE
    row = next((r for r in tables.get(table, {}).get("rows", []) if r["preset"] == preset), None)
    if row is None:
        return []
    out = []
    for what, key, claim in (("MACs", "macs", "headline_macs"), ("memory", "mem", "headline_memory")):
        paper, tolerance = claims[claim]["value"], claims[claim]["tolerance"]
        for how, column in (
            ("paper's convention", f"{key}_vs_dense"),
            ("this implementation, measured", f"{key}_exact_vs_dense"),
        ):
            if row.get(column) is None:
                continue
            verdict, ok = _verdict(row[column], paper, tolerance)
            out.append(
                Line(
                    f"{what} of C4 262M SwitchHead vs dense, {how}",
                    claims[claim]["printed"],
                    _pct(row[column]),
                    verdict,
                    ok,
                    f"#{table}",
                )
            )
    return out


def _size(preset: str) -> str | None:
    found = re.search(r"-(\d+m)-", preset)
    return found.group(1).upper() if found else None


def _wallclock(speed: dict, claim: dict) -> list[Line]:
    """SwitchHead's time and memory ratios of the newest run per device (GPU runs when there are any), each time
    beside its compute floor (the exact MAC ratio) and the attention kernel it ran: a group whose members ran
    different kernels, or a ratio below its floor, measures the baseline rather than the model."""
    # the claims compare eager runs on the expert matmul auto picks: compiled and fixed-implementation runs are
    # figures of their own in the speed section
    plain = [r for r in speed["runs"] if labels.speed_configuration(r["metadata"])[1:3] == ("eager", "auto")]
    runs = [r for r in plain if r["gpu"]] or plain
    published = {(r["size"], r["model"]): r for r in speed["table5"]}
    out = []
    for run in runs:
        device = run["metadata"].get("device", "?") + ("" if run["gpu"] else " (CPU)")
        setting = labels.speed_setting(run["metadata"])
        how = {"time": f"{device}, {run['timing']}, {setting}", "memory": f"{device}, {setting}"}
        rows = [
            r
            for r in run["rows"]
            if r.get("status") == "ok"
            and "switchhead" in r.get("preset", "")
            and "switchall" not in r["preset"]
        ]
        # Whole training steps compare with Table 5; without them, one attention layer's forward+backward.
        chosen = [r for r in rows if (r["scope"], r["what"]) == ("model", "train step")] or [
            r for r in rows if (r["scope"], r["what"]) == ("layer", "forward+backward")
        ]
        for r in chosen:
            paper = published.get((_size(r["preset"]), "switchhead"))
            scope = "training step" if r["scope"] == "model" else "one attention layer, forward+backward"
            claimed = f"{paper['rel_time']} ({paper['size']}, {paper['gpu']})" if paper else "not in Table 5"
            # Table 5 prints its ratios as fractions (0.72): ours are shown the same way.
            if r.get("ratio_time") is not None:
                verdict, ok = _time_verdict(r, paper, claim["tolerance"], run["gpu"])
                out.append(
                    Line(
                        f"time of {r['preset']} vs dense, {scope}, {how['time']}",
                        claimed,
                        _against_floor(r),
                        verdict,
                        ok,
                        "#speed",
                    )
                )
            if r.get("ratio_memory") is not None and paper:
                verdict, ok = _verdict(r["ratio_memory"], paper["rel_mem"], claim["tolerance"], points=False)
                if not run["gpu"]:
                    verdict = f"CPU, not comparable with the paper's GPU ({verdict})"
                out.append(
                    Line(
                        f"memory of {r['preset']} vs dense, {scope}, {how['memory']}",
                        f"{paper['rel_mem']} ({paper['size']}, {paper['gpu']})",
                        f"{r['ratio_memory']:.2f}",
                        verdict,
                        ok,
                        "#speed",
                    )
                )
    return out


def _against_floor(row: dict) -> str:
    """'0.87 (MAC floor 0.76: 1.14x it; scores 0.25; flash)': the ratio, what compute alone allows (and what the
    model executed, where more), its share of the attention scores, and the kernel."""
    text = f"{row['ratio_time']:.2f}"
    if row.get("ratio_macs") is not None:
        text += f" (MAC floor {row['ratio_macs']:.2f}: {row['time_over_floor']:.3f}x it"
        if row.get("ratio_macs_executed") is not None:
            text += f"; {row['ratio_macs_executed']:.2f} executed"
        if (scores := scores_ratio(row)) is not None:
            text += f"; scores {scores:.2f}"
        text += f"; {row['attention']})" if row.get("attention") else ")"
    return text


def _time_verdict(row: dict, paper: dict | None, tolerance: float, gpu: bool) -> tuple[str, bool | None]:
    """The time ratio's verdict, once its baseline is known to be fair: same attention kernel, not below the
    compute floor (or the executed one, where higher); then against Table 5 where the paper has the size.
    A CPU ratio is labelled as no measurement of the paper's GPU claim."""
    ok = None
    if row.get("attention_mixed"):
        verdict = "not comparable: the group's members ran different attention kernels"
    elif below_floor(row):
        verdict = "baseline suspect: faster than its compute floor allows"
    elif paper is None:
        verdict = (
            f"{row['time_over_floor']:.3f}x its compute floor" if "time_over_floor" in row else "measured"
        )
    else:
        verdict, ok = _verdict(row["ratio_time"], paper["rel_time"], tolerance, points=False)
    return (verdict if gpu else f"CPU, not comparable with the paper's GPU ({verdict})"), ok


def _kernel(kernels: dict, claim: dict) -> list[Line]:
    """The Triton expert matmul's throughput as a fraction of cuBLAS (median over cases), GPU runs only."""
    out = []
    for run in kernels["runs"]:
        fractions = [
            r["vs_dense"]
            for r in run["rows"]
            if r.get("impl") == "triton" and r.get("pass") == "forward" and r.get("vs_dense") is not None
        ]
        if not run["gpu"] or not fractions:
            continue
        ours = statistics.median(fractions)
        verdict, ok = _verdict(ours, claim["value"], claim["tolerance"])
        out.append(
            Line(
                f"expert matmul vs cuBLAS, forward, median of {len(fractions)} cases, {run['metadata']['device']}, {run['timing']}",
                claim["printed"],
                _pct(ours),
                verdict,
                ok,
                "#kernels",
            )
        )
    return out


def _quality(quality: dict) -> list[Line]:
    """Per family and device, from the strongest run that has the family (most seeds x tokens, named): the
    difference in held-out bits per byte to dense with its interval and verdict, beside the paper's WikiText-103
    perplexities of the same family and of dense."""
    strongest: dict[tuple[str, str], tuple[dict, dict, int]] = {}
    for run in quality["runs"]:  # the strongest first, per device
        device = run["metadata"].get("device", "?") + ("" if run["gpu"] else " (CPU)")
        found = sum(
            1 for r in quality["runs"] if r["metadata"].get("device") == run["metadata"].get("device")
        )
        for row in run["summary"]:
            if row["family"] in QUALITY_CLAIMS and row.get("vs_dense") is not None:
                strongest.setdefault((device, row["family"]), (run, row, found))
    return [_quality_line(device, *chosen) for (device, _), chosen in strongest.items()]


def _quality_line(device: str, run: dict, row: dict, of_runs: int) -> Line:
    meta = run["metadata"]
    agreeing = QUALITY_CLAIMS[row["family"]][3]
    ours = f"{row['vs_dense']:+.3f} bits/byte [{row['vs_dense_low']:+.3f}, {row['vs_dense_high']:+.3f}]"
    if row.get("vs_dense_best") is not None:  # runs since 2026-11-29 score on the way
        ours += (
            f"; at each seed's best score {row['vs_dense_best']:+.3f} [{row['vs_dense_best_low']:+.3f}, "
            f"{row['vs_dense_best_high']:+.3f}], {row['verdict_best']}"
        )
    verdict = {
        "matches": "matches: the interval holds 0",
        "better": "better: the interval is below 0",
        "worse": "worse: the interval is above 0",
    }[row["verdict"]]
    source = Path(run["file"]).name + (f", the strongest of {of_runs} runs" if of_runs > 1 else "")
    return Line(
        f"held-out bits per byte, {row['family']} minus dense at equal parameters ({row['preset']}, "
        f"{row['runs']} seeds, {meta['tokens_per_run']:,} tokens; {source}), {device}",
        _published_quality(row["family"]),
        ours,
        verdict,
        None if agreeing is None else row["verdict"] in agreeing,
        "#quality",
    )


def _published_quality(family: str) -> str:
    """'12.27 vs 12.31 (47M), 9.55 vs 9.66 (262M) val ppl': the family's WikiText-103 perplexity and dense's."""
    table, metric, heads, _ = QUALITY_CLAIMS[family]
    rows = [
        r
        for r in read_csv(TABLES).to_dict("records")
        if (r["table"], r["dataset"], r["metric"]) == (table, "wikitext103", metric)
    ]
    cells = []
    for size in ("47M", "262M"):
        ours = [
            r for r in rows if (r["params"], r["model"]) == (size, family) and heads in (None, r["n_heads"])
        ]
        dense = [r for r in rows if (r["params"], r["model"]) == (size, "transformer")]
        if ours and dense:
            cells.append(f"{ours[0]['value']:.2f} vs {dense[0]['value']:.2f} ({size})")
    return ", ".join(cells) + f" {metric.replace('_', ' ')}" + (f", {heads} heads" if heads else "")


def final_accuracy(log: list[dict]) -> dict[str, float]:
    """Each model's last validation accuracy in a training log."""
    return {model: row["val_accuracy"] for model, row in _last_evaluations(log).items()}


def _last_evaluations(log: list[dict]) -> dict[str, dict]:
    last = {}
    for row in log:
        if row.get("val_accuracy") is not None:
            last[row["model"]] = row
    return last


def weakest_operator(row: dict) -> str:
    """The outer operator a model gets least right at its last evaluation, e.g. "SM 31%" ("" for a log from
    before the per-operator accuracy was recorded)."""
    prefix = "val_accuracy_op_"
    ops = {k[len(prefix) :]: v for k, v in row.items() if k.startswith(prefix) and v == v and v is not None}
    if not ops:
        return ""
    worst = min(ops, key=ops.get)
    return f"{worst} {_pct(ops[worst])}"


def _accuracy(analysis: dict, claim: dict) -> list[Line]:
    """Each model's final accuracy, labelled with its training steps, mode and device. A shortfall decides the
    claim only after as many training examples as the authors' (or where the run's are not recorded); a shorter
    training's verdict says it is not comparable rather than 'differs'."""
    out = []
    for model, row in _last_evaluations(analysis["log"]).items():
        accuracy, worst = row["val_accuracy"], weakest_operator(row)
        run = analysis.get("training", {}).get(model) or {}
        verdict, ok = _verdict(accuracy, claim["value"], claim["tolerance"])
        short = _too_short(run)
        if short and not ok:
            verdict, ok = f"not comparable: {short} ({verdict.removeprefix('differs: ')})", None
        elif run.get("steps") is not None:
            verdict += f" after {run['steps']:,} steps"
        out.append(
            Line(
                f"ListOps validation accuracy, {model} ({labels.trained(run)})",
                claim["printed"],
                _pct(accuracy) + (f" (weakest: {worst})" if worst else ""),
                verdict,
                ok,
                f"#{analysis['anchor']}-curves",
            )
        )
    return out


def _too_short(run: dict) -> str | None:
    """How a run's training falls short of the authors' (a quick run, or fewer examples), or None."""
    if run.get("quick"):
        return f"a {run['steps']:,}-step quick run"
    if run.get("steps") is None or run.get("batch") is None:
        return None
    examples = run["steps"] * run["batch"]
    if examples >= PAPER_LISTOPS_EXAMPLES:
        return None
    share = examples / PAPER_LISTOPS_EXAMPLES
    return f"{examples:,} training examples, {share:.1%} of the paper's {PAPER_LISTOPS_EXAMPLES:,}"


def mean_similarity(rows: list[dict]) -> list[dict]:
    """Per pair of models, the mean over layers of both measures."""
    pairs: dict[tuple, list[dict]] = {}
    for row in rows:
        pairs.setdefault((row["model_a"], row["model_b"], bool(row["baseline"])), []).append(row)
    return [
        {
            "model_a": a,
            "model_b": b,
            "baseline": baseline,
            "pearson": statistics.fmean(r["pearson"] for r in layers),
            "js_distance": statistics.fmean(r["js_distance"] for r in layers),
        }
        for (a, b, baseline), layers in pairs.items()
    ]


def _similarity(analysis: dict, claim: dict) -> list[Line]:
    """The first pair of different architectures against the first same-architecture pair (another seed)."""
    means = mean_similarity(analysis["similarity"])
    pair = next((m for m in means if not m["baseline"]), None)
    base = next((m for m in means if m["baseline"]), None)
    if pair is None:
        return []
    ours = f"r = {pair['pearson']:.2f}, JS distance {pair['js_distance']:.2f}"
    if base is None:
        return [
            Line(
                f"attention maxima, {pair['model_a']} vs {pair['model_b']}",
                claim["printed"],
                ours,
                "no baseline to compare with",
                None,
                f"#{analysis['anchor']}-similarity",
            )
        ]
    ours += f" (two dense seeds: r = {base['pearson']:.2f}, JS {base['js_distance']:.2f})"
    verdict, ok = similarity_verdict(pair, base, analysis["similarity"], claim["tolerance"])
    return [
        Line(
            f"attention maxima alike, {pair['model_a']} vs {pair['model_b']} (mean over layers)",
            claim["printed"],
            ours,
            verdict,
            ok,
            f"#{analysis['anchor']}-similarity",
        )
    ]


def similarity_verdict(pair: dict, base: dict, rows: list[dict], tolerance: float) -> tuple[str, bool | None]:
    """The rule: the reference (two seeds of one model) must share a pattern, mean r >= REFERENCE_MIN_R, or
    nothing can be reproduced; the pair reproduces it when its mean r is at most ``tolerance`` below the
    reference's; it differs only when the gap is wider than the reference's own spread across layers (its
    highest minus its lowest layer r); otherwise the effect is inside the noise: inconclusive."""
    if base["pearson"] < REFERENCE_MIN_R:
        return (
            f"inconclusive: two dense seeds agree only at r = {base['pearson']:.2f} "
            f"(below {REFERENCE_MIN_R}), no shared pattern to reproduce",
            None,
        )
    gap = pair["pearson"] - base["pearson"]
    if gap >= -tolerance:
        return "reproduced: as alike as two seeds", True
    layers = [
        r["pearson"] for r in rows if (r["model_a"], r["model_b"]) == (base["model_a"], base["model_b"])
    ]
    spread = max(layers) - min(layers)
    if -gap <= spread:
        return (
            f"inconclusive: r {gap:+.2f} below two seeds, within their spread across layers ({spread:.2f})",
            None,
        )
    return f"differs: r {gap:+.2f} below two seeds", False


def _dead_experts(analysis: dict) -> list[Line]:
    """Experts never chosen over the sample, counted over every router of each model."""
    out = []
    for model in dict.fromkeys(r["model"] for r in analysis["summary"]):
        routers = [r for r in analysis["summary"] if r["model"] == model]
        dead = [len(str(r["dead_experts"]).split()) for r in routers if r["dead_experts"] not in (None, "")]
        unused = sum(dead)
        ours = (
            f"{unused} expert{'s' if unused != 1 else ''}, in {len(dead)} of {len(routers)} routers"
            if unused
            else f"none, in {len(routers)} routers"
        )
        out.append(
            Line(
                f"experts never chosen, {model}",
                "not reported",
                ours,
                "none" if not dead else "some experts unused",
                None,
                f"#{analysis['anchor']}-usage",
            )
        )
    return out
