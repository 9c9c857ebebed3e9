"""How each number of the report was obtained, in words, from the metadata saved beside it: the clock and threads
of a timing, the steps and mode of a training, the device and the run that made it."""

import shlex
from pathlib import PurePath

# train's flags for what a checkpoint records of its training (TrainConfig's fields), in train's order
TRAIN_FLAGS = (
    ("task", "--task"),
    ("preset", "--preset"),
    ("steps", "--steps"),
    ("batch", "--batch"),
    ("lr", "--lr"),
    ("seed", "--seed"),
    ("eval_every", "--eval-every"),
    ("stop_at", "--stop-at"),
    ("text", "--text"),
    ("hf_dataset", "--hf-dataset"),
)


def timing(metadata: dict, gpu: bool) -> str:
    """What a time was measured with: 'CUDA events', or the CPU clock and the intra-op threads."""
    if gpu:
        return "GPU time (CUDA events)"
    clock = {"thread": "the timing thread's CPU time", "wall": "wall-clock"}.get(metadata.get("clock"))
    threads = metadata.get("threads")
    if clock is None:
        return "clock and threads not recorded"
    return f"{clock}, {threads} intra-op thread{'s' if threads != 1 else ''}" if threads else clock


def job(metadata: dict) -> str:
    """'quick run of switchbench all' and the like, or '' for a command run on its own."""
    if "quick" not in metadata:
        return ""
    return f"{'quick' if metadata['quick'] else 'full'} run of switchbench all"


def training(metadata: dict) -> dict[str, dict]:
    """Per trained model (its run folder's name), the steps it was trained for, their batch, on which device, in
    which mode, from an analysis' metadata.json."""
    out = {}
    for checkpoint in metadata.get("checkpoints", []):
        path = PurePath(checkpoint["path"])  # named as the analysis names it: runs/<name>/checkpoint.pt
        name = path.parent.name if path.name == "checkpoint.pt" else path.stem
        out[name] = {
            "steps": checkpoint.get("step"),
            "batch": checkpoint.get("train", {}).get("batch"),
            "device": checkpoint.get("train", {}).get("device"),
            "quick": metadata.get("quick"),
        }
    return out


def regenerate(metadata: dict, folder: str) -> list[str]:
    """The commands that made the analysis in ``folder`` (as the report was pointed at it), from its metadata.json:
    each checkpoint's training as it recorded it, then the analysis."""
    checkpoints = metadata.get("checkpoints", [])
    if not checkpoints:
        return []
    commands = []
    for checkpoint in checkpoints:
        train = checkpoint.get("train", {})
        argv = ["switchbench", "train"]
        for key, flag in TRAIN_FLAGS:
            if train.get(key) is not None:
                argv += [flag, str(train[key])]
        commands.append(shlex.join([*argv, "--out", str(PurePath(checkpoint["path"]).parent)]))
    argv = ["switchbench", "analyze", *(c["path"] for c in checkpoints)]
    for key, flag in (("input", "--input"), ("example", "--example"), ("sample", "--sample")):
        if metadata.get(key) is not None:
            argv += [flag, str(metadata[key])]
    return [*commands, shlex.join([*argv, "--out", folder])]


def trained(run: dict | None) -> str:
    """'150 training steps, quick run, on cpu' for one model of :func:`training`."""
    if not run or run.get("steps") is None:
        return "training steps not recorded"
    words = [f"{run['steps']:,} training steps"]
    if run.get("quick") is not None:
        words.append("quick run" if run["quick"] else "full run")
    if run.get("device"):
        words.append(f"on {run['device']}")
    return ", ".join(words)


def speed_configuration(metadata: dict) -> tuple:
    """What makes two speed runs different figures rather than a newer and an older one of the same: the groups and
    their members (two ``--presets`` runs are both the group "custom"), the compile mode, the expert-matmul choice,
    the attention kernel and whether steps replay from CUDA graphs (an H200's practitioner's 262M run was hidden
    behind the eager one that followed it). Runs saved before the attention choice existed ran the explicit
    kernel."""
    groups = metadata.get("groups") or {}
    if isinstance(groups, dict):
        groups = tuple((name, tuple(members)) for name, members in groups.items())
    return (
        tuple(groups),
        metadata.get("compile", "eager"),
        metadata.get("expert_matmul", "auto"),
        metadata.get("attention", "explicit"),
        bool(metadata.get("cuda_graphs")),
    )


def speed_setting(metadata: dict) -> str:
    """'attention sdpa, each step replayed from one CUDA graph, torch.compile (inductor)': how a speed run ran its
    steps, beyond precision and batch."""
    words = [f"attention {metadata.get('attention', 'explicit')}"]
    if metadata.get("cuda_graphs"):
        words.append("each step replayed from one CUDA graph")
    if metadata.get("compile", "eager") != "eager":
        words.append(f"torch.compile ({metadata['compile']})")
    return ", ".join(words)
