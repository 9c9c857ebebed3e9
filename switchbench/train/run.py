"""Training of small models for the routing analysis: ListOps classification or byte-level language modelling.

Seeded, resumable (a batch depends only on the seed and the step), logged to CSV, checkpointed atomically.
"""

import functools
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm import tqdm

from switchbench.bench.command import (
    add_json,
    add_kernel_choices,
    describe_kernels,
    device_from_args,
    emit,
    kernel_metadata,
)
from switchbench.bench.cost.accounting import model_macs
from switchbench.bench.timing.benches import too_large
from switchbench.bench.timing.timer import matmul_peak_tflops
from switchbench.core import distributed, optim
from switchbench.core.results import writable_folder, write_csv
from switchbench.core.schema import first_line, read_table
from switchbench.models import family as registry
from switchbench.models.config import ModelConfig
from switchbench.models.lm import State
from switchbench.models.presets import OVERRIDES, from_name
from switchbench.ops.expert_matmul import choice as expert_matmul_choice
from switchbench.train import checkpoint, listops, text


def default_preset(task: str, model: str) -> str:
    """The preset `train --model MODEL` uses: the family's ListOps classifier, or its tiny byte-level LM."""
    family = registry.by_key(model)
    role = "listops" if task == "listops" else "tiny"
    if role not in family.roles:
        raise ValueError(f"model {model} declares no {role} preset; name one with --preset")
    return family.roles[role]


def run_name(task: str, preset: str, seed: int = 0) -> str:
    """The run folder's name: the preset, prefixed with the task unless the preset's name already starts with it
    (``listops-switchhead-h2``, ``lm-tiny-switchhead``), and the seed when it is not the default."""
    name = preset if preset.startswith(f"{task}-") else f"{task}-{preset}"
    name = name.replace(OVERRIDES, "-").replace(",", "-")  # NAME:n_layers=3,T=64 -> NAME-n_layers=3-T=64
    return name if seed == 0 else f"{name}-seed{seed}"


# What a resumed run must share with the run it continues (its steps, evaluations and device may change)
SAME_ON_RESUME = ("batch", "lr", "warmup", "clip", "seed", "val_size", "text", "hf_dataset")


