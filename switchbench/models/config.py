"""Model configuration: one frozen dataclass for every family, validated on construction.

The fields shared by the families are the paper's symbols; a family's own fields live in ``options`` (declared
by the family, see :mod:`switchbench.models.family`). The fields of the three families the paper compares stay
top-level, so that every preset, checkpoint and result written before the registry reads the same.
"""

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from switchbench.models import family as registry

POSITIONS = ("xl", "rope")
MOA_GATINGS = ("softmax", "sigmoid")
# Shared fields that only some families read: the routing of SwitchHead and MoA and Transformer-XL's extras (each
# family names those it reads, Family.reads; the extras only under XL positions) and each MLP's width. A change by
# hand to one the model does not read would leave the numbers as they were under a label that says otherwise, so it
# is refused (:func:`unread`).
ROUTING_FIELDS = (
    "n_experts",
    "k",
    "experts",
    "shared_selection",
    "entropy_reg",
    "expert_dropout",
    "moa_gating",
    "moa_cv_coef",
    "moa_switch_coef",
    "moa_z_coef",
)
XL_FIELDS = ("xl_bias_and_scale",)
MLP_FIELDS = {
    "dense": ("d_ff",),
    "sigma_moe": ("mlp_experts", "mlp_expert_size", "mlp_k", "mlp_entropy_reg", "mlp_expert_dropout"),
}


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters named after the paper's symbols; defaults are the 47M Transformer-XL."""

    model: str = "transformer"  # a registered family: transformer | switchhead | moa | switchall | ...
    pos: str = "xl"  # xl: relative positions + memory; rope: rotary
    d_model: int = 412
    n_layers: int = 16
    n_heads: int = 10  # H: attention matrices per token (MoA: active heads = its k)
    d_head: int = 41
    d_ff: int = 2053  # dense MLP hidden size (unused by switchall)
    n_experts: int = 5  # E: experts per head (switchhead) or in the pool (moa)
    k: int = 2  # active experts per head and side (switchhead)
    experts: str = "vo"  # which of q, k, v, o are mixtures of experts (switchhead)
    shared_selection: bool = False  # one router per head serves both sides (switchhead)
    T: int = 256  # chunk length: tokens computed per step
    context_blocks: int = 1  # cached past chunks attended to; C = 1 + context_blocks
    vocab: int = 8000
    causal: bool = True  # False for sequence classification (ListOps)
    # The authors' XL extras: dense attention learns Transformer-XL's global biases u, v and a logit scale, MoA a
    # temperature. False: a fixed 1/sqrt(d_head) and no biases, the attention maths of SwitchHead's heads.
    xl_bias_and_scale: bool = True
    dropout: float = 0.0  # training: embedding, residual branches, MLP hidden layer, before the output layer
    entropy_reg: float = 0.0  # switchhead router entropy regulariser coefficient
    expert_dropout: float = 0.0  # switchhead
    moa_gating: str = "softmax"
    moa_cv_coef: float = 0.0  # MoA auxiliary losses: importance CV^2, switch balance, z-loss
    moa_switch_coef: float = 0.01
    moa_z_coef: float = 0.001
    mlp_experts: int = 16  # N_E of the sigma-MoE MLP (switchall)
    mlp_expert_size: int = 128  # G
    mlp_k: int = 4  # K
    mlp_entropy_reg: float = 1e-4
    mlp_expert_dropout: float = 0.0
    # The family's own fields, as (name, value) pairs (a dict is accepted); defaults filled in on construction
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        family = registry.get(self.model)
        object.__setattr__(self, "options", _family_options(family, self.options))
        one_of("pos", self.pos, POSITIONS)
        for name in ("d_model", "n_layers", "n_heads", "d_head", "T", "vocab"):
            in_range(name, getattr(self, name), 1)
        in_range("context_blocks", self.context_blocks, 0)
        for name in ("causal", "shared_selection", "xl_bias_and_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if not self.causal and self.context_blocks:
            raise ValueError(f"context_blocks must be 0 when causal is False, got {self.context_blocks}")
        for name in ("dropout", "expert_dropout", "mlp_expert_dropout"):
            in_range(name, getattr(self, name), 0.0, 1.0, closed_hi=False)
        for name in ("entropy_reg", "moa_cv_coef", "moa_switch_coef", "moa_z_coef", "mlp_entropy_reg"):
            in_range(name, getattr(self, name), 0.0)
        if self.mlp == "dense":
            in_range("d_ff", self.d_ff, 1)
        else:
            in_range("mlp_experts", self.mlp_experts, 1)
            in_range("mlp_expert_size", self.mlp_expert_size, 1)
            in_range("mlp_k", self.mlp_k, 1, self.mlp_experts)
        family.validate(self)

    @property
    def family(self) -> "registry.Family":
        return registry.get(self.model)

    @property
    def attention(self) -> str:
        """The attention family it runs (SwitchAll runs SwitchHead's; dense: "dense")."""
        return self.family.attention_kind

    @property
    def mlp(self) -> str:
        return self.family.mlp

    @property
    def opts(self) -> Any:
        """The family's options as its own dataclass (None for a family without any)."""
        options = self.family.options
        return options(**dict(self.options)) if options else None

    @property
    def mem_len(self) -> int:
        """Tokens of memory the layers attend to beyond the current chunk."""
        return self.context_blocks * self.T

    def to_dict(self) -> dict:
        """Every field; ``options`` as a dict, and left out when empty (as every file written before it has it)."""
        d = asdict(self)
        options = dict(d.pop("options"))
        return d | ({"options": options} if options else {})

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown config fields: {', '.join(unknown)}")
        return cls(**d)

    def replace(self, **changes) -> "ModelConfig":
        return replace(self, **changes)


def _family_options(family: "registry.Family", given) -> tuple[tuple[str, Any], ...]:
    """``given`` (pairs or a dict) checked by the family's options dataclass, its defaults filled in."""
    given = dict(given)
    if family.options is None:
        if given:
            raise ValueError(f"model {family.name} takes no options; got {', '.join(sorted(given))}")
        return ()
    known = {f.name for f in family.option_fields()}
    shadowed = known & {f.name for f in fields(ModelConfig)}
    if shadowed:
        raise ValueError(
            f"family {family.name}: options {', '.join(sorted(shadowed))} shadow ModelConfig fields"
        )
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)} is no option of model {family.name} (its options: {', '.join(sorted(known))})"
        )
    return tuple(sorted(asdict(family.options(**given)).items()))


