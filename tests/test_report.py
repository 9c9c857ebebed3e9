"""The HTML report: rendered from a fixture folder, escaped, and checked in a real headless Chromium with the
network cut off (the report of a quick main job is checked in test_main_job.py)."""

import csv
import functools
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch
from browser import CHROMIUM, WIDTH, opened

from switchbench.cli import main
from switchbench.core.environment import cpu_fingerprint, describe_machine
from switchbench.core.results import newest
from switchbench.reports import report as report_module
from switchbench.reports import summary
from switchbench.reports.report import collect, render, report_environment, write_report

HOSTILE = "<script>alert(1)</script>"


def _csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _png(path: Path, title: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_drawn(title))


@functools.cache  # each title drawn once a process: the figures were half of every report test's time
def _drawn(title: str) -> bytes:
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1, 2], [1, 3, 2], label="series")
    ax.set(title=title, xlabel="x", ylabel="y")
    ax.legend()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    return png.getvalue()


RESULTS = Path(__file__).resolve().parents[1] / "results"


@pytest.fixture
def fixture_results(tmp_path) -> Path:
    """A small results folder with one file of every kind the report reads."""
    root = tmp_path / "results"
    _csv(
        root / "tables" / "table2.csv",
        [
            {
                "preset": "c4-262m-switchhead-h4",
                "model": "switchhead",
                "pos": "xl",
                "n_heads": 4,
                "d_head": 112,
                "n_experts": 4,
                "k": 2,
                "macs_published": "2.4G",
                "macs_paper_printed": "2.4G",
                "mem_published": "5.6M",
                "mem_paper_printed": "5.6M",
                "reproduced": "with C = 2",
                "macs_vs_dense": 0.4392,
                "mem_vs_dense": 0.266,
                "macs_exact": 3313500160,
                "macs_fvcore": 3313500160,
                "macs_flop_counter": 3313500160,
                "mem_exact": 6578176,
                "mem_saved_floats": 6578176,
                "macs_exact_vs_dense": 0.561,
                "mem_exact_vs_dense": 0.433,
                "measured_agree": "yes",
                "note": "a flagged row",
            }
        ],
    )
    _csv(
        root / "tables" / "cost_scaling.csv",
        [{"size": "47m", "model": "dense XL", "macs_crossover_T": 549.2, "mem_crossover_T": 267.0}],
    )
    _png(root / "tables" / "cost_scaling.png", "cost against length")
    run = {
        "metadata": {
            "device": "test cpu",
            "dtype": "fp32",
            "batch": 4,
            "processes": 1,
            "commit": "abc",
            "torch": "2.13",
            "clock": "thread",
            "threads": 1,
        },
        "rows": [
            {
                "group": "gate",
                "preset": "dense",
                "scope": "layer",
                "what": "forward+backward",
                "status": "ok",
                "ms": 130.5,
                "ms_iqr": 3.2,
                "ratio_time": 1.0,
                "memory_bytes": 41943040,
                "ratio_memory": 1.0,
                "tflops": 0.09,
                "fraction_of_matmul_peak": 0.45,
            },
            {
                "group": "gate",
                "preset": "c4-47m-switchhead-h2",
                "scope": "model",
                "what": "train step",
                "status": "ok",
                "ms": 90.0,
                "ms_iqr": 1.0,
                "ratio_time": 0.7,
                "memory_bytes": 2**24,
                "ratio_memory": 0.55,
            },
            {"group": "gate", "preset": "big", "scope": "model", "what": "train step", "status": "OOM"},
        ],
    }
    (root / "speed" / "test-cpu").mkdir(parents=True)
    (root / "speed" / "test-cpu" / "fp32-b4.json").write_text(json.dumps(run))
    analysis = root / "analysis" / "listops"
    for name in (
        "attention_maxima",
        "training_curves",
        "m-selection-layer0-head0",
        "m-usage",
        "m-cooccurrence",
    ):
        _png(analysis / f"{name}.png", name)
    _csv(
        analysis / "summary.csv",
        [
            {
                "model": "m",
                "layer": 0,
                "module": "attn",
                "head": 0,
                "side": "src",
                "entropy": 1.2,
                "perplexity": 3.3,
                "dead_experts": "2",
            }
        ],
    )
    _csv(
        analysis / "preferences.csv",
        [
            {
                "model": "m",
                "layer": 1,
                "module": "attn",
                "head": 0,
                "side": "dst",
                "expert": 1,
                "token": HOSTILE,
                "lift": 3.5,
                "share": 0.9,
                "count": 12,
            }
        ],
    )
    _csv(analysis / "training_log.csv", [{"model": "m", "step": 100, "val_accuracy": 0.42}])
    (analysis / "metadata.json").write_text(
        json.dumps(
            {
                "device": "test cpu",
                "commit": "abc",
                "checkpoints": [
                    {"path": "runs/m/checkpoint.pt", "step": 100, "train": {"steps": 100, "device": "cpu"}}
                ],
            }
        )
    )
    (analysis / "explorer.html").write_text("<!DOCTYPE html><title>explorer</title>")
    _csv(
        root / "analysis" / "text" / "preferences.csv",
        [
            {
                "model": "lm",
                "layer": 1,
                "module": "attn",
                "head": 0,
                "side": "src",
                "expert": 2,
                "token": "␣",
                "lift": 4.25,
                "share": 0.8,
                "count": 300,
            }
        ],
    )
    _png(analysis / "similarity.png", "similarity")
    _csv(
        analysis / "similarity.csv",
        [
            {
                "model_a": a,
                "model_b": b,
                "baseline": base,
                "layer": layer,
                "pearson": r,
                "js_distance": js,
                "rows": 9,
            }
            for a, b, base, r, js in (("d", "m", False, 0.6, 0.3), ("d", "d-seed1", True, 0.8, 0.2))
            for layer in (0, 1)
        ],
    )
    return root


