"""The routing explorer: one self-contained HTML page over a few analysed sequences.

A reader picks a sequence, a model, a layer and a head (or the maximum over heads), then hovers, clicks or walks
with the arrow keys to a destination token: its attention row shades the source tokens, a side panel lists the
experts its head picked on the destination side with their gates (for MoA the heads it chose and their weights),
and under every source token stand the experts picked on the source side. Compare mode sets a second model's
maximum-over-heads row for the same token beside it.

The page requests nothing: data, script and style are inline. Its content-security policy allows no source at all
but its own script, named by hash, and inline style (the report's policy forbids scripts, so the explorer is a page
beside it). Attention weights are kept in 8-bit steps of 1/255 and gates in thousandths: what a reader can tell
apart by eye, at a fifth of the size of 3-decimal text.
"""

import base64
import hashlib
import json
from importlib.resources import files
from pathlib import Path

import jinja2
import torch

from switchbench.core.results import write_atomic
from switchbench.models import family as registry
from switchbench.models.config import ModelConfig

SEQUENCES = 12  # the plotted sequence and the longest others of the sample: about 2 MiB for the default trio
POSITIONS = 128  # tokens per sequence at most, as the figures show (the size grows as its square)
LEVELS = 255  # an attention weight w is kept as round(w * LEVELS), one byte
GATE_SCALE = 1000  # a gate g is kept as round(g * GATE_SCALE)
TEMPLATES = files("switchbench.analysis") / "templates"


def layers(records: list[dict]) -> list[dict]:
    """What the page needs of each attention layer's observation of one sequence (batch of one)."""
    return [_layer(record) for record in records]


def _layer(record: dict) -> dict:
    maps = record["maps"][0]  # [H, t, S]
    t = maps.shape[1]
    entry = {"attention": _quantised(maps[..., -t:])}  # the current tokens: analyze runs without memory
    for side in ("src", "dst"):
        if f"{side}_experts" in record:  # SwitchHead: [1, S or t, H, K]
            entry[side] = _choices(record[f"{side}_experts"][0, -t:], record[f"{side}_gates"][0, -t:])
    if "head_weights" in record:  # every head's weight per token, [1, t, H] (MoH): head h "chooses" itself
        weights = record["head_weights"][0]
        heads = torch.arange(weights.shape[-1]).expand_as(weights)
        entry["dst"] = _choices(heads[..., None], weights[..., None])
    elif "experts" in record:  # each head slot filled by an expert chosen per token, [1, t, H] (MoA)
        entry["dst"] = _choices(record["experts"][0, :, :, None], record["gates"][0, :, :, None])
    return entry


def _quantised(maps: torch.Tensor) -> str:
    """[H, t, t] weights as bytes round(w * LEVELS), row-major, in base64."""
    levels = (maps.float().clamp(0, 1) * LEVELS).round().to(torch.uint8)
    return base64.b64encode(levels.contiguous().numpy().tobytes()).decode("ascii")


def _choices(experts: torch.Tensor, gates: torch.Tensor) -> dict:
    """[t, H, K] experts and gates, flattened row-major; K says how to read them."""
    return {
        "k": experts.shape[-1],
        "experts": experts.reshape(-1).tolist(),
        "gates": (gates.float() * GATE_SCALE).round().int().reshape(-1).tolist(),
    }


def sides(cfg: ModelConfig) -> dict[str, str]:
    """What each routed side of the model's attention is called on the page."""
    family = cfg.family
    if family.routing == "heads":
        return {"dst": f"heads chosen ({family.label} experts) and their weights"}
    if family.routing != "experts":
        return {}
    names = {
        side: "/".join(p.upper() for p in cfg.experts if p in projections)
        for side, projections in (("src", "kv"), ("dst", "qo"))
    }
    return {side: f"{name} experts" for side, name in names.items() if name}


def model(name: str, cfg: ModelConfig, trained: str, sequences: list[list[dict]]) -> dict:
    """One model's entry: ``sequences[s][layer]`` as made by :func:`layers`."""
    return {
        "name": name,
        "attention": cfg.attention,
        "routing": cfg.family.routing,
        "slots": cfg.family.head_slots,
        "baseline": cfg.family is registry.families()[0],
        "heads": cfg.n_heads,
        "trained": trained,
        "sides": sides(cfg),
        "sequences": sequences,
    }


def render(title: str, sequences: list[dict], models: list[dict]) -> str:
    """The page; ``sequences`` are {"name", "tokens", "line_ends"} (positions after which a text line ends)."""
    script, style = (TEMPLATES / "explorer.js").read_text(), (TEMPLATES / "explorer.css").read_text()
    if "</script" in script.lower():
        raise ValueError("the explorer's script would end its own element")
    data = {
        "title": title,
        "levels": LEVELS,
        "gate_scale": GATE_SCALE,
        "sequences": sequences,
        "models": models,
    }
    env = jinja2.Environment(loader=jinja2.PackageLoader("switchbench.analysis"), autoescape=True)
    return env.get_template("explorer.html.j2").render(
        title=title, models=models, script=script, style=style, data=script_json(data), csp=_policy(script)
    )


def script_json(data) -> str:
    """JSON that cannot end the <script> element holding it: '<', '>' and '&' (as in '</script>' or '<!--')
    are written as \\u escapes, which JSON.parse reads back as the same characters."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _policy(script: str) -> str:
    """Nothing may load; the one script that may run is ours, named by its hash."""
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    return f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'"


def write(path: Path, title: str, sequences: list[dict], models: list[dict]) -> Path:
    return write_atomic(Path(path), render(title, sequences, models))
