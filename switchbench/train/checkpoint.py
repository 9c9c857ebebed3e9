"""Checkpoints: model weights, configuration and training state in one file, written atomically and read with
``weights_only=True``; a wrong, truncated or mismatched file is a one-line ValueError."""

import warnings
from pathlib import Path

import torch

from switchbench.core.results import replace_atomically
from switchbench.core.schema import check_checkpoint
from switchbench.models.config import ModelConfig
from switchbench.models.lm import LanguageModel, SequenceClassifier

FORMAT = "switchbench-checkpoint-1"


def build_model(task: str, cfg: ModelConfig, n_classes: int | None = None) -> torch.nn.Module:
    if task == "listops":
        return SequenceClassifier(cfg, n_classes)
    return LanguageModel(cfg)


def save(
    path: Path,
    *,
    task: str,
    cfg: ModelConfig,
    model,
    optimizer,
    step: int,
    train: dict,
    n_classes=None,
    memory: dict | None = None,
    rng=None,
):
    """Write to a temporary file beside ``path``, then rename: an interrupted save leaves the old file."""
    payload = {
        "format": FORMAT,
        "task": task,
        "config": cfg.to_dict(),
        "n_classes": n_classes,
        "step": step,
        "train": train,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "memory": memory,  # LM: the XL memory the next step attends to (ListOps: None)
        "rng": rng,  # dropout's generators
    }
    return replace_atomically(Path(path), lambda tmp: torch.save(payload, tmp))


def _check_fits(task: str, cfg: ModelConfig, n_classes: int | None, weights: dict) -> None:
    """The weights fit the configuration, found before the model is built for real: one edited to 200,000 layers
    built for minutes, and one a thousand times wider would have allocated its weights, before they were found
    not to fit. The layers are counted first (even the meta device builds each module), then the model is built
    there and loaded, which raises load_state_dict's RuntimeError for weights that do not fit."""
    saved = {key.split(".")[2] for key in weights if isinstance(key, str) and key.startswith("stack.blocks.")}
    if len(saved) != cfg.n_layers:
        raise RuntimeError(f"the configuration has {cfg.n_layers} layers, the weights {len(saved)}")
    with torch.device("meta"), warnings.catch_warnings():
        # torch warns that copying into a meta weight does nothing: here only the shapes are asked
        warnings.filterwarnings("ignore", ".*copying from a non-meta parameter", UserWarning)
        build_model(task, cfg, n_classes).load_state_dict(weights)


def load(path: Path) -> dict:
    """The checkpoint's payload, its model rebuilt and loaded as ``payload['module']``."""
    path = Path(path)
    try:
        with warnings.catch_warnings():
            # torch warns of a pickle protocol other than its own (2) above the error below: the file is not ours
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such checkpoint") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: a folder, not a checkpoint file") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot be read ({error.strerror or type(error).__name__})") from None
    except Exception as error:  # the unpickler of a damaged file can raise almost anything
        reason = str(error).split(".")[0][:80]
        if not any(c.isalpha() for c in reason):  # "174812789": a load key the unpickler met, not a reason
            reason = type(error).__name__
        raise ValueError(
            f"{path}: not a readable checkpoint (cut short, or another format: {reason})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path}: not a switchbench checkpoint")
    check_checkpoint(path, payload)
    try:
        # configurations saved before the field existed were built without the XL biases and learned scale
        cfg = ModelConfig.from_dict({"xl_bias_and_scale": False} | payload["config"])
        _check_fits(payload["task"], cfg, payload.get("n_classes"), payload["model"])
        module = build_model(payload["task"], cfg, payload.get("n_classes"))
        module.load_state_dict(payload["model"])
    except (KeyError, TypeError) as error:
        raise ValueError(f"{path}: incomplete checkpoint ({error})") from None
    except ValueError as error:
        raise ValueError(f"{path}: bad configuration: {error}") from None
    except RuntimeError as error:
        raise ValueError(
            f"{path}: weights do not match the configuration: "
            + " ".join(line.strip() for line in str(error).splitlines()[:2])[:300]
        ) from None
    # training never saves such weights (a run stops at the first non-finite one): statistics of a damaged or
    # foreign file would be NaN, and a resumed run would train nothing
    bad = next(
        (k for k, t in module.state_dict().items() if t.is_floating_point() and not t.isfinite().all()), None
    )
    if bad is not None:
        raise ValueError(f"{path}: the weight {bad!r} is not finite (NaN or inf)")
    return payload | {"cfg": cfg, "module": module.eval()}
