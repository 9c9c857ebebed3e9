"""Routing analysis: the ListOps data, the statistics, training with checkpoints, and every figure."""

import json
import math
import pickle
import re
from pathlib import Path

import matplotlib.image
import pytest
import torch

from switchbench.analysis import analyze as analyze_module
from switchbench.analysis import stats
from switchbench.analysis.analyze import analyze
from switchbench.cli import main
from switchbench.core.results import read_csv
from switchbench.models.lm import LanguageModel
from switchbench.models.presets import PRESETS
from switchbench.train import checkpoint, listops, text
from switchbench.train.run import ListOpsTask, TrainConfig, _reached, learning_rate, run_name, train


def evaluate(tokens: list[str]) -> int:
    """An independent evaluator: a stack machine over the token string."""
    stack = []
    for token in tokens:
        if token.startswith("["):
            stack.append([token])
        elif token == "]":
            op, *args = stack.pop()
            ordered = sorted(args)
            value = {
                "[MAX": ordered[-1],
                "[MIN": ordered[0],
                "[MED": ordered[(len(args) - 1) // 2],
                "[SM": sum(args) % 10,
            }[op]
            if not stack:
                return value
            stack[-1].append(value)
        else:
            stack[-1].append(int(token))
    raise AssertionError("unbalanced expression")


def test_listops_answers_are_right():
    cfg = listops.ListOpsConfig(max_depth=4, max_args=5, max_length=80, nest_probability=0.4)
    examples = listops.generate(500, seed=7, cfg=cfg)
    assert all(answer == evaluate(tokens) for tokens, answer in examples)
    assert all(len(tokens) <= 80 for tokens, _ in examples)
    assert max(max(_depth(tokens) for tokens, _ in examples), 1) == 4


def _depth(tokens):
    depth = best = 0
    for t in tokens:
        depth += t.startswith("[") - (t == "]")
        best = max(best, depth)
    return best


def test_listops_is_deterministic_and_encodes():
    assert listops.generate(20, seed=3) == listops.generate(20, seed=3)
    assert listops.generate(20, seed=3) != listops.generate(20, seed=4)
    ids, answers = listops.encode([(["[SM", "4", "9", "]"], 3)], 6)
    assert ids.tolist() == [
        [listops.TOKEN_ID[t] for t in ["[SM", "4", "9", "]"]] + [0, 0]
    ] and answers.tolist() == [3]
    with pytest.raises(ValueError, match="not ListOps tokens: MAX"):
        listops.tokenize("MAX 1 2 ]")


def test_an_expression_evaluates_to_its_generated_answer_and_a_malformed_one_is_refused():
    """The generator computes each answer as it builds the expression: evaluating its tokens must agree. An
    input that is not one expression was classified as if it were (analyze --input '[MAX 2 3')."""
    for tokens, answer in listops.generate(200, seed=5, cfg=listops.ListOpsConfig(max_depth=4)):
        assert listops.evaluate(tokens) == answer
    assert listops.tokenize("[MED 2 [MIN 3 [SM 4 9 ] ] 5 ]") == [
        "[MED",
        "2",
        "[MIN",
        "3",
        "[SM",
        "4",
        "9",
        "]",
        "]",
        "5",
        "]",
    ]
    malformed = {
        "[MAX 2 3": "1 bracket left open",
        "[MAX 2 [MIN 3": "2 brackets left open",
        "[MAX 2 ] ]": "token 4 (]) comes after the expression's end",
        "[MAX 2 ] 3": "token 4 (3) comes after",
        "3 [MAX 2 ]": "token 1 (3) is outside every bracket",
        "] [MAX 2 ]": "token 1 (]) is outside every bracket",
        "[MAX [MIN ] 2 ]": "token 3 closes [MIN before any argument",
    }
    for given, reason in malformed.items():
        with pytest.raises(ValueError, match=re.escape(f"not one ListOps expression: {reason}")):
            listops.tokenize(given)


def test_a_training_batch_has_one_length_and_depends_only_on_seed_and_step():
    """No padding in any training step, and a step's batch is the same however training got there (resumable)."""
    cfg = listops.ListOpsConfig()
    steps = [listops.length_batch(16, step, 3, cfg) for step in range(250)]  # three pools
    assert all(len(batch) == 16 and len({len(t) for t, _ in batch}) == 1 for batch in steps)
    assert all(answer == evaluate(tokens) for batch in steps for tokens, answer in batch)
    listops._pool.cache_clear()
    assert (
        listops.length_batch(16, 217, 3, cfg) == steps[217]
        and listops.length_batch(16, 5, 3, cfg) == steps[5]
    )
    assert listops.length_batch(16, 5, 4, cfg) != steps[5]
    assert len({len(batch[0][0]) for batch in steps}) > 10  # short and long expressions alike


def test_no_validation_expression_is_trained_on():
    """Flat expressions are few: without the exclusion a seed's first pools held most of its flat validation ones."""
    cfg = TrainConfig("listops", "listops-transformer-h8", val_size=200)
    task = ListOpsTask(cfg, PRESETS["listops-transformer-h8"])
    trained = {tuple(tokens) for step in range(300) for tokens, _ in task.examples(step)}
    assert not trained & task.held_out
    plain = {
        tuple(tokens)
        for step in range(300)
        for tokens, _ in listops.length_batch(cfg.batch, step, cfg.seed, task.data_cfg)
    }
    assert plain & task.held_out  # what the exclusion removes


def test_operator_and_depth_by_hand():
    tokens = listops.tokenize("[MED 2 [MIN 3 [SM 4 9 ] ] 5 ]")
    assert (listops.operator(tokens), listops.depth(tokens)) == ("MED", 3)
    assert (listops.operator(["[SM", "1", "2", "]"]), listops.depth(["[SM", "1", "2", "]"])) == ("SM", 1)


def test_validation_runs_each_length_unpadded_and_splits_accuracy_by_operator_and_depth():
    """Against an independent loop: each validation example alone, at its own length, and the accuracies
    grouped by hand."""
    torch.manual_seed(0)
    cfg = TrainConfig(task="listops", preset="listops-switchhead-h2", val_size=60)
    model = checkpoint.build_model("listops", cfg.model_config, listops.N_CLASSES).eval()
    task = ListOpsTask(cfg, cfg.model_config)
    got = task.evaluate(model)
    with torch.no_grad():
        right = [
            model(listops.encode([example], len(example[0]))[0])[0].argmax().item() == example[1]
            for example in task.val
        ]
    assert got["val_accuracy"] == pytest.approx(sum(right) / len(right))
    for key, name in ((listops.operator, "op"), (listops.depth, "depth")):
        groups = {}
        for (tokens, _), ok in zip(task.val, right, strict=True):
            groups.setdefault(key(tokens), []).append(ok)
        for value, oks in groups.items():
            assert got[f"val_accuracy_{name}_{value}"] == pytest.approx(sum(oks) / len(oks))


@pytest.mark.parametrize(  # a second each: the routed SwitchHead in the fast loop, all three in the full suite
    "preset",
    [
        pytest.param("listops-transformer-h8", marks=pytest.mark.slow),
        "listops-switchhead-h2",
        pytest.param("listops-moa-h4", marks=pytest.mark.slow),
    ],
)
def test_a_listops_sample_is_observed_as_each_sequence_alone(preset):
    """The classifier has no padding mask, so padding changes the real tokens' attention and routing: every
    statistic reads each sequence run alone, unpadded, as it was trained, with zeros at its padding."""
    torch.manual_seed(0)
    model = checkpoint.build_model("listops", PRESETS[preset], listops.N_CLASSES).eval()
    run = {"task": "listops", "module": model}
    sample = listops.generate(6, seed=5, cfg=listops.ListOpsConfig(max_length=PRESETS[preset].T))
    tokens = listops.encode(sample, PRESETS[preset].T)[0]
    got = analyze_module._observe_sample(run, tokens)
    for i, (example, _) in enumerate(sample):
        n = len(example)
        alone = analyze_module._observe(run, tokens[i : i + 1, :n])
        for module, record in alone.items():
            for key, value in record.items():
                whole = got[module][key][i : i + 1]
                if key == "maps":
                    torch.testing.assert_close(whole[..., :n, :n], value, rtol=0, atol=1e-6)
                    assert not whole[..., n:].any() and not whole[..., n:, :].any()
                else:
                    torch.testing.assert_close(whole[:, :n], value, rtol=0, atol=1e-6)
                    assert not whole[:, n:].any()
    padded = analyze_module._observe(run, tokens)  # what the statistics read before
    maps = [name for name in padded if "maps" in padded[name]]
    assert any(not torch.allclose(padded[m]["maps"], got[m]["maps"]) for m in maps)


def test_statistics_on_a_hand_made_routing():
    # 4 tokens, k = 2 of E = 4 experts; expert 3 is never chosen
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    counts = stats.usage(experts, 4)
    assert counts.tolist() == [4, 3, 1, 0]
    p = [4 / 8, 3 / 8, 1 / 8]
    assert stats.entropy(counts) == pytest.approx(-sum(x * math.log(x) for x in p))
    assert stats.perplexity(torch.tensor([5, 5, 5, 5])) == pytest.approx(4.0)
    assert stats.entropy(torch.tensor([0, 9, 0])) == 0.0
    assert stats.dead_experts(counts) == [3]
    o_experts = torch.tensor([[2], [2], [3], [0]])
    co = stats.cooccurrence(experts, o_experts, 4)
    assert (
        co[0, 2] == 2
        and co[1, 2] == 1
        and co[2, 2] == 1
        and co[0, 3] == 1
        and co[1, 0] == 1
        and co.sum() == 8
    )
    # lift by hand, k = 1: experts 0, 0, 1, 1 each take half of all tokens; token 5 (3 times) picks expert 0 twice
    experts, tokens = torch.tensor([[0], [0], [1], [1]]), torch.tensor([5, 5, 5, 6])
    assert stats.token_preferences(experts, tokens, 2, min_count=2) == [
        (0, 5, pytest.approx(4 / 3), 2 / 3, 2)
    ]
    # token 6 (once, with expert 1) ranks only with min_count 1: expert 1 every time, lift 2; token 5's lift 2/3 on it is no preference
    assert stats.token_preferences(experts, tokens, 2, min_count=1) == [
        (0, 5, pytest.approx(4 / 3), 2 / 3, 2),
        (1, 6, 2.0, 1.0, 1),
    ]


def test_run_names_hold_the_task_once():
    assert run_name("listops", "listops-switchhead-h2") == "listops-switchhead-h2"
    assert run_name("lm", "tiny-switchhead") == "lm-tiny-switchhead"
    assert run_name("listops", "listops-transformer-h8", seed=1) == "listops-transformer-h8-seed1"
    # a preset with changes names a folder without a colon or a comma
    assert run_name("lm", "tiny-moa:n_layers=1,T=64") == "lm-tiny-moa-n_layers=1-T=64"


def test_a_preset_with_changes_trains_the_changed_configuration():
    """`train --preset NAME:field=value,...` as every command that takes a preset; it was refused as unknown."""
    cfg = TrainConfig("listops", "listops-switchhead-h2:n_layers=1,d_model=32")
    assert cfg.model_config == PRESETS["listops-switchhead-h2"].replace(n_layers=1, d_model=32)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Tiny runs of every family, trained for a few steps."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for preset in ("listops-transformer-h8", "listops-switchhead-h2"):
        cfg = TrainConfig("listops", preset, steps=6, batch=8, eval_every=3, warmup=2, val_size=32)
        train(cfg, root / preset, progress=False)
        out[preset] = root / preset / "checkpoint.pt"
    # byte-level LMs of two layers (a third of a ListOps model's figures)
    for name, preset in (
        ("lm", "tiny-switchhead"),
        ("lm-moa", "tiny-moa"),
        ("lm-switchall", "tiny-switchall"),
    ):
        cfg = TrainConfig("lm", preset, steps=4, batch=4, eval_every=2, warmup=1)
        train(cfg, root / name, progress=False)
        out[name] = root / name / "checkpoint.pt"
    return out


def _non_blank(png: Path) -> bool:
    image = matplotlib.image.imread(png)
    return image.ndim == 3 and float(image[..., :3].std()) > 0.01


@pytest.mark.slow
def test_every_figure_and_table(runs, tmp_path):
    written = analyze([runs["listops-transformer-h8"], runs["listops-switchhead-h2"]], tmp_path, sample=16)
    names = {p.name for p in written}
    assert {
        "attention_maxima.png",
        "attention_maxima.svg",
        "training_curves.png",
        "usage.csv",
        "summary.csv",
        "cooccurrence.csv",
        "preferences.csv",
        "training_log.csv",
        "similarity.csv",
        "similarity.png",
        "explorer.html",
    } <= names
    for layer in range(6):
        for head in range(2):
            assert f"listops-switchhead-h2-selection-layer{layer}-head{head}.png" in names
    assert {"listops-switchhead-h2-usage.png", "listops-switchhead-h2-cooccurrence.png"} <= names
    assert all(_non_blank(p) for p in written if p.suffix == ".png")
    usage = (tmp_path / "usage.csv").read_text().splitlines()
    # 6 layers x 2 heads x 2 sides x 4 experts, one row each
    assert len(usage) == 1 + 6 * 2 * 2 * 4
    preferences = read_csv(tmp_path / "preferences.csv")
    assert preferences["layer"].min() >= 1 and (preferences["lift"] > 1).all()  # layer 0 sees the token alone
    similar = read_csv(tmp_path / "similarity.csv")
    assert len(similar) == 6 and set(similar["model_b"]) == {"listops-switchhead-h2"}
    assert similar["pearson"].between(-1, 1).all() and similar["js_distance"].between(0, 1).all()


@pytest.mark.slow
def test_moa_switchall_and_lm_runs_are_analysed(runs, tmp_path):
    """MoA's heads and SwitchAll's σ-MoE MLP get their routers' usage, beside SwitchHead's, on the text given."""
    checkpoints = [runs[name] for name in ("lm-moa", "lm-switchall", "lm")]
    written = analyze(checkpoints, tmp_path, source="To be, or not to be", sample=8)
    names = {p.name for p in written}
    assert {"lm-moa-usage.png", "lm-switchall-usage.png", "lm-selection-layer1-head1.png"} <= names
    summary = (tmp_path / "summary.csv").read_text()
    assert "lm-moa,0,attn" in summary and "lm-switchall,0,mlp" in summary
    assert "Routing explorer: byte-level text" in (tmp_path / "explorer.html").read_text()


@pytest.mark.slow
def test_analysing_again_into_a_folder_replaces_the_earlier_analysis(runs, tmp_path):
    """The files of an earlier analysis that this one does not write again (a model no longer analysed, the
    similarity of a pair) are removed, so the report cannot show them as current; files it did not write stay."""
    analyze([runs["lm"], runs["lm-moa"]], tmp_path, sample=2)
    (tmp_path / "notes.txt").write_text("mine")
    assert (tmp_path / "similarity.csv").exists() and (tmp_path / "lm-moa-usage.png").exists()
    analyze([runs["lm"]], tmp_path, sample=2)
    files = set(json.loads((tmp_path / "metadata.json").read_text())["files"])
    assert {p.name for p in tmp_path.iterdir()} == files | {"metadata.json", "notes.txt"}
    assert "lm-usage.png" in files and not any("moa" in name or "similarity" in name for name in files)


@pytest.mark.slow  # the trained runs
def test_an_analysis_stopped_on_its_way_leaves_the_earlier_one_as_it_was(runs, tmp_path, monkeypatch):
    """Stopped while writing its last file (the explorer), after every figure and table: the folder held the new
    figures beside the earlier metadata.json and explorer, which described another analysis."""
    analyze([runs["lm"], runs["lm-moa"]], tmp_path, sample=2)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def stopped(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(analyze_module, "_explorer", stopped)
    with pytest.raises(KeyboardInterrupt):
        analyze([runs["lm"]], tmp_path, source="other text", sample=2)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.slow  # the trained runs
@pytest.mark.parametrize(
    "metadata", ['{"command": "switchbench tables", "files": ["table1.csv"]}', "{damaged"]
)
def test_a_folder_another_command_described_is_refused_before_any_work(metadata, runs, tmp_path, capsys):
    """`analyze --out results/tables` took the tables' metadata.json for an earlier analysis and deleted the files
    it listed."""
    (tmp_path / "metadata.json").write_text(metadata)
    (tmp_path / "table1.csv").write_text("a table")
    assert main(["analyze", str(runs["lm"]), "--sample", "2", "--out", str(tmp_path)]) == 2
    assert "holds a metadata.json that no analysis wrote" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metadata.json", "table1.csv"]
    assert (tmp_path / "metadata.json").read_text() == metadata


@pytest.mark.slow
def test_the_statistics_read_as_many_chunks_as_asked(runs, tmp_path, capsys):
    """`analyze --sample N`: each SwitchHead head routes every token of N text chunks to k experts a side."""
    lm = str(runs["lm"])
    assert main(["analyze", lm, "--sample", "0", "--out", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.strip() == "switchbench analyze: error: --sample must be >= 1; got 0"
    run_folder = str(runs["lm"].parent)  # stands for its checkpoint.pt (it was read as a file, and refused)
    assert main(["analyze", run_folder, "--sample", "3", "--out", str(tmp_path / "three")]) == 0
    cfg = PRESETS["tiny-switchhead"]
    usage = read_csv(tmp_path / "three" / "usage.csv")
    per_head = usage.groupby(["layer", "head", "side"])["count"].sum()
    assert len(per_head) == cfg.n_layers * cfg.n_heads * 2 and (per_head == 3 * cfg.T * cfg.k).all()


@pytest.mark.slow
def test_resume_continues_where_it_stopped(tmp_path):
    cfg = TrainConfig(
        "listops", "listops-switchhead-h2", steps=4, batch=4, eval_every=2, warmup=1, val_size=16
    )
    train(cfg, tmp_path / "straight", progress=False)
    train(TrainConfig(**{**cfg.__dict__, "steps": 2}), tmp_path / "resumed", progress=False)
    train(cfg, tmp_path / "resumed", resume=True, progress=False)
    a, b = (checkpoint.load(tmp_path / r / "checkpoint.pt") for r in ("straight", "resumed"))
    assert a["step"] == b["step"] == 4
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, msg=name)
    assert len((tmp_path / "resumed" / "log.csv").read_text().splitlines()) == 3


@pytest.mark.slow  # trains twice
def test_a_run_stops_once_three_evaluations_in_a_row_reach_its_target_and_stays_stopped(tmp_path):
    """The main job trains the ListOps trio until the analysis' accuracy holds, not to an arbitrary step."""
    cfg = TrainConfig(
        "listops",
        "listops-transformer-h8",
        steps=20,
        batch=4,
        eval_every=2,
        warmup=1,
        val_size=8,
        stop_at=0.0,
    )
    train(cfg, tmp_path, progress=False)
    assert read_csv(tmp_path / "log.csv")["step"].tolist() == [2, 4, 6]  # the third evaluation meets it
    assert checkpoint.load(tmp_path / "checkpoint.pt")["step"] == 6
    result = train(TrainConfig(**{**cfg.__dict__, "steps": 40}), tmp_path, resume=True, progress=False)
    assert result["step"] == 6 and read_csv(tmp_path / "log.csv")["step"].tolist() == [2, 4, 6]


@pytest.mark.parametrize(
    ("accuracies", "met"),
    [
        ([0.86, 0.85, 0.87], True),
        ([0.80, 0.85, 0.86, 0.851], True),
        ([0.86, 0.86, 0.84, 0.86, 0.86], False),  # one miss among the last three
        ([0.9, 0.9], False),  # too few evaluations
    ],
)
def test_the_target_needs_three_evaluations_in_a_row(accuracies, met):
    rows = [{"step": 500 * (i + 1), "val_accuracy": a} for i, a in enumerate(accuracies)]
    assert _reached(rows, 0.85) is met
    assert _reached(rows, None) is False


def test_the_learning_rate_warms_up_linearly_then_decays_by_a_cosine_to_a_tenth():
    """By hand, 4 warm-up steps of 10 at a peak of 1e-3: a quarter of the peak at step 0 up to the peak at step 3,
    then the cosine from the peak at step 4 down to a tenth at step 10 and after."""
    cfg = TrainConfig("listops", "listops-transformer-h8", steps=10, warmup=4, lr=1e-3)
    for step, rate in enumerate([0.25e-3, 0.5e-3, 0.75e-3, 1e-3]):
        assert learning_rate(step, cfg) == pytest.approx(rate)
    for step in range(4, 12):
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 4) / 6)))
        assert learning_rate(step, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * cosine))
    assert learning_rate(10, cfg) == pytest.approx(1e-4) and learning_rate(7, cfg) == pytest.approx(0.55e-3)


