"""Language-model text as bytes: the embedded default (Shakespeare's The Tempest, public domain), any text file,
or a Hugging Face dataset saved on this machine."""

from importlib.resources import files
from pathlib import Path

import torch

from switchbench.core.schema import first_line

DEFAULT_TEXT = files("switchbench.train") / "data" / "tempest.txt"
VOCAB = 256  # bytes


def load_text(path: str | None = None, hf_dataset: str | None = None, hf_field: str = "text") -> bytes:
    """The bytes of the default corpus, of a file (any encoding: the models read bytes), or of the ``hf_field``
    column of a dataset saved with save_to_disk (as UTF-8)."""
    if hf_dataset and path:
        raise ValueError("--text and --hf-dataset each name the text: give one")
    if hf_dataset:
        return _dataset_text(hf_dataset, hf_field)
    source = Path(path) if path else DEFAULT_TEXT
    if source.exists() and not source.is_file():  # /dev/zero, a pipe: read to the end, it never ends
        raise ValueError(f"text {source} is not a regular file")
    try:
        return source.read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read text {source}: {error.strerror}") from None


def _dataset_text(hf_dataset: str, hf_field: str) -> bytes:
    """The ``hf_field`` column of a dataset saved with save_to_disk, as UTF-8 (its train split where it has one)."""
    try:
        from datasets import load_from_disk
    except ImportError:
        raise ValueError("--hf-dataset needs the `datasets` package (pip install datasets)") from None
    try:
        data = load_from_disk(hf_dataset)
        data = data["train"] if hasattr(data, "keys") and "train" in data else data
        return "\n".join(data[hf_field]).encode("utf-8")
    except (OSError, ValueError, KeyError, TypeError) as error:  # no dataset there, or no such text column
        raise ValueError(
            f"--hf-dataset {hf_dataset}: not a dataset with a {hf_field!r} column ({first_line(error)})"
        ) from None


def encode(text: str | bytes) -> torch.Tensor:
    """Byte values as token ids; text is encoded as UTF-8."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return torch.tensor(list(data), dtype=torch.long)


def count_bytes(n: int) -> str:
    return f"{n:,} byte" + ("" if n == 1 else "s")


def decode_token(token: int) -> str:
    """One byte as a readable label: ASCII as its character, every other byte as ``\\xNN``. A byte above 0x7f is
    part of a UTF-8 sequence, not a character of its own: 'é' is the two tokens \\xc3 \\xa9, which Latin-1 would
    label 'Ã' and '©', letters the text never held."""
    char = chr(token) if token < 0x80 else "\x00"  # \x00: not printable, so written \xNN
    return {"\n": "\\n", " ": "␣", "\t": "\\t"}.get(char, char if char.isprintable() else f"\\x{token:02x}")


def streams(data: torch.Tensor, batch: int) -> torch.Tensor:
    """The corpus cut into ``batch`` contiguous streams [batch, L], read chunk by chunk to carry XL memory."""
    length = data.numel() // batch
    if length < 2:
        raise ValueError(f"the text has {count_bytes(data.numel())}: too short for {batch} streams")
    return data[: batch * length].view(batch, length)