@dataclass(frozen=True)
class TrainConfig:
    task: str  # listops | lm
    preset: str
    steps: int = 1500
    batch: int = 32
    lr: float = 1e-3
    warmup: int = 100
    clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    val_size: int = 1000  # ListOps validation examples
    device: str = "cpu"
    text: str | None = None  # lm: a text file instead of the embedded default
    hf_dataset: str | None = None  # lm: a Hugging Face dataset saved on disk
    # a configuration that is no preset, named by ``preset``; else the preset, or NAME:field=value,... of one
    model: ModelConfig | None = None
    stop_at: float | None = None  # ListOps: stop once STOP_AFTER evaluations in a row reach this accuracy

    def __post_init__(self):
        if self.task not in ("listops", "lm"):
            raise ValueError(f"task must be one of listops, lm; got {self.task!r}")
        # model_config reads the preset: a ValueError names the closest presets, or what is wrong with a change
        if self.model_config.causal != (self.task == "lm"):
            raise ValueError(f"preset {self.preset} is for {'lm' if self.model_config.causal else 'listops'}")
        tokens = len(listops.VOCAB) if self.task == "listops" else text.VOCAB
        if self.model_config.vocab < tokens:  # else the first step's embedding lookup fails, past its table
            raise ValueError(
                f"{self.preset}: vocab {self.model_config.vocab} is below the {tokens} tokens of the {self.task} data"
            )
        for name in ("steps", "batch", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in (
            "lr",
            "clip",
        ):  # float32's largest: the optimizer's step and the clip are float32 products
            if not 0 < getattr(self, name) <= torch.finfo(torch.float32).max:
                raise ValueError(f"{name} must be a finite number > 0 (float32's); got {getattr(self, name)}")
        if self.stop_at is not None and self.task != "listops":
            raise ValueError(f"stop_at is a ListOps validation accuracy: the {self.task} task has none")
        if self.stop_at is not None and not 0 <= self.stop_at <= 1:
            raise ValueError(f"stop_at is a ListOps validation accuracy in [0, 1]; got {self.stop_at}")
        if not 0 <= self.seed < 2**64:  # torch.manual_seed takes a 64-bit unsigned seed
            raise ValueError(f"seed must be in [0, 2**64); got {self.seed}")
        if self.task == "listops" and (self.text or self.hf_dataset):
            raise ValueError("--text and --hf-dataset are for --task lm; ListOps generates its own data")

    @property
    def model_config(self) -> ModelConfig:
        return self.model or from_name(self.preset)


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class ListOpsTask:
    """Batches of one length each, no padding; validation on a fixed draw, each length run unpadded, its accuracy
    also per outer operator and per nesting depth (which part of the task a model has not learnt)."""

    def __init__(self, cfg: TrainConfig, model_cfg, rows: slice = slice(None)):
        self.cfg, self.model_cfg, self.rows = cfg, model_cfg, rows  # rows: this process's share of a batch
        self.data_cfg = listops.ListOpsConfig(max_length=model_cfg.T)
        self.val = listops.generate(cfg.val_size, seed=10**6 + cfg.seed, cfg=self.data_cfg)
        self.held_out = frozenset(tuple(tokens) for tokens, _ in self.val)  # never trained on
        self.val_answers = torch.tensor([answer for _, answer in self.val], device=cfg.device)
        self.val_lengths = listops.by_length(self.val)
        # the validation examples of each outer operator and each nesting depth, the columns' order
        self.val_groups: dict[str, list[int]] = {}
        for name, key in (("op", listops.operator), ("depth", listops.depth)):
            keys = [key(tokens) for tokens, _ in self.val]
            for value in sorted(set(keys)):
                self.val_groups[f"{name}_{value}"] = [i for i, k in enumerate(keys) if k == value]

    def examples(self, step: int) -> list:
        """This process's share of the ``step``-th training batch, no validation expression among them."""
        return listops.length_batch(self.cfg.batch, step, self.cfg.seed, self.data_cfg, self.held_out)[
            self.rows
        ]

    def loss(self, model, step: int, state=None):
        examples = self.examples(step)
        tokens, answers = (t.to(self.cfg.device) for t in listops.encode(examples, len(examples[0][0])))
        logits, aux = model(tokens)
        return (
            F.cross_entropy(logits, answers) + aux,
            (logits.argmax(-1) == answers).float().mean().item(),
            None,
        )

    def step_flops(self, step: int) -> float:
        """Model FLOPs of this process's training step: its sequences, at the step's length."""
        examples = self.examples(step)
        return 6 * classifier_macs(self.model_cfg, len(examples[0][0]), len(examples))

    @torch.no_grad()
    def evaluate(self, model) -> dict:
        predicted = torch.empty_like(self.val_answers)
        for length, indices in self.val_lengths.items():
            for i in range(0, len(indices), 250):
                chunk = indices[i : i + 250]
                tokens, _ = listops.encode([self.val[j] for j in chunk], length)
                predicted[chunk] = model(tokens.to(self.cfg.device))[0].argmax(-1)
        right = (predicted == self.val_answers).tolist()
        answers = self.val_answers
        out = {
            "val_accuracy": sum(right) / len(right),
            "majority_class": answers.bincount(minlength=listops.N_CLASSES).max().item() / len(answers),
        }
        return out | {
            f"val_accuracy_{group}": sum(right[i] for i in members) / len(members)
            for group, members in self.val_groups.items()
        }


VAL_STREAMS = 4  # the held-out tenth of a text, read as this many streams


class LMTask:
    def __init__(self, cfg: TrainConfig, model_cfg, rows: slice = slice(None)):
        data = text.encode(text.load_text(cfg.text, cfg.hf_dataset))
        split = int(0.9 * data.numel())
        # 90% for training, a chunk of T + 1 bytes per stream at least; the rest is 4 validation streams, each of a
        # chunk at least (shorter, evaluate scored no chunk and reported 0 bits per byte: a perfect score)
        chunk = model_cfg.T + 1
        if split < cfg.batch * chunk or data.numel() - split < VAL_STREAMS * chunk:
            needed = max(math.ceil(cfg.batch * chunk / 0.9) + 1, 10 * VAL_STREAMS * chunk + 10)
            raise ValueError(
                f"the text has {text.count_bytes(data.numel())}: too short for batch {cfg.batch} and "
                f"chunks of {model_cfg.T} bytes (needs {needed:,})"
            )
        # every process cuts the same streams and trains on its share of them
        self.T, self.train = model_cfg.T, text.streams(data[:split], cfg.batch)[rows].to(cfg.device)
        streams = len(self.train)
        self.flops = {  # model FLOPs of a step after XL memory, and of one that starts the streams again
            True: 6 * model_macs(model_cfg, streams),
            False: 6 * model_macs(model_cfg.replace(context_blocks=0), streams),
        }
        self.val = text.streams(data[split:], VAL_STREAMS).to(cfg.device)
        self.chunks = (self.train.shape[1] - 1) // self.T

    def continues(self, step: int) -> bool:
        """Whether the chunk of ``step`` follows the previous step's, so that the XL memory carries over; back at
        the start of the streams it does not (the memory would be of their end)."""
        return step % self.chunks != 0

    def step_flops(self, step: int) -> float:
        """Model FLOPs of this process's training step: a chunk of T tokens per stream, after its XL memory unless
        it starts the streams again."""
        return self.flops[self.continues(step)]

    def loss(self, model, step: int, state=None):
        i = step % self.chunks
        if not self.continues(step):
            state = None
        chunk = self.train[:, i * self.T : (i + 1) * self.T + 1]
        out = model(chunk[:, :-1], state)
        return out.loss(chunk[:, 1:]), None, out.state

    @torch.no_grad()
    def evaluate(self, model) -> dict:
        state, total, count = None, 0.0, 0
        for i in range(min(20, (self.val.shape[1] - 1) // self.T)):
            chunk = self.val[:, i * self.T : (i + 1) * self.T + 1]
            out = model(chunk[:, :-1], state)
            state = out.state
            total += F.cross_entropy(out.logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
            count += chunk[:, 1:].numel()
        return {"val_bits_per_byte": total / count / math.log(2)}  # count > 0: __init__ checks the length


@functools.cache  # each training step asks for its length's count: one config per length, not one per step
def classifier_macs(cfg: ModelConfig, length: int, batch: int = 1) -> int:
    """Forward MACs of the sequence classifier on ``batch`` sequences of ``length`` tokens: the stack as the
    language model's, its head on the pooled state instead of the vocabulary on every token."""
    at_length = cfg.replace(T=length)
    head = length * cfg.d_model * cfg.vocab - cfg.d_model * listops.N_CLASSES
    return model_macs(at_length, batch) - batch * head


def train(
    cfg: TrainConfig,
    out: Path,
    resume: bool = False,
    progress: bool = True,
    world: distributed.World = distributed.ONE,
) -> dict:
    """Train to ``cfg.steps``, or until ``cfg.stop_at`` is met; ``out`` receives checkpoint.pt and log.csv.
    Returns the last log row: the step, the training loss, the evaluation and ``train_seconds``, the wall-clock of
    the training steps so far (evaluations and checkpoints left out).

    A non-finite loss stops the run with a ValueError; the last checkpoint, of finite weights, is kept."""
    if cfg.stop_at is not None and world.distributed:
        raise ValueError(
            "--stop-at trains on one process: only the first evaluates, so the others would not stop"
        )
    out = Path(out)
    model_cfg = cfg.model_config
    n_classes = listops.N_CLASSES if cfg.task == "listops" else None
    rows = distributed.share(cfg.batch, world)
    # before the model and the data are made (10 million ListOps examples took minutes of Python, then the OOM
    # killer's turn; a model of 8 GiB of weights failed to allocate with a traceback)
    too_big = too_large(model_cfg, len(range(cfg.batch)[rows]), "model", cfg.device, torch.float32)
    if too_big:
        raise ValueError(f"batch {cfg.batch}: a training step of {cfg.preset} {too_big}")
    # before the seed: the yardstick's random matrices, as many as its sizes tried (the machine's load), would
    # shift every dropout draw
    peak = matmul_peak_tflops(cfg.device, torch.float32) * 1e12
    torch.manual_seed(cfg.seed)  # after the check, which may build and run a model of its own
    model = checkpoint.build_model(cfg.task, model_cfg, n_classes).to(cfg.device)
    optimizer = optim.adamw(model.parameters(), cfg.lr, cfg.device)
    task = (ListOpsTask if cfg.task == "listops" else LMTask)(cfg, model_cfg, rows)
    start, log_rows, state = 0, [], None
    if resume and (out / "checkpoint.pt").exists():
        saved = checkpoint.load(out / "checkpoint.pt")
        if saved["config"] != model_cfg.to_dict() or saved["task"] != cfg.task:
            raise ValueError(f"{out / 'checkpoint.pt'} holds another model or task; use another --out")
        # a setting the checkpoint does not record (older code) ran at its default: an empty record had passed
        # every comparison, so that one log told two trainings as one
        defaults = {f.name: f.default for f in fields(TrainConfig)}
        ran = {key: saved["train"].get(key, defaults[key]) for key in SAME_ON_RESUME}
        changed = [
            f"{key} {ran[key]}{'' if key in saved['train'] else ' (its default, unrecorded)'} "
            f"(not {getattr(cfg, key)})"
            for key in SAME_ON_RESUME
            if ran[key] != getattr(cfg, key)
        ]
        if changed:  # one log would tell two trainings as one
            raise ValueError(
                f"{out / 'checkpoint.pt'} was trained with {', '.join(changed)}: resume with its settings, or "
                "--force to start again"
            )
        model.load_state_dict(saved["model"])
        try:
            optimizer.load_state_dict(saved["optimizer"])
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{out / 'checkpoint.pt'}: the optimizer state does not fit ({error})") from None
        _check_moments(optimizer, out / "checkpoint.pt")
        start = saved["step"]
        if start < 0:
            raise ValueError(f"{out / 'checkpoint.pt'}: step {start} is negative")
        try:
            state = _restored_memory(saved.get("memory"), rows, cfg.device, model_cfg)
            # dropout's draws continue where they were (nothing below draws before the first step)
            if saved.get("rng") is not None:  # older checkpoints have none
                _set_rng_state(saved["rng"], cfg.device)
        except (KeyError, TypeError, IndexError, AttributeError, RuntimeError, ValueError) as error:
            raise ValueError(
                f"{out / 'checkpoint.pt'}: its XL memory or generator state is malformed "
                f"({type(error).__name__}: {first_line(error)})"
            ) from None
        if start > cfg.steps:  # else it would report the checkpoint's figures as this run's, training nothing
            raise ValueError(
                f"{out / 'checkpoint.pt'} is at step {start}, past --steps {cfg.steps}: ask for more steps to "
                "continue it, or --force to start again"
            )
        # The log is written before the checkpoint: rows past the checkpoint's step are redone.
        log_rows = [r for r in read_log(out / "log.csv") if r["step"] <= start]
    if _reached(log_rows, cfg.stop_at):
        return log_rows[-1]  # a resumed run that had met its target
    kept = start
    seconds = log_rows[-1].get("train_seconds", 0.0) if log_rows else 0.0
    # MFU of each logged interval: this process's model FLOPs over its time, at this device's measured peak
    flops, since = 0.0, seconds
    trained = distributed.wrap(model, world)
    model.train()
    # disable=None: tqdm stays quiet when stderr is no terminal (a log file, a pipe, a CI job)
    bar = dict(
        desc=f"{cfg.task} {cfg.preset}", disable=None if progress else True, initial=start, total=cfg.steps
    )
    for step in tqdm(range(start, cfg.steps), **bar):
        started = time.perf_counter()
        lr = learning_rate(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, accuracy, state = task.loss(trained, step, state)
        if not torch.isfinite(loss):
            raise ValueError(_diverged(step + 1, f"the loss is {loss.item()}", out, kept))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        optimizer.step()
        row = {
            "step": step + 1,
            # the whole batch's, not this rank's share
            "loss": distributed.mean(loss.detach(), world).item(),
            "train_accuracy": None
            if accuracy is None
            else distributed.mean(torch.tensor(accuracy, device=loss.device), world).item(),
            "lr": lr,  # the schedule as run, a resumed run's warm restarts included
        }  # item() waits for the step (GPU)
        seconds += time.perf_counter() - started
        flops += task.step_flops(step)
        row["train_seconds"] = seconds
        evaluating = (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps
        memory = _saved_memory(state, world) if evaluating else None  # every rank takes part in the gather
        if evaluating and world.main:
            row["mfu"] = flops / max(seconds - since, 1e-9) / peak
            row["matmul_peak_tflops"] = peak / 1e12  # the yardstick, so the MFU can be checked from the log
            flops, since = 0.0, seconds
            model.eval()
            row |= task.evaluate(model)
            model.train()
            if not all(p.isfinite().all() for p in model.parameters()):
                raise ValueError(_diverged(step + 1, "the weights are not finite", out, kept))
            log_rows.append(row)
            # The log first: a run stopped between the two writes has the row on resume, which drops rows past
            # the checkpoint's step and redoes them, so every step is logged once.
            write_csv(out / "log.csv", log_rows)
            checkpoint.save(
                out / "checkpoint.pt",
                task=cfg.task,
                cfg=model_cfg,
                model=model,
                optimizer=optimizer,
                step=step + 1,
                train=asdict(cfg) | _expert_matmul(cfg),
                n_classes=n_classes,
                memory=memory,
                rng=_rng_state(cfg.device),
            )
            kept = step + 1
            if _reached(log_rows, cfg.stop_at):
                break
    return log_rows[-1] if log_rows else {}


def _check_moments(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Each weight's saved moments of its shape: load_state_dict takes any, and the first step failed (exit 3)."""
    for group in optimizer.param_groups:
        for weight in group["params"]:
            for name, value in optimizer.state.get(weight, {}).items():
                if not torch.is_tensor(value):  # AdamW keeps tensors alone: its step too
                    raise ValueError(f"{path}: the optimizer state's {name} is no tensor")
                if value.dim() and value.shape != weight.shape:
                    raise ValueError(
                        f"{path}: the optimizer state does not fit ({name} of shape {tuple(value.shape)} for a "
                        f"weight of shape {tuple(weight.shape)})"
                    )


def _saved_memory(state, world) -> dict | None:
    """The XL memory the next step attends to, every rank's rows gathered into the whole batch's (on the CPU)."""
    if state is None:
        return None
    mems = [distributed.gathered(None if m is None else m.detach().cpu(), world) for m in state.mems]
    return {"offset": state.offset, "mems": [None if m[0] is None else torch.cat(m) for m in mems]}


def _rng_state(device: str) -> dict:
    """The generators dropout draws from: the CPU's, and the GPU's where the model runs there. Every rank draws
    alike (one seed, equal shares), so rank 0's state is every rank's."""
    return {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()} if device == "cuda" else {})


def _set_rng_state(saved: dict, device: str) -> None:
    torch.set_rng_state(saved["cpu"])
    if device == "cuda" and "cuda" in saved:
        torch.cuda.set_rng_state(saved["cuda"])


def _restored_memory(memory: dict | None, rows: slice, device: str, cfg: ModelConfig):
    """The XL memory a checkpoint saved, this process's rows of it: a layer's cached inputs [B, M, d_model] each."""
    if memory is None:
        return None
    mems = tuple(None if m is None else m[rows].to(device) for m in memory["mems"])
    if len(mems) != cfg.n_layers or any(
        m is not None and (m.dim() != 3 or m.shape[2] != cfg.d_model) for m in mems
    ):
        raise ValueError(f"not {cfg.n_layers} layers' inputs of {cfg.d_model} channels")
    return State(mems, int(memory["offset"]))


# One evaluation is of 1,000 examples (a standard error of about 1.1 points at 85%): a target counts as met when
# it holds three times in a row, not at the first lucky draw.
STOP_AFTER = 3


def _reached(rows: list[dict], target: float | None) -> bool:
    """Whether the last STOP_AFTER evaluations in the log all reached the target validation accuracy."""
    accuracies = [row["val_accuracy"] for row in rows if "val_accuracy" in row][-STOP_AFTER:]
    return target is not None and len(accuracies) == STOP_AFTER and min(accuracies) >= target


def _expert_matmul(cfg: TrainConfig) -> dict:
    """What the run's expert matmuls ran on so far (the choice in force, and per shape what it resolved to)."""
    return kernel_metadata(expert_matmul_choice.choice(), cfg.device)


def _diverged(step: int, what: str, out: Path, saved: int) -> str:
    kept = f"{out / 'checkpoint.pt'} (step {saved}) is kept" if saved else "no checkpoint was written"
    return f"step {step}: {what}; stopped training: {kept}; a lower --lr may help"


def read_log(path: Path) -> list[dict]:
    """The rows of a run's log, missing cells left out."""
    if not path.exists():
        return []
    return [
        {k: v for k, v in row.items() if pd.notna(v)} for row in read_table(path, "log").to_dict("records")
    ]


def register(commands) -> None:
    parser = commands.add_parser(
        "train", help="train a small model for the routing analysis (a GPU when there is one)"
    )
    parser.add_argument(
        "--task",
        choices=["listops", "lm"],
        default="listops",
        help="ListOps or a byte-level LM (default: listops)",
    )
    parser.add_argument(
        "--model",
        type=registry.as_key,
        choices=registry.keys(),
        help="default: the preset's, else switchhead",
    )
    parser.add_argument(
        "--preset",
        help="a preset, or NAME:field=value,... (default: listops-<model>-h<H> for ListOps, tiny-<model> for LM)",
    )
    parser.add_argument("--steps", type=int, default=1000, help="training steps (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=32, help="sequences a step (default: %(default)s)")
    parser.add_argument(
        "--lr",
        type=float,
        default=1e-3,
        help="AdamW's peak learning rate, after warm-up (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the initial weights, and for ListOps the data and its validation draw (a language model reads the "
        "same batches whatever the seed; default: %(default)s)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=100,
        help="steps between evaluations and checkpoints (default: %(default)s)",
    )
    parser.add_argument(
        "--stop-at",
        type=float,
        metavar="ACCURACY",
        help=f"ListOps: stop once {STOP_AFTER} evaluations in a row reach this validation accuracy (e.g. 0.85)",
    )
    parser.add_argument("--text", help="LM: a text file instead of the embedded default")
    parser.add_argument("--hf-dataset", help="LM: a Hugging Face dataset saved on disk (save_to_disk)")
    parser.add_argument(
        "--out", help="run folder (default: runs/<run name>, e.g. runs/listops-switchhead-h2)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the run folder's checkpoint; where there is none, start the run",
    )
    parser.add_argument("--force", action="store_true", help="start afresh over an earlier run in the folder")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    add_kernel_choices(parser)
    add_json(parser)
    parser.set_defaults(run=_run)


def _run(args) -> None:
    if args.resume and args.force:
        raise ValueError("--resume continues the folder's run and --force replaces it: give one")
    preset = args.preset or default_preset(args.task, args.model or "switchhead")
    family = registry.get(from_name(preset).model).key
    if args.model and args.model != family:
        raise ValueError(f"--model {args.model} contradicts --preset {preset}, a {family} model: give one")
    cfg = TrainConfig(
        args.task,
        preset,
        args.steps,
        args.batch,
        args.lr,
        seed=args.seed,
        eval_every=args.eval_every,
        stop_at=args.stop_at,
        text=args.text,
        hf_dataset=args.hf_dataset,
        device=device_from_args(args.device),
    )
    out = writable_folder(Path(args.out or Path("runs") / run_name(args.task, preset, args.seed)))
    earlier = [out / name for name in ("checkpoint.pt", "log.csv") if (out / name).exists()]
    if earlier and not (args.resume or args.force):
        raise ValueError(f"{out} holds an earlier run; --resume to continue it or --force to replace it")
    if args.resume and earlier and not (out / "checkpoint.pt").exists():  # resuming would start over its log
        raise ValueError(f"{out} holds a log but no checkpoint.pt to resume from; --force to replace the run")
    with distributed.process_group(cfg.device) as world:
        result = train(cfg, out, resume=args.resume, progress=not args.json and world.main, world=world)
    if not world.main:
        return
    experts = kernel_metadata(args.expert_matmul, cfg.device)
    if args.json:
        emit({"run": str(out), "preset": preset, **result, **experts}, True)
        return
    summary = ", ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, float))
    print(
        f"{preset}: {summary}; {describe_kernels(experts)}\n"
        f"checkpoint {out / 'checkpoint.pt'}, log {out / 'log.csv'}"
    )
