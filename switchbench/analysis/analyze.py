"""The routing analysis of trained checkpoints: attention-map maxima, per-head expert selections, usage
statistics; figures (PNG, SVG) with the numbers behind them (CSV) under one folder."""

import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from switchbench.analysis import explorer, plots, similarity, stats
from switchbench.bench.command import add_json, emit
from switchbench.bench.cost.measure import free_memory
from switchbench.bench.timing.benches import estimated_bytes
from switchbench.core.environment import environment
from switchbench.core.results import (
    refuse_folders_named_as_files,
    replace_together,
    save_figure,
    writable_folder,
    write_csv,
)
from switchbench.core.schema import read_table
from switchbench.models.layers.observe import observe
from switchbench.train import checkpoint, listops, text

SAMPLE = 256  # sequences (ListOps) or chunks (LM) behind the statistics, by default


def _inputs(
    run: dict, source: str | None, example: int | None, size: int
) -> tuple[torch.Tensor, list[str], torch.Tensor]:
    """(one sequence to plot [1, t], its token labels, a sample for the statistics [B, t])."""
    cfg, seed = run["cfg"], run["train"].get("seed", 0)
    # before the sample is made: 2**31 ListOps examples were generated in Python for hours
    need, free = cfg.n_layers * estimated_bytes(cfg, size, "layer", torch.float32), free_memory("cpu")
    if need > free:
        raise ValueError(
            f"--sample {size}: observing it needs at least {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        )
    if example is not None and run["task"] != "listops":
        raise ValueError(
            "--example picks a ListOps validation example; a language model reads --input or its text"
        )
    if run["task"] == "listops":
        data_cfg = listops.ListOpsConfig(max_length=cfg.T)
        sample = listops.generate(size, seed=10**6 + seed, cfg=data_cfg)
        if source is not None:
            tokens = listops.tokenize(source)
            if not tokens:
                raise ValueError("--input holds no ListOps tokens")
            if len(tokens) > cfg.T:
                raise ValueError(f"the input has {len(tokens)} tokens; this model reads at most {cfg.T}")
        else:
            if example is None:  # the longest example shows the most structure
                example = max(range(size), key=lambda i: len(sample[i][0]))
            if not 0 <= example < size:
                raise ValueError(f"--example must be in [0, {size}); got {example}")
            tokens = sample[example][0]
        ids, _ = listops.encode([(tokens, 0)], len(tokens))
        return ids, tokens, listops.encode(sample, cfg.T)[0]
    data = text.encode(text.load_text(run["train"].get("text"), run["train"].get("hf_dataset")))
    ids = text.encode(source) if source is not None else data[: cfg.T]
    if ids.numel() > cfg.T:  # cut, the plot and metadata.json's input would tell two different sequences
        raise ValueError(f"the input has {ids.numel()} bytes; this model reads at most {cfg.T}")
    rows = min(size, data.numel() // cfg.T)
    if ids.numel() == 0 or rows == 0:
        raise ValueError(f"the text is too short: the model reads chunks of {cfg.T} bytes")
    sample = data[: rows * cfg.T].view(rows, cfg.T)
    return ids[None], [text.decode_token(int(t)) for t in ids], sample


def _observe(run: dict, tokens: torch.Tensor) -> dict[str, dict]:
    with torch.no_grad(), observe(run["module"]) as records:
        run["module"](tokens)
    return records


def _observe_sample(run: dict, tokens: torch.Tensor) -> dict[str, dict]:
    """:func:`_observe` over a sample. ListOps' classifier has no padding mask and trains and validates each length
    unpadded: each length runs alone, its records put back into [B, T, ...] with zeros at the padding (read
    padded, the sample's padding took 49 to 90% of the real tokens' attention past the first layer)."""
    if run["task"] != "listops":
        return _observe(run, tokens)
    B, T = tokens.shape
    lengths = (tokens != listops.TOKEN_ID[listops.PAD]).sum(1)
    merged: dict[str, dict] = {}
    for n in lengths.unique().tolist():
        rows = (lengths == n).nonzero().flatten()
        for module, record in _observe(run, tokens[rows, :n]).items():
            for key, value in record.items():
                maps = key == "maps"  # [b, H, n, n]; every other record [b, n, ...]
                shape = (B, value.shape[1], T, T) if maps else (B, T, *value.shape[2:])
                full = merged.setdefault(module, {}).setdefault(key, value.new_zeros(shape))
                full[(rows, slice(None), slice(n), slice(n)) if maps else (rows, slice(n))] = value
    return merged


def _attention(records: dict) -> list[dict]:
    return [records[name] for name in sorted(records, key=_layer) if name.endswith(".attn")]


def _layer(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("blocks") + 1]) if "blocks" in parts else -1


def analyze(
    paths: list[Path],
    out: Path,
    source: str | None = None,
    example: int | None = None,
    sample: int = SAMPLE,
    provenance: dict | None = None,
) -> list[Path]:
    """Figures and CSVs of checkpoints of one task; ``sample`` sequences (or LM chunks) feed the statistics.
    ``provenance`` (the main job's mode, training steps and starting commit) goes into metadata.json, with the
    files written. An earlier analysis in ``out`` is replaced: its files that this one does not write again (another
    model's selections, a similarity of models no longer analysed) are removed once this one is written.

    The files are made in a staging folder, then put in ``out`` together, metadata.json last: an analysis stopped
    on its way (minutes of observing models) leaves the earlier one as it was, not a folder of both."""
    started = environment("cpu") | (provenance or {})  # before this run's own files change the checkout
    runs = _load(paths)
    logs = _logs(runs, paths)  # read (and checked) before any work
    out = Path(out)
    earlier = _files_of(out)
    with tempfile.TemporaryDirectory(prefix="switchbench-analysis-") as staging:
        staged, made = _analysis(runs, logs, paths, Path(staging), source, example, sample)
        metadata = started | made
        writers = {out / p.name: functools.partial(shutil.copyfile, p) for p in staged}
        writers[out / "metadata.json"] = lambda tmp: tmp.write_text(json.dumps(metadata, indent=2))
        written = replace_together(writers)
    for name in earlier - set(metadata["files"]):
        (out / name).unlink(missing_ok=True)
    return written


def _analysis(
    runs: list[dict],
    logs: list,
    paths: list[Path],
    out: Path,
    source: str | None,
    example: int | None,
    sample: int,
) -> tuple[list[Path], dict]:
    """Every file of the analysis written into ``out``, and what its metadata records of them (not yet written)."""
    written = []
    maxima, sample_maxima, rows = {}, {}, {"usage": [], "summary": [], "cooccurrence": [], "preferences": []}
    # Every model reads the same inputs (those of the first run's seed), so their maps can be compared.
    ids, labels, tokens = _inputs(runs[0], source, example, sample)
    for run in runs:
        attention = _attention(_observe(run, ids))
        maxima[run["name"]] = [a["maps"][0].amax(0).float().numpy() for a in attention]
        written += _selections(run, attention, labels, out)
        records = _observe_sample(run, tokens)
        sample_maxima[run["name"]] = [
            a["maps"].amax(1).float().numpy() for a in _attention(records)
        ]  # [B, T, T]
        written += _statistics(run, records, tokens, rows, out)
    title = "Attention maxima over heads, per layer (post-softmax, first sequence)"
    written += save_figure(plots.attention_maxima(maxima, title), out / "attention_maxima")
    for name, table in rows.items():
        if table:
            written.append(write_csv(out / f"{name}.csv", table))
    if len(runs) > 1:
        written += _similarity(runs, sample_maxima, tokens, out)
    written += _curves(logs, runs[0]["task"], out)
    written.append(_explorer(runs, ids, tokens, out))

    metadata = {
        "command": COMMAND,
        "checkpoints": [
            {"path": str(p), "step": r["step"], "train": r["train"]} for p, r in zip(paths, runs, strict=True)
        ],
        "input": source,
        "example": example,
        "tokens": list(labels),  # the plotted sequence, which the attention-maxima figure counts in positions
        "sample": sample,
        "files": sorted(p.name for p in written),
    }
    return written, metadata


COMMAND = "switchbench analyze"  # in the metadata.json an analysis writes: what marks a folder as one


def _files_of(out: Path) -> set[str]:
    """The files an earlier analysis in ``out`` wrote, as its metadata.json lists them. A metadata.json another
    command wrote (the tables', the runs') is refused before any work: an analysis replaces its own metadata.json
    and removes the files it lists, and `analyze --out results/tables` deleted the fifteen tables. Only plain names
    count: nothing outside ``out``."""
    path = out / "metadata.json"
    if not path.exists():
        return set()
    try:
        metadata = json.loads(path.read_text())
    except (OSError, ValueError):
        metadata = None
    if not isinstance(metadata, dict) or metadata.get("command") != COMMAND:
        raise ValueError(
            f"--out {out} holds a metadata.json that no analysis wrote: give a folder of its own"
        )
    files = metadata.get("files", [])
    return {
        name
        for name in files
        if isinstance(name, str) and name == Path(name).name and name != "metadata.json"
    }


def explore(
    paths: list[Path], out: Path, source: str | None = None, example: int | None = None, sample: int = SAMPLE
) -> Path:
    """The routing explorer alone (``out/explorer.html``), on the sequences :func:`analyze` would give it."""
    runs = _load(paths)
    ids, _, tokens = _inputs(runs[0], source, example, sample)
    return _explorer(runs, ids, tokens, Path(out))


def _load(paths: list[Path]) -> list[dict]:
    """The checkpoints, named, if they can be analysed together: one task, one sequence length."""
    names = [_name(p) for p in paths]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:  # each model's figures, rows and pairs are keyed by its name
        raise ValueError(f"two checkpoints are named {', '.join(repeated)}: analyse runs of different names")
    runs = [checkpoint.load(p) | {"name": name} for p, name in zip(paths, names, strict=True)]
    if len({r["task"] for r in runs}) > 1:
        raise ValueError("the checkpoints are of different tasks; analyse ListOps and LM runs apart")
    if len({r["cfg"].T for r in runs}) > 1:
        raise ValueError("the checkpoints read sequences of different lengths; analyse them apart")
    return runs


def _explorer(runs: list[dict], ids: torch.Tensor, sample: torch.Tensor, out: Path) -> Path:
    """explorer.html: every model observed on the plotted sequence and the sample's longest others."""
    explored, task = _explorer_sequences(runs[0], ids, sample), runs[0]["task"]
    models = [
        explorer.model(
            run["name"],
            run["cfg"],
            _trained(run),
            [explorer.layers(_attention(_observe(run, sequence))) for sequence, _ in explored],
        )
        for run in runs
    ]
    sequences = [
        {
            "name": name,
            "tokens": [_label(runs[0], int(t)) for t in sequence[0]],
            "line_ends": (sequence[0] == ord("\n")).nonzero().flatten().tolist() if task == "lm" else [],
        }
        for sequence, name in explored
    ]
    title = f"Routing explorer: {'ListOps' if task == 'listops' else 'byte-level text'}"
    return explorer.write(out / "explorer.html", title, sequences, models)


def _explorer_sequences(run: dict, ids: torch.Tensor, sample: torch.Tensor) -> list[tuple[torch.Tensor, str]]:
    """The explorer's sequences [1, t] with their names: the plotted one, then the sample's longest others (they
    show the most structure; ListOps without its padding), each cut to the explorer's length."""
    rows = [row[row != listops.TOKEN_ID[listops.PAD]] if run["task"] == "listops" else row for row in sample]
    found = [(ids[:, : explorer.POSITIONS], f"the plotted sequence, {ids.shape[1]} tokens")]
    # sorted is stable: of equal lengths, the first comes first
    longest = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    for i in longest:
        row = rows[i][None, : explorer.POSITIONS]
        if len(found) < explorer.SEQUENCES and not torch.equal(row, found[0][0]):
            found.append((row, f"sample {i}, {row.shape[1]} tokens"))
    return found


def _trained(run: dict) -> str:
    return f"{run['step']:,} training steps" if run["step"] else "untrained"


def _similarity(runs: list[dict], maxima: dict, tokens: torch.Tensor, out: Path) -> list[Path]:
    """similarity.csv and its plot: every pair of models, per layer, over the real tokens of the sample."""
    lengths = (
        (tokens != listops.TOKEN_ID[listops.PAD]).sum(1).tolist()
        if runs[0]["task"] == "listops"
        else [tokens.shape[1]] * len(tokens)
    )
    presets = {r["name"]: r["train"]["preset"] for r in runs}
    table = similarity.similarity_table(maxima, presets, lengths, causal=runs[0]["cfg"].causal)
    title = f"Attention maxima over heads compared row by row ({len(tokens)} sequences)"
    return [
        write_csv(out / "similarity.csv", table),
        *save_figure(plots.similarity(table, title), out / "similarity"),
    ]


def _name(path: Path) -> str:
    path = Path(path).resolve()  # "checkpoint.pt" in the run's folder has no parent's name as typed
    return path.parent.name if path.name == "checkpoint.pt" else path.stem


def _selections(run: dict, attention: list[dict], labels: list[str], out: Path) -> list[Path]:
    """Per-head expert selections of SwitchHead layers: attention map with the gates as strips."""
    cfg, written = run["cfg"], []
    if cfg.family.routing != "experts":
        return written
    for layer, record in enumerate(attention):
        for head in range(cfg.n_heads):
            dst = _dense_gates(record.get("dst_experts"), record.get("dst_gates"), head, cfg.n_experts)
            src = _dense_gates(record.get("src_experts"), record.get("src_gates"), head, cfg.n_experts)
            title = f"{run['name']}: layer {layer}, head {head}"
            fig = plots.expert_selection(
                record["maps"][0, head].float().numpy(), dst, src, labels, labels, title
            )
            written += save_figure(fig, out / f"{run['name']}-selection-layer{layer}-head{head}")
    return written


def _side_label(cfg, side: str) -> str:
    """A routed attention side as the figures name it: V/O experts, or the family's head choice."""
    return cfg.family.label if cfg.family.routing == "heads" else {"src": "V", "dst": "O"}[side]


def _dense_gates(experts, gates, head: int, n_experts: int) -> np.ndarray:
    """[L, E]: the top-k gate values of one head, 0 for experts not chosen (an empty side is all zeros)."""
    if experts is None:
        return np.zeros((0, n_experts))
    dense = torch.zeros(experts.shape[1], n_experts)
    dense.scatter_(1, experts[0, :, head], gates[0, :, head].float())
    return dense.numpy()


def _statistics(run: dict, records: dict, sample: torch.Tensor, rows: dict, out: Path) -> list[Path]:
    cfg, name, panels, written, cooc = run["cfg"], run["name"], [], [], {}
    tokens = sample.reshape(-1)
    # ListOps pads its sequences: padding positions say nothing about routing
    keep = (
        tokens != listops.TOKEN_ID[listops.PAD]
        if run["task"] == "listops"
        else torch.ones_like(tokens, dtype=bool)
    )
    tokens = tokens[keep]
    for module, record in sorted(records.items(), key=lambda item: (_layer(item[0]), item[0])):
        layer, kind = _layer(module), module.rsplit(".", 1)[-1]
        sides = {side: record[f"{side}_experts"] for side in ("src", "dst") if f"{side}_experts" in record}
        if "experts" in record:  # MoA heads or sigma-MoE, one router
            sides = {"dst": record["experts"][..., None, :]}
        n_experts = cfg.mlp_experts if kind == "mlp" else cfg.family.choices(cfg)
        for side, experts in sides.items():
            experts = experts[:, -sample.shape[1] :]  # the current tokens (the source side may hold memory)
            for head in range(experts.shape[2]):
                chosen = experts[:, :, head].reshape(-1, experts.shape[-1])[keep]
                counts = stats.usage(chosen, n_experts)
                where = {"model": name, "layer": layer, "module": kind, "head": head, "side": side}
                rows["usage"] += [
                    where | {"expert": e, "count": int(c)} for e, c in enumerate(counts.tolist())
                ]
                rows["summary"].append(
                    where
                    | {
                        "entropy": stats.entropy(counts),
                        "perplexity": stats.perplexity(counts),
                        "dead_experts": " ".join(map(str, stats.dead_experts(counts))),
                    }
                )
                label = "MLP" if kind == "mlp" else _side_label(cfg, side)
                panels.append((f"layer {layer} {label} head {head}", counts.numpy()))
                if kind == "mlp" or layer > 0:  # a first-layer attention router sees the token alone
                    rows["preferences"] += [
                        where | {"expert": e, "token": _label(run, t), "lift": lift, "share": s, "count": c}
                        for e, t, lift, s, c in stats.token_preferences(chosen, tokens, n_experts)
                    ]
        if "src_experts" in record and "dst_experts" in record:
            for head in range(cfg.n_heads):
                v = record["src_experts"][:, -sample.shape[1] :, head].reshape(-1, cfg.k)[keep]
                o = record["dst_experts"][:, :, head].reshape(-1, cfg.k)[keep]
                counts = stats.cooccurrence(v, o, cfg.n_experts)
                rows["cooccurrence"] += [
                    {
                        "model": name,
                        "layer": layer,
                        "head": head,
                        "v_expert": i,
                        "o_expert": j,
                        "count": int(counts[i, j]),
                    }
                    for i in range(cfg.n_experts)
                    for j in range(cfg.n_experts)
                ]
                cooc[(layer, head)] = counts.numpy()
    if panels:
        title = f"{name}: expert usage over {len(sample)} sequences (sorted)"
        written += save_figure(plots.usage_bars(panels, title), out / f"{name}-usage")
    if cooc:
        title = f"{name}: tokens choosing each V expert (source) and O expert (destination)"
        written += save_figure(plots.cooccurrence_grid(cooc, title), out / f"{name}-cooccurrence")
    return written


def _label(run: dict, token: int) -> str:
    return listops.VOCAB[token] if run["task"] == "listops" else text.decode_token(token)


def _logs(runs: list[dict], paths: list[Path]) -> list[pd.DataFrame]:
    """The training log beside each checkpoint that has one, with the run's name."""
    return [
        read_table(Path(path).parent / "log.csv", "log").assign(model=run["name"])
        for run, path in zip(runs, paths, strict=True)
        if (Path(path).parent / "log.csv").exists()
    ]


def _curves(logs: list[pd.DataFrame], task: str, out: Path) -> list[Path]:
    if not logs:
        return []
    rows = pd.concat(logs, ignore_index=True)
    rows = rows[["model", *(c for c in rows.columns if c != "model")]]
    metric = "val_accuracy" if task == "listops" else "val_bits_per_byte"
    written = save_figure(plots.training_curves(rows, metric, "Training curves"), out / "training_curves")
    return [*written, write_csv(out / "training_log.csv", rows)]


def register(commands) -> None:
    parser = commands.add_parser("analyze", help="attention maxima, expert selections and routing statistics")
    parser.add_argument(
        "checkpoints",
        nargs="+",
        metavar="CHECKPOINT",
        help="a trained model's checkpoint, or its run folder (runs/NAME/checkpoint.pt, or runs/NAME)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--input", help="text to analyse (ListOps tokens, or any text for an LM)")
    source.add_argument(
        "--example", type=int, help="ListOps: which validation example (default: the longest)"
    )
    parser.add_argument(
        "--sample",
        type=int,
        default=SAMPLE,
        help="ListOps sequences or text chunks behind the statistics (default %(default)s)",
    )
    parser.add_argument("--out", help="default: results/analysis/<first run>")
    add_json(parser)
    parser.set_defaults(run=_run)


def _run(args) -> None:
    if args.sample < 1:
        raise ValueError(f"--sample must be >= 1; got {args.sample}")
    # a run folder stands for its checkpoint, as `train` writes it
    checkpoints = [Path(p) / "checkpoint.pt" if Path(p).is_dir() else Path(p) for p in args.checkpoints]
    out = writable_folder(Path(args.out or Path("results/analysis") / _name(checkpoints[0])))
    refuse_folders_named_as_files(out, (".csv", ".json", ".png", ".svg", ".html"))
    written = analyze(checkpoints, out, args.input, args.example, args.sample)
    if args.json:
        emit({"out": str(out), "written": [str(p) for p in written]}, True)
        return
    print(f"wrote {len(written)} files under {out}")
