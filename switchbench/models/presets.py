"""Named configurations: every model row of the SwitchHead paper's Tables 1, 2, 3 and 7 (named
``{dataset}-{params}-{model}-h{heads}``), the MAC-matched variants of its section 3.5, tiny CPU models, and the
presets each registered family declares (families the paper does not have: parameter-matched to its dense rows)."""

import difflib
from types import MappingProxyType

from switchbench.models import family as registry
from switchbench.models.config import ModelConfig, changeable_fields, unread, unread_error, with_changes

# Shared by the rows of one size; dropout and the sigma-MoE settings are the paper's small/big values.
_SMALL_XL = dict(d_model=412, n_layers=16, T=256, context_blocks=1, vocab=8000, dropout=0.1)
_BIG_XL = dict(d_model=1024, n_layers=18, T=512, context_blocks=1, vocab=8000, dropout=0.2)
_ENWIK8 = dict(d_model=512, n_layers=12, T=512, context_blocks=1, vocab=256, dropout=0.1)
_SMALL_ROPE = dict(_SMALL_XL, pos="rope", T=512, context_blocks=0)
_BIG_ROPE = dict(_BIG_XL, pos="rope", T=1024, context_blocks=0)
_SMALL_SIGMA_MOE = dict(mlp_experts=16, mlp_expert_size=128, mlp_k=4, mlp_entropy_reg=1e-4)
_BIG_SIGMA_MOE = dict(
    mlp_experts=32, mlp_expert_size=128, mlp_k=4, mlp_entropy_reg=1e-3, mlp_expert_dropout=0.1
)


def _dense(base, heads, d_head, d_ff):
    return dict(base, model="transformer", n_heads=heads, d_head=d_head, d_ff=d_ff)


def _switchhead(base, heads, d_head, experts, k, d_ff):
    return dict(base, model="switchhead", n_heads=heads, d_head=d_head, n_experts=experts, k=k, d_ff=d_ff)


def _switchall(base, heads, d_head, experts, k, sigma_moe):
    return dict(base, **sigma_moe, model="switchall", n_heads=heads, d_head=d_head, n_experts=experts, k=k)


def _moa(base, heads, d_head, experts, d_ff):
    return dict(base, model="moa", n_heads=heads, d_head=d_head, n_experts=experts, d_ff=d_ff)


