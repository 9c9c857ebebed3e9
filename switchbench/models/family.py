"""The registry of attention families: everything the suite needs of a family, declared by the family in one place.

A family is one module that calls :func:`register` with a :class:`Family`: its module, its configuration fields
and their validation, its exact cost, the paper's cost convention where one exists, its presets, and the roles its
presets play in the suite's comparisons. Every command reads the registry; none names a family. The built-in
families live in ``switchbench/models/families/``; a separate package adds its own through the entry-point group
``switchbench.families`` (an entry point naming a module that registers on import, or a :class:`Family`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from switchbench.models.config import ModelConfig
    from switchbench.models.cost import Cost
    from switchbench.models.layers.kv_cache import CacheEntry
    from switchbench.ops.expert_matmul.cases import Case

ENTRY_POINTS = "switchbench.families"
BUILT_IN = "switchbench.models.families"
# The byte-level CPU models of `quality`: 4 layers of d_model 128, chunks of 64 bytes and one chunk of XL memory;
# every family's has the attention + MLP weights per layer of the dense one (212,992), its MLP width taking up the
# difference, as the paper matches its models.
BYTES = dict(d_model=128, n_layers=4, T=64, context_blocks=1, vocab=256)
# The comparisons a family's presets take part in. Speed groups: "47m" / "262m" (parameter-matched to the 47M /
# 262M dense Transformer-XL), "45m-rope" / "244m-rope" (the RoPE sizes), "tiny" / "tiny-rope" (CPU models, "tiny"
# also the byte-level LM of `train --task lm`). "listops": the routing-analysis classifier. "bytes" / "quality":
# the CPU / GPU models of `quality` (byte-level, parameter-matched to the dense one).
SPEED_GROUPS = ("47m", "45m-rope", "262m", "244m-rope", "tiny", "tiny-rope")
ROLES = (*SPEED_GROUPS, "listops", "bytes", "quality")


def _no_checks(cfg: ModelConfig) -> None:
    return None


def _no_presets(presets: Mapping[str, ModelConfig]) -> dict[str, ModelConfig]:
    return {}


@dataclass(frozen=True)
class Family:
    """What the suite needs of one attention family. ``name`` is the value of ``ModelConfig.model``.

    ``attention(cfg)`` builds one layer: ``forward(x [B, t, d_model], mem [B, S - t, d_model] | None, window)
    -> (y [B, t, d_model], auxiliary loss)``, an :class:`~switchbench.models.layers.observe.Observable` that records
    ``maps`` [B, H, t, S] and, where it routes, ``{src,dst}_experts``/``{src,dst}_gates`` [B, L, H, k] (experts
    per head and side) or ``experts``/``gates`` [B, t, slots] (the heads a token picks and their weights; MoA
    fills every slot, MoH its k routed heads) and, where every head is weighted, ``head_weights`` [B, t, H].
    ``exact_cost(cfg)`` counts that layer's forward pass op by op (:mod:`~switchbench.models.cost`); a test holds
    it equal to the measured MACs and saved floats.
    """

    name: str
    label: str  # how tables and figures name it
    attention: Callable[[ModelConfig], nn.Module]
    exact_cost: Callable[[ModelConfig], Cost]
    # The family's own configuration fields: a frozen dataclass whose fields (defaults included) become
    # ``ModelConfig.options`` and one command-line flag each; it validates them in its __post_init__.
    options: type | None = None
    validate: Callable[[ModelConfig], None] = _no_checks  # checks across fields; raise ValueError
    describe: Callable[[ModelConfig], str] = lambda cfg: "-"  # the routing in a few words, for tables
    attention_name: str | None = None  # the attention it runs, when another family's (SwitchAll: SwitchHead)
    mlp: str = "dense"  # dense | sigma_moe
    # What its routers pick, for the routing analysis: "experts" (each head picks experts on the source and the
    # destination side: SwitchHead), "heads" (each token picks heads and weighs them: MoA, MoH) or "" (none);
    # ``choices(cfg)``: how many things a router picks among (for usage counts); ``head_slots``: its H maps are
    # slots that each token fills with experts of a pool (MoA), not fixed heads.
    routing: str = ""
    # The shared fields of ModelConfig its attention reads (config.ROUTING_FIELDS: SwitchHead's and MoA's, top-level
    # since before families had options; config.XL_FIELDS: Transformer-XL's global biases and logit scale, where its
    # XL attention has them); a change to one it does not read is refused, not ignored.
    reads: tuple[str, ...] = ()
    choices: Callable[[ModelConfig], int] = lambda cfg: cfg.n_experts
    head_slots: bool = False
    # What one source token leaves in a decoder's cache, per layer (None: the family has no decode path). A family
    # caching keys and values gives its attention ``cache_entries(xs, positions) -> entries [B, heads, L, width]``
    # and ``attend_cached(x, entries, window) -> y``; one caching its layer inputs (a single INPUTS entry, as
    # Transformer-XL) needs neither: its forward re-projects them at every step.
    kv_cache: Callable[[ModelConfig], tuple[CacheEntry, ...]] | None = None
    # Its expert matmuls at ``batch`` sequences, as switchbench::expert_matmul takes them (the cases registry's
    # Case), for kernel-bench, kernel-tune, profile and speed (layer_expert_matmuls)
    expert_matmuls: Callable[[ModelConfig, int], tuple[Case, ...]] | None = None
    # The paper's cost convention, and the equation it prints, where the paper has the family (else None)
    paper_cost: Callable[[ModelConfig, int | None], Cost] | None = None
    printed_cost: Callable[[ModelConfig], Cost | None] | None = None
    # Its presets, given the presets declared before it (a parameter-matched family derives its own from the dense
    # ones), and the preset of each role it plays (see ROLES)
    presets: Callable[[Mapping[str, ModelConfig]], Mapping[str, ModelConfig]] = _no_presets
    roles: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        unknown = sorted(set(self.roles) - set(ROLES))
        if unknown:
            raise ValueError(
                f"family {self.name}: unknown roles {', '.join(unknown)} (known: {', '.join(ROLES)})"
            )
        if self.routing not in ("", "experts", "heads"):
            raise ValueError(
                f"family {self.name}: routing must be '', experts or heads; got {self.routing!r}"
            )
        if self.mlp not in ("dense", "sigma_moe"):
            raise ValueError(f"family {self.name}: mlp must be dense or sigma_moe; got {self.mlp!r}")
        object.__setattr__(self, "roles", MappingProxyType(dict(self.roles)))

    @property
    def key(self) -> str:
        """The name `train --model` and `quality --families` take: "dense" for the dense transformer."""
        return self.attention_name if self.attention_name == "dense" else self.name

    @property
    def attention_kind(self) -> str:
        return self.attention_name or self.name

    def option_fields(self) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(self.options) if self.options else ()


_REGISTRY: dict[str, Family] = {}
_loaded = False


def register(family: Family) -> Family:
    """Add ``family``; a second family of the same name is an error (an option that shadows a ModelConfig field
    is one too, found when a configuration of the family is built: the registry knows nothing of the config)."""
    if family.name in _REGISTRY and _REGISTRY[family.name] is not family:
        raise ValueError(f"an attention family named {family.name!r} is registered already")
    _REGISTRY[family.name] = family
    return family


def families() -> tuple[Family, ...]:
    """Every registered family: the built-in ones in their order (dense first, the baseline), then plug-ins."""
    _load()
    return tuple(_REGISTRY.values())


def get(name: str) -> Family:
    _load()
    if name not in _REGISTRY:
        raise ValueError(f"model must be one of {', '.join(_REGISTRY)}; got {name!r}")
    return _REGISTRY[name]


def expert_owners(cfg: ModelConfig) -> dict[str, Family]:
    """The families whose expert matmuls a layer of ``cfg`` runs, by sub-layer ("attn", "mlp"): its attention's
    (SwitchAll's are SwitchHead's) and, where the attention is another family's, the family's own (its MLP's)."""
    family = get(cfg.model)
    attention = next((f for f in families() if f.name == family.attention_kind), family)
    return {"attn": attention} | ({} if attention is family else {"mlp": family})


def layer_expert_matmuls(cfg: ModelConfig, batch: int) -> tuple[Case, ...]:
    """One layer's expert matmuls of ``cfg`` at ``batch`` sequences: its attention's and its MLP's
    (:func:`expert_owners`); none for a family without experts."""
    owners = expert_owners(cfg).values()
    return tuple(c for f in owners if f.expert_matmuls for c in f.expert_matmuls(cfg, batch))


def names() -> tuple[str, ...]:
    return tuple(f.name for f in families())


def by_key(key: str) -> Family:
    """The family that `train --model` / `quality --families` call ``key`` (dense, switchhead, gqa, ...)."""
    found = {f.key: f for f in families()}
    if key not in found:
        raise ValueError(f"model must be one of {', '.join(found)}; got {key!r}")
    return found[key]


def as_name(text: str) -> str:
    """``text`` as a configuration's model name: a family's key (dense) read as its name (transformer). An
    argparse ``type``: every flag that names a family takes either spelling; anything else is left to ``choices``."""
    return next((f.name for f in families() if text in (f.name, f.key)), text)


def as_key(text: str) -> str:
    """``text`` as a family's key: its name (transformer) read as its key (dense); see :func:`as_name`."""
    return next((f.key for f in families() if text in (f.name, f.key)), text)


def keys(role: str | None = None) -> tuple[str, ...]:
    """The families' keys, of those with a preset for ``role`` when given; dense first."""
    return tuple(f.key for f in families() if role is None or role in f.roles)


def role_presets(role: str) -> tuple[str, ...]:
    """The preset each family has for ``role``, dense first: a speed group, the quality models, ..."""
    return tuple(f.roles[role] for f in families() if role in f.roles)


def option_fields() -> dict[str, dataclasses.Field]:
    """Every family's option fields by name (a name two families share must have one type)."""
    out: dict[str, dataclasses.Field] = {}
    for family in families():
        for f in family.option_fields():
            if f.name in out and out[f.name].type != f.type:
                raise ValueError(
                    f"option {f.name} has two types across families: {out[f.name].type}, {f.type}"
                )
            out.setdefault(f.name, f)
    return out


def load_errors() -> tuple[str, ...]:
    """The plug-ins that failed to load, one line each (the command line refuses to run with any)."""
    _load()
    return tuple(_broken)


_broken: list[str] = []


def _load() -> None:
    """Import the built-in families, then the plug-ins' entry points, once. A plug-in that fails is left out and
    kept in :func:`load_errors`: modules build their tables from the registry on import, where an exception would
    be a traceback, not a message."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    importlib.import_module(BUILT_IN)
    for point in entry_points(group=ENTRY_POINTS):
        try:
            loaded = point.load()
            if isinstance(loaded, Family):
                register(loaded)
        except Exception as error:
            _broken.append(f"attention family plug-in {point.name!r} ({point.value}) failed to load: {error}")