def changeable_fields() -> list:
    """The fields a change by name may set: ModelConfig's own, then every registered family's options."""
    return [f for f in fields(ModelConfig) if f.name != "options"] + list(registry.option_fields().values())


def with_changes(base: ModelConfig, changes: dict) -> ModelConfig:
    """``base`` with ``changes``: ModelConfig fields and family options alike, by name. A family's options carry
    over while the family stays; a change of family starts the new one from its defaults."""
    changes = dict(changes)
    options = {name: changes.pop(name) for name in registry.option_fields() if name in changes}
    model = changes.get("model", base.model)
    if options or model != base.model:
        changes["options"] = (dict(base.options) if model == base.model else {}) | options
    return base.replace(**changes)


def unread(cfg: ModelConfig, names) -> list[str]:
    """Those of ``names`` (fields changed by hand) that ``cfg``'s model does not read."""
    ignored = set(ROUTING_FIELDS + XL_FIELDS) - set(cfg.family.reads)
    ignored |= set(XL_FIELDS) if cfg.pos != "xl" else set()
    ignored |= {name for mlp, names_of in MLP_FIELDS.items() if mlp != cfg.mlp for name in names_of}
    return [name for name in names if name in ignored]


def unread_error(cfg: ModelConfig, ignored: list[str], named: str) -> ValueError:
    """The refusal of the changes ``ignored`` (:func:`unread`; ``named`` as the user typed them)."""
    rope = cfg.pos == "rope" and set(ignored) & set(XL_FIELDS)  # XL's extras: RoPE is why
    model = f"{cfg.model} model" + (" with RoPE positions" if rope else "")
    return ValueError(f"{named}: no effect on a {model}, which does not read it")


def one_of(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


# No size or count of the suite's passes 32 bits: its kernels index a row in int32, and a larger one would reach torch
# as an overflow, not as a refusal
LARGEST_INT = 2**31 - 1


def in_range(name, value, lo, hi=None, closed_hi=True):
    if isinstance(value, bool) or not isinstance(value, type(lo) if isinstance(lo, int) else (int, float)):
        raise ValueError(
            f"{name} must be {'an integer' if isinstance(lo, int) else 'a number'}; got {value!r}"
        )
    if not math.isfinite(value):  # NaN compares false with every bound
        raise ValueError(f"{name} must be a finite number; got {value}")
    if isinstance(value, int) and value > LARGEST_INT:
        raise ValueError(f"{name} must be <= {LARGEST_INT}; got {value}")
    above = hi is None or (value <= hi if closed_hi else value < hi)
    if value < lo or not above:
        if hi is None:
            raise ValueError(f"{name} must be >= {lo}; got {value}")
        raise ValueError(f"{name} must be in [{lo}, {hi}{']' if closed_hi else ')'}; got {value}")