def test_report_from_a_fixture_folder_is_escaped(fixture_results, tmp_path):
    page = write_report(fixture_results, tmp_path / "report.html", {"device": "test <b>cpu</b>"}).read_text()
    for section in (
        "Summary",
        "Compute and memory",
        "Cost against context length",
        "Speed and peak memory",
        "What the experts learn",
        "Methods",
        "switchbench tables",
    ):
        assert section in page
    assert "Expert-matmul throughput" not in page  # no kernel results: no section
    assert HOSTILE not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "test &lt;b&gt;cpu&lt;/b&gt;" in page
    assert "3,313,500,160" in page and "43.9%" in page and "16.0 MiB" in page and "OOM" in page
    assert page.count("data:image/png;base64,") == 7
    assert "http://" not in page and "https://" not in page
    assert '<a href="results/tables/table2.csv">' in page  # the CSV, as seen from the report
    assert '<a href="results/analysis/listops/explorer.html">Routing explorer</a>' in page
    beside = page[
        page.index('id="preferences-by-task"') : page.index('<h3 id="routing-listops">listops</h3>')
    ]  # ListOps' and text's
    assert (
        "<h4>listops</h4>" in beside
        and "<h4>text</h4>" in beside
        and "× 4.25" in beside
        and "× 3.50" in beside
    )


def test_the_speed_table_gives_each_model_s_fraction_of_the_matmul_peak(fixture_results, tmp_path):
    """The fairness rule puts each model's MFU beside every time ratio: it was only in the collapsed table."""
    page = write_report(fixture_results, tmp_path / "report.html", {}).read_text()
    start = page.index('id="speed"')
    speed_section = page[start : page.index("<details", start)]
    assert '<th class="num">of matmul peak</th>' in speed_section
    assert '<td class="num">45.0%</td>' in speed_section


def test_two_analyses_keep_ids_apart_and_each_says_how_it_was_made(fixture_results, tmp_path):
    """Headings of two analyses get ids of their own (the summary links to the right one), each analysis' regenerate
    lines are its own training and analysis as its metadata.json records them, and a folder name is URL-encoded."""
    analyses = fixture_results / "analysis"
    shutil.copytree(analyses / "listops", analyses / "list ops#2")
    metadata = json.loads((analyses / "list ops#2" / "metadata.json").read_text())
    metadata["checkpoints"][0]["train"] |= {"task": "listops", "preset": "listops-switchhead-h2", "seed": 1}
    (analyses / "list ops#2" / "metadata.json").write_text(
        json.dumps(metadata | {"example": 3, "sample": 64})
    )
    page = write_report(fixture_results, tmp_path / "report.html", {}).read_text()
    ids = re.findall(r'id="([^"]+)"', page)
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert {"routing-listops-similarity", "routing-list-ops-2-similarity"} <= set(ids)
    assert 'href="#routing-list-ops-2-similarity"' in page and 'href="#routing-listops-similarity"' in page
    assert 'href="results/analysis/list%20ops%232/explorer.html"' in page
    regen = re.findall(r'<p class="regen">([^<]*)</p>', page)
    assert "switchbench train --steps 100 --out runs/m" in regen
    assert (
        "switchbench train --task listops --preset listops-switchhead-h2 --steps 100 --seed 1 --out runs/m"
        in regen
    )
    # --out is the folder as the report was pointed at it (--results elsewhere than results/ included)
    assert f"switchbench analyze runs/m/checkpoint.pt --out {analyses / 'listops'}" in regen
    assert (
        f"switchbench analyze runs/m/checkpoint.pt --example 3 --sample 64 --out &#39;{analyses / 'list ops#2'}&#39;"
        in regen
    )


def test_a_row_measured_without_fvcore_says_which_counter_did_not_run(fixture_results, tmp_path):
    path = fixture_results / "tables" / "table2.csv"
    with open(path, newline="") as f:
        (row,) = csv.DictReader(f)
    _csv(path, [row | {"macs_fvcore": "fvcore not installed", "measured_agree": "yes, without fvcore"}])
    page = write_report(fixture_results, tmp_path / "report.html", {"device": "cpu"}).read_text()
    assert "with C = 2; measurements agree: yes, without fvcore" in page


