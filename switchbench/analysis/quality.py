"""Quality at equal parameters, against compute: parameter-matched dense, SwitchHead, MoA and SwitchAll byte-level
language models, each trained for the same number of tokens with several seeds, compared on held-out bits per byte
with intervals across seeds, beside each run's training MACs (exact count), wall-clock and memory.

Every run is ``train.train``'s LM task (the embedded text, a file or a saved Hugging Face dataset) in a temporary
folder: only its numbers are kept. Seeds change the initialisation (and dropout); the batches and the held-out
bytes are the same for every run.
"""

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from switchbench.analysis import plots
from switchbench.analysis.intervals import difference_interval, mean_interval
from switchbench.bench.command import (
    Distinct,
    add_json,
    add_kernel_choices,
    describe_kernels,
    device_from_args,
    format_table,
    kernel_metadata,
    slug,
)
from switchbench.bench.cost.accounting import model_macs
from switchbench.bench.cost.measure import count_saved_bytes
from switchbench.bench.cost.params import parameter_counts
from switchbench.bench.timing.benches import too_large
from switchbench.bench.timing.timer import cpu_threads, intra_op_threads
from switchbench.core.environment import environment
from switchbench.core.results import (
    frame,
    new_run_stem,
    save_figure,
    writable_folder,
    write_atomic,
    write_csv,
)
from switchbench.models import family as registry
from switchbench.models.config import LARGEST_INT, ModelConfig
from switchbench.models.lm import LanguageModel, count_parameters
from switchbench.models.presets import PRESETS, changes_of, from_name
from switchbench.train.run import LMTask, TrainConfig, read_log, train

CONFIDENCE = 0.95
ADAMW_FLOATS = 4  # per parameter: the weight, its gradient and AdamW's two moments, all fp32

# Every family with a byte-level model, dense first (the baseline of every difference). CPU models: each family's
# "bytes" preset (4 layers of d_model 128, parameter-matched to the dense one). GPU models: each family's "quality"
# preset, the paper's WikiText-103 47M rows (MoA with 4 active heads, its best row there), reading bytes.
FAMILIES = registry.keys("bytes")
CPU_MODELS = {
    family.key: (family.roles["bytes"], PRESETS[family.roles["bytes"]])
    for family in registry.families()
    if "bytes" in family.roles
}
GPU_MODELS = {
    family.key: (f"{family.roles['quality']}-bytes", PRESETS[family.roles["quality"]].replace(vocab=256))
    for family in registry.families()
    if "quality" in family.roles
}


def byte_model(preset: str) -> tuple[str, ModelConfig]:
    """A preset reading bytes: itself, or (another vocabulary) a copy named ``PRESET-bytes``, as the GPU models."""
    cfg = from_name(preset)
    if not cfg.causal:  # it was refused under a name never typed, PRESET-bytes
        raise ValueError(f"--presets: {preset} is a ListOps classifier; quality trains language models")
    if cfg.vocab != 256 and "vocab" in changes_of(
        preset
    ):  # a vocabulary given by hand would be replaced without a word
        raise ValueError(f"--presets: {preset}: quality trains on bytes, vocab 256; got vocab {cfg.vocab}")
    return (preset, cfg) if cfg.vocab == 256 else (f"{preset}-bytes", cfg.replace(vocab=256))


def with_presets(models: dict[str, tuple[str, ModelConfig]], presets: list[str]) -> dict:
    """``models`` (family -> (name, configuration)) with each preset in place of its family's model (another form
    of a family, such as MoH's norm router); a family not in ``models`` joins them, in the registry's order."""
    chosen = {}
    for preset in presets:
        family = from_name(preset).family.key
        if family in chosen:
            raise ValueError(
                f"--presets: {chosen[family][0]} and {preset} are both {family}; one model a family"
            )
        chosen[family] = byte_model(preset)
    merged = models | chosen
    return {family: merged[family] for family in sorted(merged, key=registry.keys().index)}