def test_every_step_clips_the_gradients_norm_to_the_configured_bound(tmp_path, monkeypatch):
    """Each step's gradients, all parameters together, are scaled to a norm of at most ``clip`` before the
    optimizer reads them: the norm is read off the gradients themselves just after the clip."""
    clip_grad_norm = torch.nn.utils.clip_grad_norm_
    seen = []

    def clipped(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        before = clip_grad_norm(parameters, max_norm, *args, **kwargs)
        after = torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in parameters if p.grad is not None])
        )
        seen.append((max_norm, before.item(), after.item()))
        return before

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clipped)
    cfg = TrainConfig(
        "listops", "listops-transformer-h8", steps=2, batch=4, eval_every=2, val_size=8, clip=1e-3
    )
    train(cfg, tmp_path, progress=False)
    assert [bound for bound, _, _ in seen] == [1e-3, 1e-3]
    assert all(before > 1e-3 and after == pytest.approx(1e-3, rel=1e-3) for _, before, after in seen)


@pytest.mark.slow  # trains twice
def test_a_run_resumed_to_more_steps_restarts_its_cosine_and_logs_each_rate(tmp_path):
    """The main job trains ListOps in stages: each resumes the last and runs a cosine of its own to its end."""
    short = TrainConfig(
        "listops", "listops-transformer-h8", steps=4, batch=4, eval_every=1, warmup=1, val_size=8
    )
    train(short, tmp_path, progress=False)
    train(TrainConfig(**{**short.__dict__, "steps": 8}), tmp_path, resume=True, progress=False)
    logged = dict(read_csv(tmp_path / "log.csv")[["step", "lr"]].itertuples(index=False))

    def cosine(step: int, steps: int) -> float:  # by hand: to a tenth of the peak, after one warm-up step
        return 1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - 1) / (steps - 1))))

    assert logged[1] == pytest.approx(1e-3)  # the warm-up's one step at the peak
    for step in (2, 3, 4):
        assert logged[step] == pytest.approx(cosine(step - 1, 4))
    for step in range(5, 9):
        assert logged[step] == pytest.approx(cosine(step - 1, 8))
    assert logged[5] > 2 * logged[4]  # the restart