def test_summary_sets_each_claim_beside_its_measurement(fixture_results):
    lines = {line.claim: line for line in summary.lines(collect(fixture_results))}
    # the abstract's 44% / 27% against the paper's convention (within the printed digit) and this implementation
    mac = lines["MACs of C4 262M SwitchHead vs dense, paper's convention"]
    assert (mac.paper, mac.ours, mac.verdict, mac.link) == ("44%", "43.9%", "reproduced", "#table2")
    exact = lines["memory of C4 262M SwitchHead vs dense, this implementation, measured"]
    assert (exact.ours, exact.verdict) == ("43.3%", "differs: +16.3 pp")  # 43.3% against 27%
    # Table 5, 47M: time 0.72 and memory 0.65 against the CPU run's 0.70 and 0.55, within 0.05 or not; a time
    # says its clock and threads, and both how the steps ran (a run of no recorded attention choice: explicit)
    time = lines[
        "time of c4-47m-switchhead-h2 vs dense, training step, test cpu (CPU), "
        "the timing thread's CPU time, 1 intra-op thread, attention explicit"
    ]
    memory = lines[
        "memory of c4-47m-switchhead-h2 vs dense, training step, test cpu (CPU), attention explicit"
    ]
    assert (time.paper, time.ours, memory.paper, memory.ours) == (
        "0.72 (47M, RTX 3090)",
        "0.70",
        "0.65 (47M, RTX 3090)",
        "0.55",
    )
    assert (time.verdict, memory.verdict) == (
        "CPU, not comparable with the paper's GPU (reproduced)",
        "CPU, not comparable with the paper's GPU (differs: -0.10)",
    )
    accuracy = lines["ListOps validation accuracy, m (100 training steps, on cpu)"]
    assert (accuracy.paper, accuracy.verdict) == ("around 95%", "differs: -53.0 pp after 100 steps")
    similar = lines["attention maxima alike, d vs m (mean over layers)"]
    assert similar.ours == "r = 0.60, JS distance 0.30 (two dense seeds: r = 0.80, JS 0.20)"
    assert (
        similar.verdict == "differs: r -0.20 below two seeds"
        and similar.link == "#routing-listops-similarity"
    )
    assert lines["experts never chosen, m"].ours == "1 expert, in 1 of 1 routers"


def test_an_unreadable_run_or_analysis_is_left_out_alone_and_named(fixture_results, tmp_path, capsys):
    """One broken file hides only its own run or analysis; the note on stderr names it."""
    speed, analyses = fixture_results / "speed" / "test-cpu", fixture_results / "analysis"
    shutil.copy(speed / "fp32-b4.json", speed / "fp32-b8.json")
    shutil.copytree(analyses / "listops", analyses / "listops-again")
    (speed / "fp32-b4.json").write_text("{not json")
    (analyses / "listops" / "similarity.csv").write_text('a,"b\n1')
    page = write_report(fixture_results, tmp_path / "report.html", {}).read_text()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert f"{speed / 'fp32-b4.json'} left out" in err[0] and "not a readable run file" in err[0]
    assert f"{analyses / 'listops'} left out" in err[1] and "similarity.csv" in err[1]
    assert 'id="speed"' in page and "fp32-b8.json" in page and "fp32-b4.json" not in page
    assert 'id="analysis"' in page and "analysis/listops-again" in page and "analysis/listops<" not in page


def test_an_unreadable_section_is_left_out_with_a_note(fixture_results, tmp_path, capsys):
    (fixture_results / "tables" / "table2.csv").write_text('a,"b\n1')
    page = write_report(fixture_results, tmp_path / "report.html", {}).read_text()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "'Compute and memory' left out" in err[0] and "table2.csv" in err[0], err
    assert 'id="tables"' not in page and 'id="speed"' in page


def test_every_csv_cut_off_mid_row_is_named_and_left_out(fixture_results, tmp_path, capsys):
    """A CSV cut off mid-row read as a table with a short last row: the report showed it (a half row) or failed
    on its missing cells with Python's words. Each such file of the fixture, cut in turn, is named."""
    files = sorted(fixture_results.rglob("*.csv"))
    assert len(files) >= 5
    for i, path in enumerate(files):
        root = tmp_path / f"cut-{i}"
        shutil.copytree(fixture_results, root)
        cut = root / path.relative_to(fixture_results)
        cut.write_text(cut.read_text().rstrip("\n")[:-1])  # into the last row
        write_report(root, tmp_path / f"report-{i}.html", {})
        err = capsys.readouterr().err
        assert f"{cut}: cut off mid-row" in err, (path, err)


def test_files_of_a_shape_no_run_has_leave_out_themselves_only(tmp_path, capsys):
    """A quality summary cut short, a link to nothing, a run whose time is a number or whose groups are nested:
    each stopped the whole report (exit 3) or hid its section."""
    root = tmp_path / "results"
    shutil.copytree(RESULTS / "quality" / "x86-64", root / "quality" / "x86-64")
    shutil.copytree(RESULTS / "speed" / "x86-64", root / "speed" / "x86-64")
    quick = root / "quality" / "x86-64" / "2seeds-98steps-quick-summary.csv"
    quick.write_text(quick.read_text()[:250])  # into the first family's row
    (root / "speed" / "x86-64" / "zz.json").symlink_to(tmp_path / "nothing.json")
    first, second = sorted((root / "speed" / "x86-64").glob("[!z]*.json"))[:2]
    for path, change in ((first, {"time": 5}), (second, {"groups": [[1, 2]]})):
        run = json.loads(path.read_text())
        run["metadata"] |= change
        path.write_text(json.dumps(run))
    page = write_report(root, tmp_path / "report.html", {}).read_text()
    err = capsys.readouterr().err
    assert f"{root / 'quality' / 'x86-64' / '2seeds-98steps-quick.json'} left out" in err
    assert f"{quick}: cut off mid-row" in err
    assert f"{second} left out: unhashable type" in err and "section" not in err, err
    assert 'id="quality"' in page and "5seeds-977steps" in page and 'id="speed"' in page