@dataclass(frozen=True)
class Budget:
    """The defaults of one device and mode; every run of every family trains the same."""

    tokens: int  # per run, rounded up to whole steps
    seeds: int  # per family: 0, 1, ...
    batch: int  # streams of the text, read chunk after chunk
    lr: float
    clip: float


BUDGETS = {
    # One CPU thread: --quick about 4 minutes, the default about an hour (docs/quality.md). The text is about 88 KB of
    # training bytes, so the default reads it about 11 times; the held-out bytes are never trained on.
    ("cpu", True): Budget(tokens=100_000, seeds=2, batch=16, lr=1e-3, clip=1.0),
    ("cpu", False): Budget(tokens=1_000_000, seeds=5, batch=16, lr=1e-3, clip=1.0),
    # The paper's small-model optimiser settings and batch; not timed here.
    ("cuda", True): Budget(tokens=1_000_000, seeds=2, batch=64, lr=2.5e-4, clip=0.1),
    ("cuda", False): Budget(tokens=16_000_000, seeds=3, batch=64, lr=2.5e-4, clip=0.1),
}


# Held-out scores a run records, evenly over its steps (and at its end): a model that memorises its text passes
# its best score before the end, which the final score alone would hide.
EVALUATIONS = 10


@dataclass(frozen=True)
class Plan:
    """What one invocation trains: every family's model, ``seeds`` times, ``steps`` steps each."""

    models: dict[str, tuple[str, ModelConfig]]  # family -> (name, configuration)
    seeds: int
    steps: int
    batch: int
    lr: float
    clip: float
    device: str = "cpu"
    text: str | None = None
    hf_dataset: str | None = None

    def __post_init__(self):
        if self.seeds < 2:
            raise ValueError(f"--seeds must be >= 2: an interval across seeds needs two; got {self.seeds}")
        if len({cfg.T for _, cfg in self.models.values()}) != 1:
            lengths = ", ".join(sorted(f"{preset} T={cfg.T}" for preset, cfg in self.models.values()))
            raise ValueError(f"the models must read chunks of one length, for equal tokens a step: {lengths}")
        # unequal XL memory: one model would see more of the past than another
        if len({cfg.context_blocks for _, cfg in self.models.values()}) != 1:
            memory = ", ".join(
                sorted(f"{p} context_blocks={cfg.context_blocks}" for p, cfg in self.models.values())
            )
            raise ValueError(f"the models must carry one length of XL memory, for equal context: {memory}")
        for family in self.models:
            self.train_config(family, 0)  # checks steps, batch, lr and clip

    @property
    def tokens_per_step(self) -> int:
        return self.batch * next(iter(self.models.values()))[1].T

    def train_config(self, family: str, seed: int) -> TrainConfig:
        name, cfg = self.models[family]
        return TrainConfig(
            "lm",
            name,
            steps=self.steps,
            batch=self.batch,
            lr=self.lr,
            warmup=max(1, self.steps // 10),
            clip=self.clip,
            seed=seed,
            eval_every=max(1, self.steps // EVALUATIONS),
            device=self.device,
            text=self.text,
            hf_dataset=self.hf_dataset,
            model=cfg,
        )

    def describe(self) -> dict:
        first = self.train_config(next(iter(self.models)), 0)
        return {
            "families": list(self.models),
            "models": {
                family: {"name": name, "config": cfg.to_dict()} for family, (name, cfg) in self.models.items()
            },
            "seeds": self.seeds,
            "steps": self.steps,
            "batch": self.batch,
            "tokens_per_run": self.steps * self.tokens_per_step,
            "lr": self.lr,
            "warmup": first.warmup,
            "eval_every": first.eval_every,
            "clip": self.clip,
            "text": self.hf_dataset or self.text or "The Tempest (Shakespeare; embedded, 98 KB)",
        }


def run(plan: Plan, progress: bool = True) -> list[dict]:
    """One row per run. Within a seed the families run one after another, so that a change in the machine's load
    falls on all of them alike."""
    first = plan.train_config(next(iter(plan.models)), 0)
    task = LMTask(first, first.model_config)  # reads and checks the text before any training
    for name, cfg in plan.models.values():  # and the memory, before any model is built to count its own
        too_big = too_large(cfg, plan.batch, "model", plan.device, torch.float32)
        if too_big:
            raise ValueError(f"batch {plan.batch}: a training step of {name} {too_big}")
    costs = {family: _costs(plan, cfg, task) for family, (_, cfg) in plan.models.items()}
    return [
        {"family": family, "preset": plan.models[family][0], "seed": seed}
        | costs[family]
        | _train(plan, family, seed, progress)
        for seed in range(plan.seeds)
        for family in plan.models
    ]


def _train(plan: Plan, family: str, seed: int, progress: bool) -> dict:
    """The run's held-out quality and what it measured."""
    if plan.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory(prefix="switchbench-quality-") as folder:
        train(plan.train_config(family, seed), Path(folder), progress=progress)
        evaluations = read_log(Path(folder) / "log.csv")
    last, best = evaluations[-1], min(evaluations, key=lambda r: r["val_bits_per_byte"])
    bpb = last["val_bits_per_byte"]
    return {
        "val_bits_per_byte": bpb,
        "val_perplexity": 2**bpb,  # per byte
        "best_val_bits_per_byte": best["val_bits_per_byte"],
        "best_step": best["step"],
        "val_curve": [[r["step"], r["val_bits_per_byte"]] for r in evaluations],
        "train_seconds": last["train_seconds"],
        "mfu": _run_mfu(evaluations),
        "matmul_peak_tflops": last["matmul_peak_tflops"],  # what the MFU divides by
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if plan.device == "cuda" else None,
    }


def _run_mfu(evaluations: list[dict]) -> float:
    """The whole run's MFU from its log, each row's MFU being of the steps since the row before: the FLOPs of every
    interval (its MFU x its seconds) over all the seconds."""
    seconds = [r["train_seconds"] for r in evaluations]
    intervals = [b - a for a, b in zip([0.0, *seconds[:-1]], seconds, strict=True)]
    return sum(r["mfu"] * t for r, t in zip(evaluations, intervals, strict=True)) / max(seconds[-1], 1e-9)


def _costs(plan: Plan, cfg: ModelConfig, task: LMTask) -> dict:
    """What a run of ``cfg`` costs whatever its seed: its parameters, training MACs and training-step memory."""
    counts = parameter_counts(cfg)
    return {
        "params": counts["total"],
        "layer_params": counts["per_layer"]["attention_plus_mlp"],
        "steps": plan.steps,
        "tokens": plan.steps * plan.tokens_per_step,
        # a step reads one chunk of every stream: more than one pass and the held-out figure rewards memorising
        "passes_over_text": plan.steps / task.chunks,
        "train_macs": training_macs(cfg, plan.batch, plan.steps, task),
        "memory_bytes": step_memory(cfg, plan.batch, plan.device),
    }


def training_macs(cfg: ModelConfig, batch: int, steps: int, task: LMTask) -> int:
    """3x the exact forward MACs of every step's chunk (the backward as twice the forward, the usual convention);
    a chunk that starts the streams again has no XL memory to attend to."""
    carried = sum(task.continues(step) for step in range(steps))
    fresh = cfg.replace(context_blocks=0)
    return 3 * (carried * model_macs(cfg, batch) + (steps - carried) * model_macs(fresh, batch))


def step_memory(cfg: ModelConfig, batch: int, device: str) -> int:
    """Bytes a training step holds when its forward pass ends: weights, gradients and AdamW's moments, and the
    activations autograd keeps for the backward (measured with saved-tensor hooks), on a chunk with a full XL
    memory. The CPU has no allocator statistics; on a GPU the run's allocator peak is reported beside it."""
    torch.manual_seed(0)
    model = LanguageModel(cfg).to(device)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.T + 1), generator=torch.Generator().manual_seed(0)).to(
        device
    )
    with torch.no_grad():
        state = model(tokens[:, :-1]).state
    saved = count_saved_bytes(lambda: model(tokens[:, :-1], state).loss(tokens[:, 1:]), model)
    return saved + 4 * ADAMW_FLOATS * count_parameters(model)