class Evil:
    pass


@pytest.mark.slow
def test_bad_checkpoints_are_clear_errors(runs, tmp_path, capsys):
    good = runs["listops-switchhead-h2"]
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:2000])
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, other)
    pickled = tmp_path / "pickled.pt"
    torch.save({"format": checkpoint.FORMAT, "payload": Evil()}, pickled)
    mismatched = tmp_path / "mismatched.pt"
    payload = torch.load(good, weights_only=True)
    payload["config"]["d_model"] = 64
    torch.save(payload, mismatched)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"hello, not a checkpoint")  # the unpickler's error is a bare number, KeyError(104)
    cases = {
        tmp_path / "missing.pt": "no such checkpoint",
        junk: "another format: KeyError",
        truncated: "not a readable checkpoint",
        other: "not a switchbench checkpoint",
        pickled: "not a readable checkpoint",  # weights_only refuses the object
        mismatched: "weights do not match the configuration",
    }
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message):
            checkpoint.load(path)
        assert main(["analyze", str(path), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    (tmp_path / "run" / "checkpoint.pt").mkdir(parents=True)  # a run folder whose checkpoint is a folder
    assert main(["analyze", str(tmp_path / "run"), "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip().endswith("checkpoint.pt: a folder, not a checkpoint file")


@pytest.mark.slow  # the trained runs
def test_an_input_longer_than_the_model_reads_is_refused(runs, tmp_path, capsys):
    """An LM's --input used to be cut to its last T bytes while metadata.json kept the whole string; ListOps already
    refused one too long."""
    T = PRESETS["tiny-switchhead"].T
    assert main(["analyze", str(runs["lm"]), "--input", "x" * (T + 1), "--out", str(tmp_path / "a")]) == 2
    assert (
        capsys.readouterr().err.strip().endswith(f"the input has {T + 1} bytes; this model reads at most {T}")
    )
    assert not (tmp_path / "a").exists()


def test_a_pickle_of_another_protocol_is_one_line(tmp_path, capsys, recwarn):
    """torch's warning of a protocol other than its own came above the error: two lines of stderr, not one."""
    path = tmp_path / "p4.pt"
    path.write_bytes(pickle.dumps({"format": checkpoint.FORMAT}, protocol=4))
    assert main(["analyze", str(path), "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"switchbench analyze: error: {path}: not a readable checkpoint (cut short, or another format: Weights only "
        "load failed)"
    ]
    assert not [w for w in recwarn if "pickle protocol" in str(w.message)]


def test_checkpoint_from_before_the_xl_terms_loads(tmp_path):
    """A configuration saved before ``xl_bias_and_scale`` existed was built without u, v and a learned scale."""
    cfg = PRESETS["tiny-transformer"].replace(xl_bias_and_scale=False)
    model = LanguageModel(cfg)
    path = tmp_path / "old.pt"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint.save(path, task="lm", cfg=cfg, model=model, optimizer=optimizer, step=0, train={})
    payload = torch.load(path, weights_only=True)
    del payload["config"]["xl_bias_and_scale"]
    torch.save(payload, path)
    loaded = checkpoint.load(path)
    assert loaded["cfg"] == cfg


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_checkpoint_of_weights_that_are_not_finite_is_refused(value, tmp_path, capsys):
    """Training never saves them (it stops at the first): such a file was analysed into NaN statistics without a
    word, and a resumed run trained nothing."""
    cfg = PRESETS["tiny-switchhead"]
    model = LanguageModel(cfg)
    name, weight = list(model.state_dict().items())[-1]
    weight.view(-1)[-1] = value
    path = tmp_path / "run" / "checkpoint.pt"
    path.parent.mkdir()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint.save(path, task="lm", cfg=cfg, model=model, optimizer=optimizer, step=0, train={})
    message = f"{path}: the weight {name!r} is not finite (NaN or inf)"
    with pytest.raises(ValueError, match=re.escape(message)):
        checkpoint.load(path)
    assert main(["analyze", str(path), "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"switchbench analyze: error: {message}"]
    assert not (tmp_path / "x").exists()


def test_byte_labels_are_ascii_or_hex():
    """A byte above 0x7f is part of a UTF-8 sequence: 'é' (c3 a9) was labelled 'Ã' '©', letters the text never held."""
    labels = [text.decode_token(b) for b in "aé \n\t~".encode() + bytes([0x7F, 0x97])]
    assert labels == ["a", "\\xc3", "\\xa9", "␣", "\\n", "\\t", "~", "\\x7f", "\\x97"]


@pytest.mark.parametrize("task", ["listops", "lm"])
def test_a_moh_model_whose_heads_are_all_shared_is_analysed(task, tmp_path):
    """MoH with every head shared (routed_k 0, which the configuration allows) chooses no head: its maps are
    analysed and no routing is counted (it recorded experts=None, which analyze read as a tensor)."""
    base = PRESETS["tiny-moh"] if task == "lm" else PRESETS["listops-transformer-h8"]
    cfg = base.replace(model="moh", n_layers=1, n_heads=2, options=(("shared_heads", 2), ("routed_k", 0)))
    n_classes = listops.N_CLASSES if task == "listops" else None
    model = checkpoint.build_model(task, cfg, n_classes)
    path = tmp_path / "moh" / "checkpoint.pt"
    path.parent.mkdir()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_meta = {"seed": 0, "preset": "moh-shared", "task": task}
    checkpoint.save(
        path,
        task=task,
        cfg=cfg,
        model=model,
        optimizer=optimizer,
        step=0,
        train=train_meta,
        n_classes=n_classes,
    )
    source = "To be" if task == "lm" else None
    written = {p.name for p in analyze([path], tmp_path / "out", source=source, sample=4)}
    assert {"attention_maxima.png", "explorer.html"} <= written and "usage.csv" not in written


@pytest.mark.slow  # two trainings of 8 steps each
@pytest.mark.parametrize(
    ("task", "preset"),
    [
        ("lm", "tiny-transformer:dropout=0.1"),
        ("lm", "tiny-switchhead:dropout=0.1"),
        ("listops", "listops-transformer-h8:dropout=0.1"),
    ],
)
def test_a_run_stopped_and_resumed_is_the_run_straight_through(task, preset, tmp_path, monkeypatch):
    """Stopped after its checkpoint at step 4 and resumed, a run of 8 steps ends with the weights and figures of one
    that ran straight through: the XL memory its next chunk attends to and dropout's generator come back with
    the weights (a resumed LM run attended to no memory at its first step, and dropout drew step 0's masks again)."""
    kwargs = {"steps": 8, "batch": 4, "warmup": 2, "eval_every": 4, "val_size": 16}
    if task == "lm":  # a short text: a short held-out score (42 chunks a stream, so step 5 follows step 4)
        text = tmp_path / "text.txt"
        text.write_text("".join(f"line {i}: to be, or not to be.\n" for i in range(200)))
        kwargs["text"] = str(text)
    cfg = TrainConfig(task, preset, **kwargs)
    straight = train(cfg, tmp_path / "straight", progress=False)
    save = checkpoint.save

    class Stopped(Exception):
        pass

    def save_then_stop(path, **saved):
        save(path, **saved)
        if saved["step"] == 4:
            raise Stopped

    monkeypatch.setattr(checkpoint, "save", save_then_stop)
    with pytest.raises(Stopped):
        train(cfg, tmp_path / "resumed", progress=False)
    monkeypatch.setattr(checkpoint, "save", save)
    resumed = train(cfg, tmp_path / "resumed", resume=True, progress=False)
    assert resumed["loss"] == straight["loss"]
    a, b = (checkpoint.load(tmp_path / r / "checkpoint.pt")["model"] for r in ("straight", "resumed"))
    assert all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.slow  # a training
def test_a_checkpoint_at_a_negative_step_is_refused(tmp_path):
    """A step below 0 would train steps -3 to 0 at a negative learning rate (the warm-up's), climbing the loss."""
    cfg = TrainConfig(
        "listops", "listops-transformer-h8", steps=2, batch=4, eval_every=2, warmup=1, val_size=8
    )
    train(cfg, tmp_path, progress=False)
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    saved["step"] = -3
    torch.save(saved, tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match="step -3 is negative"):
        train(cfg, tmp_path, resume=True, progress=False)


@pytest.mark.parametrize(
    ("moment", "says"),
    [
        (torch.zeros(3), r"the optimizer state does not fit \(exp_avg of shape \(3,\)"),
        pytest.param(
            "x", "the optimizer state's exp_avg is no tensor", marks=pytest.mark.slow
        ),  # a training each
    ],
    ids=["another shape", "text"],
)
def test_optimizer_moments_of_another_shape_or_kind_are_refused_at_the_resume(moment, says, tmp_path):
    """load_state_dict takes moments of any shape or kind; the first step then failed, exit 3, with a RuntimeError
    (or an AttributeError: a str has no lerp_)."""
    cfg = TrainConfig(
        "listops", "listops-transformer-h8", steps=2, batch=4, eval_every=2, warmup=1, val_size=8
    )
    train(cfg, tmp_path, progress=False)
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    saved["optimizer"]["state"][0]["exp_avg"] = moment
    torch.save(saved, tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match=says):
        train(TrainConfig(**{**cfg.__dict__, "steps": 4}), tmp_path, resume=True, progress=False)


@pytest.mark.slow  # a training and two resumes
def test_a_checkpoint_that_does_not_record_its_settings_is_held_to_their_defaults(tmp_path):
    """A ``train`` record without the batch, rate or seed passed every comparison with this run's settings, so
    one log told two trainings as one. Unrecorded (older code), a setting ran at its default."""
    cfg = TrainConfig(
        "listops", "listops-transformer-h8", steps=2, batch=4, eval_every=2, warmup=1, val_size=8
    )
    train(cfg, tmp_path, progress=False)
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    del saved["train"]["batch"], saved["train"]["seed"]
    torch.save(saved, tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match=r"trained with batch 32 \(its default, unrecorded\) \(not 4\)"):
        train(TrainConfig(**{**cfg.__dict__, "steps": 4}), tmp_path, resume=True, progress=False)
    assert train(
        TrainConfig(**{**cfg.__dict__, "steps": 4, "batch": 32}), tmp_path, resume=True, progress=False
    )


@pytest.mark.slow  # a training each
@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.update(rng={"cpu": torch.zeros(3, dtype=torch.uint8)}),
        lambda p: p.update(rng={"x": 1}),
        lambda p: p.update(memory={"x": 1}),
        lambda p: p.update(memory={"offset": 0, "mems": [torch.tensor(1.0)]}),
    ],
    ids=["rng of another size", "rng without cpu", "memory without mems", "memory of scalars"],
)
def test_a_checkpoint_whose_memory_or_generator_is_malformed_is_refused_at_the_resume(damage, tmp_path):
    """They failed at the restore or the first step, exit 3 (a RuntimeError, KeyError or IndexError)."""
    cfg = TrainConfig("lm", "tiny-switchhead", steps=2, batch=2, eval_every=2, warmup=1)
    train(cfg, tmp_path, progress=False)
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    damage(saved)
    torch.save(saved, tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match="its XL memory or generator state is malformed"):
        train(TrainConfig(**{**cfg.__dict__, "steps": 4}), tmp_path, resume=True, progress=False)
