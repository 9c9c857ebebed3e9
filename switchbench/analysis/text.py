"""Language-model text as bytes: the embedded default (Shakespeare's The Tempest, public domain), any text file,
or a Hugging Face dataset saved on this machine."""

from importlib.resources import files
from pathlib import Path

import torch

DEFAULT_TEXT = files("switchbench.analysis") / "data" / "tempest.txt"
VOCAB = 256  # bytes


def load_text(path: str | None = None, hf_dataset: str | None = None, hf_field: str = "text") -> str:
    """The default corpus, a text file, or the ``hf_field`` column of a dataset saved with save_to_disk."""
    if hf_dataset:
        try:
            from datasets import load_from_disk
        except ImportError:
            raise ValueError("--hf-dataset needs the `datasets` package (pip install datasets)") from None
        data = load_from_disk(hf_dataset)
        data = data["train"] if hasattr(data, "keys") and "train" in data else data
        return "\n".join(data[hf_field])
    source = Path(path) if path else DEFAULT_TEXT
    try:
        return source.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        raise ValueError(f"cannot read text {source}: {error.strerror}") from None


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode_token(token: int) -> str:
    """One byte as a readable label."""
    char = bytes([token]).decode("latin-1")
    return {"\n": "\\n", " ": "␣", "\t": "\\t"}.get(char, char if char.isprintable() else f"\\x{token:02x}")


def streams(data: torch.Tensor, batch: int) -> torch.Tensor:
    """The corpus cut into ``batch`` contiguous streams [batch, L], read chunk by chunk to carry XL memory."""
    length = data.numel() // batch
    if length < 2:
        raise ValueError(f"the text has {data.numel()} bytes: too short for {batch} streams")
    return data[: batch * length].view(batch, length)