def summarize(rows: list[dict], confidence: float = CONFIDENCE) -> list[dict]:
    """Per family: the mean bits per byte with its t-interval; against dense (when it ran) the difference of the
    means with Welch's interval and the verdict, and the ratios of the mean costs."""
    runs = {
        family: [r for r in rows if r["family"] == family]
        for family in dict.fromkeys(r["family"] for r in rows)
    }
    dense = runs.get("dense")
    return [_family_summary(family, chosen, dense, confidence) for family, chosen in runs.items()]


def _family_summary(family: str, runs: list[dict], dense: list[dict] | None, confidence: float) -> dict:
    bpb = [r["val_bits_per_byte"] for r in runs]
    mean = mean_interval(bpb, confidence)
    row = {
        "family": family,
        "preset": runs[0]["preset"],
        "runs": len(runs),
        "bpb_mean": mean.estimate,
        "bpb_low": mean.low,
        "bpb_high": mean.high,
        "bpb_std": statistics.stdev(bpb),
    }
    if dense is not None and family != "dense":
        row |= _against_dense(runs, dense, "val_bits_per_byte", "", confidence)
    elif family == "dense":
        row["verdict"] = "baseline"
    # runs before 2026-11-29 evaluated once, at their end: no best beside the last
    if all("best_val_bits_per_byte" in r for r in runs):
        best = mean_interval([r["best_val_bits_per_byte"] for r in runs], confidence)
        row |= {
            "best_bpb_mean": best.estimate,
            "best_bpb_low": best.low,
            "best_bpb_high": best.high,
            # seeds whose held-out score was best before their last step, and by how much their last was worse:
            # what the run's end lost to memorising
            "past_best": sum(r["best_step"] < r["steps"] for r in runs),
            "past_best_bpb": statistics.fmean(
                r["val_bits_per_byte"] - r["best_val_bits_per_byte"] for r in runs
            ),
        }
        if dense is not None and family != "dense":
            row |= _against_dense(runs, dense, "best_val_bits_per_byte", "_best", confidence)
    row["mfu"] = statistics.fmean(r["mfu"] for r in runs) if all("mfu" in r for r in runs) else None
    for cost in ("train_macs", "train_seconds", "memory_bytes"):
        row[cost] = statistics.fmean(r[cost] for r in runs)
        if dense is not None:
            row[f"{cost}_vs_dense"] = row[cost] / statistics.fmean(r[cost] for r in dense)
    return row