def test_a_run_without_a_field_the_summary_reads_leaves_out_that_summary_part_alone(tmp_path, capsys):
    """A run of another version that passes its schema but lacks a row's field the summary reads (a speed row's
    time over its floor, say) stopped the whole report, exit 3: its summary lines are left out, named."""
    root = tmp_path / "results"
    shutil.copytree(RESULTS / "speed" / "x86-64", root / "speed" / "x86-64")
    for path in (root / "speed" / "x86-64").glob("*.json"):
        run = json.loads(path.read_text())
        run["rows"] = [{k: v for k, v in row.items() if k != "time_over_floor"} for row in run["rows"]]
        path.write_text(json.dumps(run))
    assert main(["report", "--results", str(root), "--out", str(tmp_path / "report.html")]) == 0
    err = capsys.readouterr().err
    assert "the summary's speed lines left out: 'time_over_floor'" in err, err
    assert 'id="speed"' in (tmp_path / "report.html").read_text()


@pytest.mark.parametrize(
    ("dead", "said"), [("0", "1 routers have experts never chosen"), ("", "no expert is left")]
)
def test_a_router_whose_only_dead_expert_is_the_first_is_counted(dead, said, fixture_results, tmp_path):
    """Read from the CSV, a column of single ids is numbers: expert 0 alone dead was 0.0, false, and the page said
    no expert was left unused beside a summary line that counted it."""
    summary_csv = fixture_results / "analysis" / "listops" / "summary.csv"
    summary_csv.write_text(summary_csv.read_text().replace(",2\n", f",{dead}\n"))
    assert summary_csv.read_text().endswith(f",{dead}\n")
    page = write_report(fixture_results, tmp_path / "report.html", {}).read_text()
    assert said in page


def test_a_quality_run_without_dense_keeps_the_section(tmp_path, capsys):
    """A run of SwitchHead and MoA alone writes no column against dense: the template read the missing column as
    something not None, and formatting it dropped the whole section, the 5-seed run's figures with it."""
    root = tmp_path / "results"
    shutil.copytree(RESULTS / "quality" / "x86-64", root / "quality" / "x86-64")
    quick = root / "quality" / "x86-64" / "2seeds-98steps-quick-summary.csv"
    table = pd.read_csv(quick)
    table = table[table["family"] != "dense"]
    table.drop(columns=[c for c in table if "vs_dense" in c or c.startswith("verdict")]).to_csv(
        quick, index=False
    )
    page = write_report(root, tmp_path / "report.html", {}).read_text()
    assert "left out" not in capsys.readouterr().err
    assert 'id="quality"' in page and "5seeds-977steps" in page and "2seeds-98steps-quick" in page


def test_cli_report_on_a_missing_folder(capsys, tmp_path):
    assert main(["report", "--results", str(tmp_path / "nothing"), "--out", str(tmp_path / "r.html")]) == 2
    assert "no results folder" in capsys.readouterr().err


def test_cli_report_says_when_there_is_nothing_to_report(capsys, tmp_path):
    (tmp_path / "results").mkdir()
    assert main(["report", "--results", str(tmp_path / "results")]) == 1
    assert capsys.readouterr().err.strip() == (
        f"switchbench report: nothing to report: {tmp_path / 'results'} holds no result a section reads"
    )
    assert list(tmp_path.rglob("*")) == [tmp_path / "results"]