_PUBLISHED = {
    # Table 1: Wikitext-103, and MoA (d_head and E inferred: the only values that reproduce the costs)
    "wikitext103-47m-transformer-h10": _dense(_SMALL_XL, 10, 41, 2053),
    "wikitext103-47m-transformer-h2": _dense(_SMALL_XL, 2, 205, 2053),
    "wikitext103-47m-switchhead-h2": _switchhead(_SMALL_XL, 2, 76, 5, 2, 2080),
    "wikitext103-47m-moa-h2": _moa(_SMALL_XL, 2, 88, 10, 2053),
    "wikitext103-47m-moa-h4": _moa(_SMALL_XL, 4, 88, 10, 2053),
    "wikitext103-47m-moa-h6": _moa(_SMALL_XL, 6, 88, 10, 2053),
    "wikitext103-47m-moa-h8": _moa(_SMALL_XL, 8, 88, 10, 2053),
    "wikitext103-262m-transformer-h16": _dense(_BIG_XL, 16, 64, 4110),
    "wikitext103-262m-transformer-h2": _dense(_BIG_XL, 2, 512, 4110),
    "wikitext103-262m-switchhead-h2": _switchhead(_BIG_XL, 2, 132, 8, 4, 4147),
    "wikitext103-262m-moa-h2": _moa(_BIG_XL, 2, 146, 16, 4110),
    "wikitext103-262m-moa-h4": _moa(_BIG_XL, 4, 146, 16, 4110),
    "wikitext103-262m-moa-h8": _moa(_BIG_XL, 8, 146, 16, 4110),
    "wikitext103-262m-moa-h12": _moa(_BIG_XL, 12, 146, 16, 4110),
    # Table 2: C4, peS2o, Enwik8 (Wikitext-103 rows are Table 1's)
    "c4-47m-transformer-h10": _dense(_SMALL_XL, 10, 41, 2053),
    "c4-47m-transformer-h2": _dense(_SMALL_XL, 2, 205, 2053),
    "c4-47m-switchhead-h2": _switchhead(_SMALL_XL, 2, 76, 5, 3, 2080),
    "c4-262m-transformer-h16": _dense(_BIG_XL, 16, 64, 4110),
    "c4-262m-transformer-h4": _dense(_BIG_XL, 4, 256, 4110),
    "c4-262m-switchhead-h4": _switchhead(_BIG_XL, 4, 112, 4, 2, 4188),
    "pes2o-47m-transformer-h10": _dense(_SMALL_XL, 10, 41, 2053),
    "pes2o-47m-transformer-h2": _dense(_SMALL_XL, 2, 205, 2053),
    "pes2o-47m-switchhead-h2": _switchhead(_SMALL_XL, 2, 76, 5, 3, 2080),
    "pes2o-262m-transformer-h16": _dense(_BIG_XL, 16, 64, 4110),
    "pes2o-262m-transformer-h4": _dense(_BIG_XL, 4, 256, 4110),
    "pes2o-262m-switchhead-h4": _switchhead(_BIG_XL, 4, 112, 4, 2, 4188),
    "enwik8-41m-transformer-h8": _dense(_ENWIK8, 8, 64, 2053),
    "enwik8-41m-transformer-h2": _dense(_ENWIK8, 2, 256, 2053),
    "enwik8-41m-switchhead-h2": _switchhead(_ENWIK8, 2, 112, 4, 2, 2088),
    # Table 3: SwitchAll (SwitchHead attention + sigma-MoE MLP)
    "wikitext103-47m-switchall-h2": _switchall(_SMALL_XL, 2, 76, 5, 2, _SMALL_SIGMA_MOE),
    "c4-47m-switchall-h2": _switchall(_SMALL_XL, 2, 76, 5, 3, _SMALL_SIGMA_MOE),
    "pes2o-47m-switchall-h2": _switchall(_SMALL_XL, 2, 76, 5, 3, _SMALL_SIGMA_MOE),
    "wikitext103-262m-switchall-h4": _switchall(_BIG_XL, 4, 112, 4, 2, _BIG_SIGMA_MOE),
    "c4-262m-switchall-h4": _switchall(_BIG_XL, 4, 112, 4, 2, _BIG_SIGMA_MOE),
    "pes2o-262m-switchall-h4": _switchall(_BIG_XL, 4, 112, 4, 2, _BIG_SIGMA_MOE),
    # Table 7: RoPE, no cache
    "wikitext103-45m-transformer-h10": _dense(_SMALL_ROPE, 10, 41, 2053),
    "wikitext103-45m-transformer-h2": _dense(_SMALL_ROPE, 2, 205, 2053),
    "wikitext103-45m-switchhead-h2": _switchhead(_SMALL_ROPE, 2, 64, 5, 3, 2092),
    "wikitext103-244m-transformer-h16": _dense(_BIG_ROPE, 16, 64, 4110),
    "wikitext103-244m-transformer-h2": _dense(_BIG_ROPE, 2, 512, 4110),
    "wikitext103-243m-switchhead-h4": _switchhead(_BIG_ROPE, 4, 100, 4, 2, 4136),
    "c4-45m-transformer-h10": _dense(_SMALL_ROPE, 10, 41, 2053),
    "c4-45m-switchhead-h2": _switchhead(_SMALL_ROPE, 2, 64, 5, 3, 2092),
    "c4-244m-transformer-h16": _dense(_BIG_ROPE, 16, 64, 4110),
    "c4-244m-switchhead-h4": _switchhead(_BIG_ROPE, 4, 100, 4, 2, 4136),
}

# Section 3.5: SwitchHead with more and wider heads, matching the dense model's MACs (the paper gives no k; the 63M
# variant with Wikitext's k of 2 would run 82.5% of dense's MACs by the paper's convention, with C4's 3 98.2%).
_MAC_MATCHED = {
    "macmatched-63m-switchhead-h3": _switchhead(_SMALL_XL, 3, 112, 5, 3, 2080),
    "macmatched-376m-switchhead-h6": _switchhead(_BIG_XL, 6, 168, 4, 2, 4188),
    "macmatched-54m-switchhead-h3": _switchhead(_SMALL_ROPE, 3, 84, 5, 3, 2092),
}