def _against_dense(runs: list[dict], dense: list[dict], key: str, suffix: str, confidence: float) -> dict:
    """The difference of the means of ``key`` to dense's with Welch's interval and its verdict, keyed
    ``vs_dense{suffix}``, ``vs_dense{suffix}_low``..."""
    difference = difference_interval([r[key] for r in runs], [r[key] for r in dense], confidence)
    return {
        f"vs_dense{suffix}": difference.estimate,
        f"vs_dense{suffix}_low": difference.low,
        f"vs_dense{suffix}_high": difference.high,
        f"vs_dense{suffix}_df": difference.df,
        f"verdict{suffix}": difference.verdict(),
    }


def save(folder: Path, label: str, metadata: dict, rows: list[dict], summary: list[dict]) -> Path:
    """LABEL.png/.svg (the figure), LABEL.csv (the runs), LABEL-summary.csv and LABEL.json (all three, written
    last) under ``folder``, LABEL numbered past earlier runs; returns the JSON path."""
    return write_files(new_run_stem(folder, label), metadata, rows, summary)


def write_files(stem: Path, metadata: dict, rows: list[dict], summary: list[dict]) -> Path:
    """A run's files over ``stem``: the figure, the two CSVs and the JSON (written last); returns the JSON path."""
    title = (
        f"{metadata['device']}: {metadata['tokens_per_run']:,} tokens per run, {metadata['seeds']} seeds; "
        f"diamonds: the mean over seeds with its {metadata['confidence']:.0%} t-interval"
    )
    saved = payload(metadata, rows, summary)
    curves = frame(saved["curves"]) if saved["curves"] else None
    save_figure(plots.quality(frame(saved["rows"]), frame(summary), title, curves), stem)
    write_csv(stem.with_suffix(".csv"), saved["rows"])
    write_csv(stem.with_name(f"{stem.name}-summary.csv"), summary)
    return write_atomic(stem.with_suffix(".json"), json.dumps(saved, indent=2, allow_nan=False))