def test_cli_report_goes_into_its_results_folder_and_replaces_only_a_report(
    fixture_results, capsys, tmp_path
):
    """The default --out is the results folder's report.html (it was ./results/report.html whatever --results
    said); an existing file that is not a report (a baseline given as --out by mistake) is refused, unchanged."""
    assert main(["report", "--results", str(fixture_results)]) == 0
    written = fixture_results / "report.html"
    assert (
        capsys.readouterr().out.strip() == f"wrote {written}" and "switchbench report" in written.read_text()
    )
    assert (
        main(["report", "--results", str(fixture_results), "--out", str(written)]) == 0
    )  # an earlier report
    baseline = tmp_path / "baseline.json"
    baseline.write_text('{"ratios": {}}')
    assert main(["report", "--results", str(fixture_results), "--out", str(baseline)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"--out {baseline} exists and is not a switchbench report: refusing to replace it"), (
        err
    )
    assert baseline.read_text() == '{"ratios": {}}'
    # a trailing slash names a folder: it wrote a file named as the folder
    folder = f"{tmp_path / 'new'}/"
    assert main(["report", "--results", str(fixture_results), "--out", folder]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--out {folder} names a folder; give a file name")
    assert not (tmp_path / "new").exists()


def test_the_environment_names_the_cpu_in_words(fixture_results, tmp_path):
    """The CPU's fingerprint is a row of words (it was a Python dict printed as is)."""
    fingerprint = cpu_fingerprint()
    env = (
        report_environment() if not torch.cuda.is_available() else {"machine": describe_machine(fingerprint)}
    )
    assert env["machine"].startswith(f"{fingerprint['model']} ({fingerprint['cores']} cores")
    page = write_report(fixture_results, tmp_path / "report.html", env).read_text()
    row = re.search(r"<tr><th>machine</th><td>([^<]*)</td></tr>", page)[1]
    assert "{" not in row and f"{fingerprint['cores']} cores" in row


def test_counts_below_ten_thousand_are_written_out():
    """A tiny model's 1,024 bytes of cache a token read "1.02e+03" beside 512 and 256."""
    from switchbench.reports.report import _count

    assert [_count(v) for v in (1024, 512, 9000, 2.5, 12_345, 527_000_000, 7.44e9)] == [
        "1,024",
        "512",
        "9,000",
        "2.5",
        "0.0123M",
        "527M",
        "7.44G",
    ]


def browse(report: Path, screenshot: Path) -> dict:
    """Open the report from a file URL in headless Chromium with every network request refused."""
    with opened(report) as (page, seen):
        layout = page.evaluate(
            "({scroll: document.documentElement.scrollWidth, width: window.innerWidth,"
            " first: document.querySelector('h2').id})"
        )
        images = page.evaluate(
            "Array.from(document.images).map(i => i.complete && i.naturalWidth > 0 && i.naturalHeight > 0)"
        )
        page.screenshot(path=str(screenshot), full_page=False)
    return {
        "errors": seen["errors"],
        "external": seen["external"],
        "failed": seen["failed"],
        "images": images,
        **layout,
    }


def _non_blank(png: Path) -> bool:
    import matplotlib.image

    pixels = matplotlib.image.imread(png)
    return float(pixels[..., :3].std()) > 0.02


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian package chromium)")
def test_report_in_a_real_browser(fixture_results, tmp_path):
    pytest.importorskip("playwright")
    report = write_report(fixture_results, tmp_path / "report.html", {"device": "cpu"})
    seen = browse(report, tmp_path / "screen.png")
    assert seen["errors"] == [] and seen["external"] == [] and seen["failed"] == []
    assert len(seen["images"]) == 7 and all(seen["images"])
    assert _non_blank(tmp_path / "screen.png")
    assert seen["first"] == "summary" and seen["scroll"] <= seen["width"] == WIDTH


def test_the_speed_headline_stands_beside_its_compute_floor(tmp_path):
    """GPU time ratios with their MAC floor and attention kernel; a mixed group or a ratio below its floor is a
    verdict on the baseline; RoPE groups, absent from Table 5, are read against their floor."""

    def row(preset, ratio, floor, **extra):
        return {
            "group": "g",
            "preset": preset,
            "scope": "model",
            "what": "train step",
            "status": "ok",
            "ms": 1.0,
            "ratio_time": ratio,
            "ratio_macs": floor,
            "time_over_floor": ratio / floor,
            "attention": "flash",
            **extra,
        }

    run = {
        "metadata": {"device": "NVIDIA H100", "cuda": "13.0", "dtype": "bf16", "commit": "abc"},
        "rows": [
            row("c4-262m-switchhead-h4", 0.87, 0.76, ratio_memory=0.72, ratio_macs_executed=0.85),
            row("wikitext103-243m-switchhead-h4", 1.41, 0.81),
            row("c4-47m-switchhead-h2", 0.56, 0.78),
            row("wikitext103-45m-switchhead-h2", 1.44, 0.83, attention_mixed=True),
        ],
    }
    (tmp_path / "speed" / "h100").mkdir(parents=True)
    (tmp_path / "speed" / "h100" / "bf16-bfit.json").write_text(json.dumps(run))
    found = {line.claim.split(" vs dense")[0]: line for line in summary.lines(collect(tmp_path))}
    xl = found["time of c4-262m-switchhead-h4"]
    assert (xl.paper, xl.ours, xl.verdict) == (
        "0.65 (262M, V100)",
        "0.87 (MAC floor 0.76: 1.145x it; 0.85 executed; flash)",
        "differs: +0.22",
    )
    assert found["memory of c4-262m-switchhead-h4"].verdict == "differs: +0.11"
    rope = found["time of wikitext103-243m-switchhead-h4"]
    assert (rope.paper, rope.verdict, rope.reproduced) == ("not in Table 5", "1.741x its compute floor", None)
    assert (
        found["time of c4-47m-switchhead-h2"].verdict
        == "baseline suspect: faster than its compute floor allows"
    )
    assert found["time of wikitext103-45m-switchhead-h2"].verdict.startswith("not comparable")
    page = write_report(tmp_path, tmp_path / "report.html", {}).read_text()
    assert "76.0% (executed 85.0%)" in page


def test_the_kernel_section_shows_each_view_its_fractions_and_the_choice(tmp_path):
    def row(impl, view, ms, chosen=False):
        return {
            "case": "262m switchhead-v",
            "impl": impl,
            "view": view,
            "pass": "forward",
            "status": "ok",
            "ms": ms,
            "tflops": 100 / ms,
            "vs_dense": 1 / ms,
            "fraction_of_matmul_peak": 0.125 / ms,
            "chosen": chosen,
        }

    run = {
        "metadata": {
            "device": "NVIDIA H100",
            "cuda": "13.0",
            "dtype": "bf16",
            "batch": 64,
            "expert_matmul": "auto",
        },
        "rows": [
            {
                "case": "262m switchhead-v",
                "impl": "routing",
                "view": "routing",
                "pass": "forward",
                "status": "ok",
            }
            | {"ms": 0.25, "chosen": False},
            row("grouped_mm", "op", 1.0, chosen=True) | {"routing_ms": 0.25, "moe_overhead_ms": 0.25},
            row("grouped_mm-kernel", "kernel", 0.5),  # twice as fast as dense: a flag on the comparator
            row("dense", "dense", 1.0),
        ],
    }
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "h100-bf16-b64.json").write_text(json.dumps(run))
    page = write_report(tmp_path, tmp_path / "report.html", {}).read_text()
    assert "<td>grouped_mm *</td><td>op</td>" in page and "<td>grouped_mm-kernel</td><td>kernel</td>" in page
    assert "<code>--expert-matmul auto</code>" in page and ">25.0%</td>" in page  # of peak: 0.125 / 0.5
    assert (
        "<td>routing</td><td>routing</td>" in page and page.count(" ms</td></tr>") == 1
    )  # overhead: the * row
    assert ">0.25 ms</td></tr>" in page
    assert '<td class="num bad">200.0%</td>' in page and '<td class="num">100.0%</td>' in page