_TINY = dict(d_model=64, n_layers=2, T=32, context_blocks=1, vocab=256)
_TINY_MOE = dict(mlp_experts=8, mlp_expert_size=16, mlp_k=2)
_CPU = {
    "tiny-transformer": _dense(_TINY, 4, 16, 256),
    "tiny-switchhead": _switchhead(_TINY, 2, 16, 4, 2, 256),
    "tiny-moa": _moa(_TINY, 2, 16, 4, 256),
    "tiny-switchall": _switchall(_TINY, 2, 16, 4, 2, _TINY_MOE),
    "tiny-transformer-rope": _dense(dict(_TINY, pos="rope", context_blocks=0), 4, 16, 256),
    "tiny-switchhead-rope": _switchhead(dict(_TINY, pos="rope", context_blocks=0), 2, 16, 4, 2, 256),
}

# The paper's routing analysis, sized for a CPU: ListOps, 6 layers, dense 8 heads against a parameter-matched
# SwitchHead with 2 heads (131,072 attention + MLP weights per layer each).
_LISTOPS = dict(d_model=128, n_layers=6, T=64, context_blocks=0, vocab=16, causal=False, pos="rope")
_ANALYSIS = {
    "listops-transformer-h8": _dense(_LISTOPS, 8, 16, 256),
    "listops-switchhead-h2": _switchhead(_LISTOPS, 2, 32, 4, 2, 184),
    "listops-moa-h4": _moa(_LISTOPS, 4, 32, 8, 256),
    "listops-switchall-h2": _switchall(
        _LISTOPS, 2, 32, 4, 2, dict(mlp_experts=8, mlp_expert_size=32, mlp_k=2)
    ),
}


def _with_families(presets: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
    """The presets above, then each registered family's own (derived from those declared before it)."""
    for family in registry.families():
        for name, cfg in family.presets(MappingProxyType(presets)).items():
            if name in presets:
                raise ValueError(f"family {family.name}: preset {name} exists already")
            presets[name] = cfg
    return presets


PRESETS: dict[str, ModelConfig] = _with_families(
    {name: ModelConfig(**kwargs) for name, kwargs in (_PUBLISHED | _MAC_MATCHED | _CPU | _ANALYSIS).items()}
)


OVERRIDES = ":"  # NAME:T=2048,context_blocks=0 is the preset NAME with those fields changed


def language_model(name: str) -> ModelConfig:
    """:func:`from_name` for a command that builds language models: a ListOps classifier is refused by name (the
    model would refuse it as "not causal")."""
    cfg = from_name(name)
    if not cfg.causal:
        raise ValueError(f"{name} is a ListOps classifier, not a language model")
    return cfg


def from_name(name: str) -> ModelConfig:
    """The preset called ``name``, or ``NAME:field=value,...``: the preset with those fields changed (a context
    sweep's ``wikitext103-244m-transformer-h16:T=4096``); ValueError naming the closest presets if there is none,
    or what is wrong with a change."""
    base, _, changes = name.partition(OVERRIDES)
    if base not in PRESETS:
        close = difflib.get_close_matches(base, PRESETS, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else "; `switchbench presets` lists them"
        raise ValueError(f"unknown preset {base!r}{hint}")
    if not changes:
        if name != base:  # `NAME:` with nothing after it: a change lost, most likely
            raise ValueError(f"{name}: no FIELD=VALUE after {OVERRIDES!r}")
        return PRESETS[base]
    changed = _changes(name, changes)
    cfg = with_changes(PRESETS[base], changed)
    ignored = unread(cfg, changed)
    if ignored:
        raise unread_error(cfg, ignored, f"{name}: {', '.join(ignored)}")
    return cfg


def changes_of(name: str) -> dict:
    """The fields ``NAME:field=value,...`` changes, each value read as its field's type ({} for a bare preset)."""
    changes = name.partition(OVERRIDES)[2]
    return _changes(name, changes) if changes else {}


def _changes(name: str, text: str) -> dict:
    """``field=value,...`` -> {field: value}, each value read as its field's type."""
    types = {f.name: f.type for f in changeable_fields()}
    changes = {}
    for item in text.split(","):
        field, equals, value = item.partition("=")
        if not equals or field not in types:
            raise ValueError(f"{name}: {item!r} is no FIELD=VALUE of a ModelConfig field or family option")
        if field in changes:  # the last would win without a word
            raise ValueError(f"{name}: {field} is given twice")
        kind = types[field] if isinstance(types[field], str) else types[field].__name__
        if kind == "bool" and value not in ("True", "False"):
            raise ValueError(f"{name}: {field} must be True or False; got {value!r}")
        try:
            changes[field] = {"int": int, "float": float, "bool": lambda v: v == "True"}.get(kind, str)(value)
        except ValueError:
            raise ValueError(f"{name}: {field} must be {kind}; got {value!r}") from None
    return changes