def payload(metadata: dict, rows: list[dict], summary: list[dict]) -> dict:
    """A run's JSON: its metadata, one row per run, the summary, and each run's held-out scores on the way (its
    ``val_curve``) as a long table, one row per evaluation."""
    curves = [
        {
            "family": r["family"],
            "seed": r["seed"],
            "step": step,
            "passes_over_text": step * r["passes_over_text"] / r["steps"],
            "val_bits_per_byte": bpb,
        }
        for r in rows
        for step, bpb in r.get("val_curve", ())
    ]
    runs = [{k: v for k, v in r.items() if k != "val_curve"} for r in rows]
    return {"metadata": metadata, "rows": runs, "summary": summary, "curves": curves}


def register(commands) -> None:
    parser = commands.add_parser(
        "quality", help="quality at equal parameters against compute: held-out bits per byte across seeds"
    )
    parser.add_argument(
        "--quick", action="store_true", help="2 seeds, 100k tokens a run (a few minutes on a CPU)"
    )
    parser.add_argument(
        "--families",
        nargs="+",
        type=registry.as_key,
        choices=FAMILIES,
        action=Distinct,
        help="default: all; differences are to dense",
    )
    parser.add_argument(
        "--presets",
        nargs="+",
        default=[],
        help="presets to train in place of their families' models (e.g. bytes-920k-moh-norm-h4 for MoH); their "
        "families join the run",
    )
    parser.add_argument(
        "--seeds", type=int, help="seeds per family (default 5 on a CPU, 3 on a GPU, 2 with --quick)"
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--tokens", type=int, help="training tokens per run, rounded up to whole steps")
    budget.add_argument("--steps", type=int, help="training steps per run")
    parser.add_argument("--batch", type=int, help="sequences per step (default 16 on a CPU, 64 on a GPU)")
    parser.add_argument("--text", help="a text file instead of the embedded default")
    parser.add_argument("--hf-dataset", help="a Hugging Face dataset saved on disk (save_to_disk)")
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], help="default: cuda when available (the 47M models)"
    )
    parser.add_argument(
        "--threads", type=int, help="intra-op threads (default: 1 on the CPU, PyTorch's on a GPU machine)"
    )
    parser.add_argument(
        "--out", default="results/quality", help="results go to OUT/<device>/ (default: %(default)s)"
    )
    add_kernel_choices(parser)
    add_json(parser)
    parser.set_defaults(run=_run)