def test_the_speed_section_keeps_the_newest_run_of_each_group_and_mode(tmp_path):
    """The evidence chain writes one speed run per GPU group and compile mode: each is a figure of its own; of
    two runs of one configuration only the newer is shown."""

    def write(name: str, mtime: int, **metadata):
        run = {
            "metadata": {"device": "NVIDIA H100", "cuda": "13.0", "dtype": "bf16", **metadata},
            "rows": [
                {
                    "group": "g",
                    "preset": name,
                    "scope": "model",
                    "what": "train step",
                    "status": "ok",
                    "ms": 1.0,
                }
            ],
        }
        path = tmp_path / "speed" / "h100" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run))
        os.utime(path, (mtime, mtime))

    write("old-47m", 1, groups={"47m": []}, compile="eager")
    write("new-47m", 2, groups={"47m": []}, compile="eager")
    write("262m", 3, groups={"262m": []}, compile="eager")
    write("262m-compiled", 4, groups={"262m": []}, compile="inductor")
    # two pairs named with --presets, both the group "custom": the chain's 262M and 47M pairs at their best
    write("262m-pair", 5, groups={"custom": ["c4-262m-transformer-h16", "c4-262m-switchhead-h4"]})
    write("47m-pair", 6, groups={"custom": ["c4-47m-transformer-h10", "c4-47m-switchhead-h2"]})
    shown = sorted(run["rows"][0]["preset"] for run in collect(tmp_path)["speed"]["runs"])
    assert shown == ["262m", "262m-compiled", "262m-pair", "47m-pair", "new-47m"]


def test_a_practitioner_s_run_and_an_eager_one_are_both_shown_the_newest_by_its_recorded_time(tmp_path):
    """An H200 ran the 262M group with SDPA and CUDA graphs, then eager: one configuration each, so both are
    figures, each headed with how it ran. Of two runs of one configuration the one that recorded the later time is
    shown, whatever the files' modification times (a checkout gives them all the same)."""

    def write(name: str, mtime: int, time: str, **metadata):
        run = {
            "metadata": {"device": "NVIDIA H200", "cuda": "13.0", "dtype": "bf16", "time": time, **metadata},
            "rows": [
                {"group": "262m", "preset": name, "scope": "model", "what": "train step", "status": "ok"}
            ],
        }
        path = tmp_path / "speed" / "h200" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run))
        os.utime(path, (mtime, mtime))

    practitioner = {"groups": {"262m": []}, "attention": "sdpa", "cuda_graphs": True}
    write("graphs-older", 3, "2026-11-27T00:29:00+00:00", **practitioner)
    write("graphs-newer", 1, "2026-11-27T00:31:00+00:00", **practitioner)
    write("eager", 2, "2026-11-27T00:35:00+00:00", groups={"262m": []}, attention="explicit")
    shown = sorted(run["rows"][0]["preset"] for run in collect(tmp_path)["speed"]["runs"])
    assert shown == ["eager", "graphs-newer"]
    page = write_report(tmp_path, tmp_path / "report.html", {}).read_text()
    assert "bf16, attention sdpa, each step replayed from one CUDA graph, batch" in page
    assert "bf16, attention explicit, batch" in page