def plan_from_args(args, device: str) -> Plan:
    budget = BUDGETS[(device, args.quick)]
    defaults = CPU_MODELS if device == "cpu" else GPU_MODELS
    models = with_presets({f: defaults[f] for f in args.families or FAMILIES}, args.presets)
    batch = budget.batch if args.batch is None else args.batch
    tokens = budget.tokens if args.tokens is None else args.tokens
    for flag, value in (("--batch", batch), ("--tokens", tokens), ("--steps", args.steps)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1; got {value}")
    length = next(iter(models.values()))[1].T  # every model's: the Plan checks it
    steps = args.steps or -(-tokens // (batch * length))  # in integers: a huge --tokens is exact too
    if steps > LARGEST_INT:  # --tokens is not held to 32 bits (a total); the steps it makes are
        raise ValueError(f"--tokens {tokens} makes {steps} steps a run; at most {LARGEST_INT}")
    return Plan(
        models,
        budget.seeds if args.seeds is None else args.seeds,
        steps,
        batch,
        budget.lr,
        budget.clip,
        device,
        args.text,
        args.hf_dataset,
    )


def _run(args) -> None:
    device = device_from_args(args.device)
    out = writable_folder(Path(args.out))
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1; got {args.threads}")
    plan = plan_from_args(args, device)
    threads = cpu_threads(device, args.threads)
    started = time.perf_counter()
    with intra_op_threads(threads):
        rows = run(plan, progress=not args.json)
        used = torch.get_num_threads()
    summary = summarize(rows)
    metadata = (
        environment(device)
        | plan.describe()
        | kernel_metadata(args.expert_matmul, device)
        | {
            "threads": used,
            "wall_seconds": time.perf_counter() - started,
            "confidence": CONFIDENCE,
            "interval": "mean over seeds ± Student t quantile x standard error; the difference to dense with Welch's "
            "interval (Welch–Satterthwaite degrees of freedom); 'matches' when that interval holds 0",
            "train_macs": "3 x the exact forward MAC count of every step (backward counted as twice the forward)",
            "memory": "memory_bytes: weights, gradients, AdamW moments and the activations kept for backward of one "
            "step (saved-tensor hooks); peak_allocated_bytes: the CUDA allocator's peak over the run",
        }
    )
    label = f"{plan.seeds}seeds-{plan.steps}steps" + ("-quick" if args.quick else "")
    path = save(out / slug(metadata["device"]), label, metadata, rows, summary)
    if args.json:
        print(json.dumps(payload(metadata, rows, summary) | {"saved": str(path)}, indent=2))
        return
    passes = rows[0]["passes_over_text"]
    print(
        f"{metadata['device']}, {plan.seeds} seeds x {metadata['tokens_per_run']:,} tokens per run "
        f"({passes:.1f} passes over the training text{_REPEATED if passes > 1 else ''}), "
        f"{metadata['wall_seconds']:.0f} s in all; {describe_kernels(metadata)}"
    )
    print(format_table([_printed(r) for r in summary]))
    print(
        f"bits per byte on held-out text at the end of each run: mean over seeds [{CONFIDENCE:.0%} t-interval]; "
        f"vs dense: difference of means [Welch {CONFIDENCE:.0%} interval], 'matches' when it holds 0; best: each "
        f"run's lowest of its evaluations every {metadata['eval_every']} steps, and how much worse its end was "
        f"(the mean over seeds)\nsaved {path}"
    )


_REPEATED = (
    ": held-out bits per byte then mix memorising with generalising; a larger --text reads less of it again"
)


def _difference(r: dict, suffix: str = "") -> str:
    key = f"vs_dense{suffix}"
    return (
        f"{r[key]:+.3f} [{r[f'{key}_low']:+.3f}, {r[f'{key}_high']:+.3f}] {r[f'verdict{suffix}']}"
        if key in r
        else ""
    )


def _printed(r: dict) -> dict:
    return {
        "family": r["family"],
        "model": r["preset"],
        "seeds": r["runs"],
        "bits/byte": f"{r['bpb_mean']:.3f} [{r['bpb_low']:.3f}, {r['bpb_high']:.3f}]",
        "vs dense": _difference(r) or r.get("verdict", ""),
        "best bits/byte": f"{r['best_bpb_mean']:.3f} (end +{r['past_best_bpb']:.3f})",
        "best vs dense": _difference(r, "_best"),
        "training MACs": f"{r['train_macs']:.3g}",
        "rel. MACs": f"{r['train_macs_vs_dense']:.2f}" if "train_macs_vs_dense" in r else "",
        "seconds": f"{r['train_seconds']:.1f}",
        "rel. time": f"{r['train_seconds_vs_dense']:.2f}" if "train_seconds_vs_dense" in r else "",
        "MFU": f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "",
        "memory": f"{r['memory_bytes'] / 2**20:.1f} MiB",
    }