def test_the_profile_section_keeps_the_newest_profile_of_each_configuration_by_its_recorded_time(tmp_path):
    """An H200 profiled the 262M pair, then SwitchHead alone on all_experts: both are shown; of two profiles of the
    pair the later recorded one, whatever the files' modification times (a checkout, or a rewritten metadata field,
    moves those)."""

    def write(name: str, mtime: int, time: str, presets: list, expert_matmul: str):
        metadata = {"device": "NVIDIA H200", "cuda": "13.0", "dtype": "bf16", "time": time}
        metadata |= {"presets": presets, "expert_matmul": expert_matmul}
        rows = [
            {
                "preset": p,
                "what": "train step",
                "kind": "share",
                "name": "attention",
                "ms": 1.0,
                "fraction": 0.5,
            }
            | {"ms_unprofiled": 2.0, "ms_profiled": 2.0, "batch": 64, "tag": name}
            for p in presets
        ]
        path = tmp_path / "profile" / "h200" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"metadata": metadata, "rows": rows}))
        os.utime(path, (mtime, mtime))

    pair = ["c4-262m-transformer-h16", "c4-262m-switchhead-h4"]
    write("pair-older", 3, "2026-11-27T00:37:41+00:00", pair, "auto")
    write("pair-newer", 1, "2026-11-27T13:18:52+00:00", pair, "auto")
    write("alone", 2, "2026-11-27T13:19:24+00:00", pair[1:], "all_experts")
    shown = sorted(run["rows"][0]["tag"] for run in collect(tmp_path)["profile"]["runs"])
    assert shown == ["alone", "pair-newer"]


def test_newest_goes_by_the_time_a_run_recorded(tmp_path):
    for name, mtime, time in (("a", 2, "2026-11-27T00:00:00+00:00"), ("b", 1, "2026-11-28T00:00:00+00:00")):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"metadata": {"time": time}, "rows": []}))
        os.utime(path, (mtime, mtime))
    (tmp_path / "c.json").write_text("not json")  # recorded nothing: oldest, not an error
    assert newest(tmp_path).name == "b.json"


def test_the_accuracy_line_names_the_operator_a_model_gets_least_right():
    row = {
        "model": "dense",
        "val_accuracy": 0.62,
        "val_accuracy_op_MAX": 0.81,
        "val_accuracy_op_SM": 0.31,
        "val_accuracy_op_MIN": 0.77,
        "val_accuracy_depth_3": 0.2,
    }
    assert summary.weakest_operator(row) == "SM 31.0%"
    assert summary.weakest_operator({"model": "dense", "val_accuracy": 0.62}) == ""  # an older log
    lines = summary._accuracy(
        {"log": [row], "training": {}, "anchor": "routing-listops"},
        {"value": 0.95, "tolerance": 0.05, "printed": "95%"},
    )
    assert lines[0].ours == "62.0% (weakest: SM 31.0%)"


def test_the_training_ratios_beside_a_decode_run_come_from_one_speed_run():
    """The newest ratio of each preset put a compiled batch-64 SwitchHead beside eager batch-8 MoA and GQA in one
    column: now one run, the newest of those that time the most of the decode run's presets."""

    def run(name, time, ratios, device="H200"):
        rows = [{"preset": p, "what": "train step", "ratio_time": r} for p, r in ratios.items()]
        return {"file": name, "metadata": {"device": device, "time": time}, "rows": rows}

    eager = run("eager.json", "1", {"switchhead": 1.57, "moa": 1.88, "gqa": 1.46})
    compiled = run("graphs.json", "2", {"switchhead": 0.83})
    other = run("h100.json", "3", {"switchhead": 1.18, "moa": 1.27, "gqa": 1.01}, device="H100")
    found = report_module._training_ratios(
        [eager, compiled, other], "H200", {"switchhead", "moa", "gqa", "dense"}
    )
    assert {p: ratio for p, (ratio, _) in found.items()} == {"switchhead": 1.57, "moa": 1.88, "gqa": 1.46}
    assert all(source.startswith("eager.json") for _, source in found.values())
    newer = run("all.json", "4", {"switchhead": 0.8, "moa": 0.9, "gqa": 0.7})
    found = report_module._training_ratios([eager, compiled, newer], "H200", {"switchhead", "moa", "gqa"})
    assert {p: ratio for p, (ratio, _) in found.items()} == {"switchhead": 0.8, "moa": 0.9, "gqa": 0.7}


@pytest.mark.slow  # times a decode run
def test_the_inference_section_sets_serving_beside_training(tmp_path):
    """A decode run: per preset its cache and decode ratio at the largest cell, beside the training-step ratio of
    the same preset from a speed run; a family without a decode path is a row saying so; text is escaped."""
    out = tmp_path / "decode"
    argv = ["decode", "tiny-transformer", "tiny-switchhead", "--device", "cpu", "--batches", "1", "2"]
    assert main([*argv, "--contexts", "8", "--rounds", "1", "--warmup", "0", "--out", str(out)]) == 0
    run_path = next((out).glob("*/*.json"))
    run = json.loads(run_path.read_text())
    run["rows"].append({"preset": HOSTILE, "family": "plug-in", "status": "no decode path", "group": "tiny"})
    run_path.write_text(json.dumps(run))

    def speed_run(device, ratio, time):
        row = {"preset": "tiny-switchhead", "scope": "model", "what": "train step", "status": "ok"}
        return {
            "metadata": {"device": device, "dtype": "fp32", "time": time},
            "rows": [row | {"ratio_time": ratio}],
        }

    # the same preset's training ratio on this device, not the newer one of another device
    for folder, run_of in (
        ("cpu", speed_run(run["metadata"]["device"], 1.23, "1")),
        ("h200", speed_run("H200", 0.5, "2")),
    ):
        (tmp_path / "speed" / folder).mkdir(parents=True)
        (tmp_path / "speed" / folder / "fp32.json").write_text(json.dumps(run_of))
    summary_rows = collect(tmp_path)["decode"]["runs"][0]["summary"]
    by_preset = {r["preset"]: r for r in summary_rows}
    assert (by_preset["tiny-switchhead"]["batch"], by_preset["tiny-switchhead"]["train_step_ratio"]) == (
        2,
        1.23,
    )
    assert "speed/cpu/fp32.json" in by_preset["tiny-switchhead"]["train_step_source"]
    assert by_preset["tiny-transformer"]["train_step_ratio"] is None
    page = write_report(tmp_path, tmp_path / "report.html", {}).read_text()
    assert 'id="decode"' in page and "123.0%" in page and "no decode path" in page
    assert HOSTILE not in page and "&lt;script&gt;" in page
    assert "A partial run" not in page  # both cells were measured
    # a decode ratio below its floor ratio is marked, as the printout marks it
    cell = next(r for r in run["rows"] if r["preset"] == "tiny-switchhead" and r.get("batch") == 2)
    marked = f'<td class="num bad">{cell["ratio_decode_time"]:.1%}</td>'
    assert marked not in page or cell["ratio_decode_time"] < cell["ratio_decode_floor"]
    cell["ratio_decode_floor"] = cell["ratio_decode_time"] + 0.5
    run_path.write_text(json.dumps(run))
    assert marked in write_report(tmp_path, tmp_path / "report.html", {}).read_text()
    run["metadata"]["cells_done"] = 1  # as a run stopped after its first cell saves itself
    run_path.write_text(json.dumps(run))
    page = write_report(tmp_path, tmp_path / "report.html", {}).read_text()
    assert "A partial run, stopped after 1 of its 2 cells" in page


def test_the_summary_takes_each_quality_claim_from_the_strongest_run(tmp_path):
    """A newer quick run (2 seeds x 100k tokens) beside an older long one (5 seeds x 1M): the claim comes from the
    long one, named; a family only the quick run has comes from it."""
    folder = tmp_path / "quality" / "cpu"
    folder.mkdir(parents=True)

    def write(name: str, seeds: int, tokens: int, verdicts: dict) -> None:
        metadata = {"device": "cpu", "seeds": seeds, "tokens_per_run": tokens}
        rows = [{"family": "dense", "preset": "d", "seed": 0, "val_bits_per_byte": 2.0, "train_macs": 1.0}]
        (folder / f"{name}.json").write_text(json.dumps({"metadata": metadata, "rows": rows}))
        summary_rows = [
            {"family": f, "preset": f"{f}-p", "runs": seeds, "bpb_mean": 2.0, "bpb_low": 1.9, "bpb_high": 2.1}
            | {"train_macs": 1.0}
            | {"vs_dense": d, "vs_dense_low": d - 0.01, "vs_dense_high": d + 0.01, "verdict": v}
            for f, (d, v) in verdicts.items()
        ]
        _csv(folder / f"{name}-summary.csv", summary_rows)

    write("long", 5, 1_000_000, {"switchhead": (-0.09, "better")})
    write("quick", 2, 100_000, {"switchhead": (0.1, "matches"), "moa": (0.0, "matches")})
    found = {line.claim: line for line in summary.lines(collect(tmp_path)) if "bits per byte" in line.claim}
    switchhead = next(line for claim, line in found.items() if "switchhead" in claim)
    assert "5 seeds, 1,000,000 tokens; long.json, the strongest of 2 runs" in switchhead.claim
    assert switchhead.verdict.startswith("better")
    moa = next(line for claim, line in found.items() if "moa" in claim)
    assert "quick.json" in moa.claim and moa.verdict.startswith("matches")


def _results_as_committed() -> bool:
    """Whether results/ is a git checkout's, unchanged: a GPU node's chain writes new figures into its copy, which
    the committed report cannot show yet."""
    if shutil.which("git") is None or not (RESULTS.parent / ".git").exists():
        return False
    changed = subprocess.run(
        ["git", "-C", str(RESULTS.parent), "status", "--porcelain", "--", "results"],
        capture_output=True,
        text=True,
    )
    return changed.returncode == 0 and not changed.stdout.strip()


@pytest.mark.skipif(not _results_as_committed(), reason="results/ differs from its commit, or is no checkout")
def test_the_committed_report_shows_the_committed_results(monkeypatch):
    """results/report.html is what `switchbench report` makes of results/ now, but for the line that says where it
    was made: a rerun committed without the report left the previous quality run's figures in it (SwitchHead
    -0.088 against dense where its file says -0.091)."""

    def shown(html: str) -> list[str]:
        return [line for line in html.splitlines() if "<th>time</th>" not in line]

    monkeypatch.chdir(RESULTS.parent)  # the report names its files as it was asked: `switchbench report`
    rendered = render(collect(Path("results")), report_environment(), link=".")
    committed = (RESULTS / "report.html").read_text()
    assert shown(rendered) == shown(committed), "run `switchbench report` and commit results/report.html"
