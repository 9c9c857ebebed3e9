"""SwitchHead (Csordás et al., NeurIPS 2024): a few heads whose V and O projections (by default) are mixtures of
experts, chosen per token by sigmoid routers on the source and destination side."""

from switchbench.models.config import ModelConfig, in_range
from switchbench.models.cost import Cost, layer_inputs, o_input, softmax_attention, symbols
from switchbench.models.families.dense import printed_xl
from switchbench.models.family import BYTES, Family, register
from switchbench.models.switchhead import SwitchHeadAttention


def validate(cfg: ModelConfig) -> None:
    in_range("n_experts", cfg.n_experts, 1)
    in_range("k", cfg.k, 1, cfg.n_experts)
    if not cfg.experts or set(cfg.experts) - set("qkvo") or len(set(cfg.experts)) != len(cfg.experts):
        raise ValueError(f"experts must be a non-empty subset of 'qkvo', got {cfg.experts!r}")


def describe(cfg: ModelConfig) -> str:
    return f"E{cfg.n_experts} k{cfg.k} {cfg.experts}" + (" shared" if cfg.shared_selection else "")


def exact_cost(cfg: ModelConfig) -> Cost:
    """Routers (sigmoids of every expert kept, each side), the Q, K, V, O projections (k expert matmuls for the
    expert ones), then attention over H key heads with a fixed scale."""
    H, dh, dm, T, C = symbols(cfg)
    S = C * T
    E, k, experts = cfg.n_experts, cfg.k, cfg.experts
    src, dst = bool(set(experts) & set("kv")), bool(set(experts) & set("qo"))
    router_tokens = (S if src else 0) + (T if dst and not (cfg.shared_selection and src) else 0)
    scores = ((S if src else 0) + (T if dst else 0)) * H * E
    macs = router_tokens * dm * H * E
    for name, tokens, d_in, d_out in (("q", T, dm, dh), ("k", S, dm, dh), ("v", S, dm, dh), ("o", T, dh, dm)):
        macs += tokens * H * (k if name in experts else 1) * d_in * d_out
    return Cost(macs, layer_inputs(cfg) + scores + o_input(cfg)) + softmax_attention(cfg, H)


def printed_switchhead(H: int, d_head: int, d_model: int, T: int, C: int, k: int) -> Cost:
    """SwitchHead paper, appendix A.2 (V, O experts): MACs = H(2 T dh dm + 2 T k dh (dm + 1) + 2 C T^2 dh
    + 2 C T dh dm); memory as dense XL."""
    macs = H * (
        2 * T * d_head * d_model
        + 2 * T * k * d_head * (d_model + 1)
        + 2 * C * T * T * d_head
        + 2 * C * T * d_head * d_model
    )
    return Cost(macs, printed_xl(H, d_head, d_model, T, C).mem)


def paper_switchhead(
    H: int, d_head: int, d_model: int, T: int, C: int, E: int, k: int, experts: str, xl: bool
) -> Cost:
    """The convention behind the paper's tables. With n_exp = number of expert projections among Q, K, V, O and
    n_sel = [K or V expert] + [Q or O expert]:
    MACs = 2 H dh T^2 C + (n_exp k + 4 - n_exp) dm H dh T + n_exp H k T dh + n_sel E dm T C [+ 2 H dm T dh for XL];
    mem = 2 H T^2 C + 4 H dh T + n_sel E T C [+ 2 H T dh for XL]. The router counts d_model x E for all heads and
    the XL position term has no factor C, as in the authors' script."""
    n_exp = len(experts)
    n_sel = bool(set(experts) & set("kv")) + bool(set(experts) & set("qo"))
    macs = (
        2 * H * d_head * T * T * C
        + (n_exp * k + 4 - n_exp) * d_model * H * d_head * T
        + n_exp * H * k * T * d_head
        + n_sel * E * d_model * T * C
    )
    mem = 2 * H * T * T * C + 4 * H * d_head * T + n_sel * E * T * C
    if xl:
        macs += 2 * H * d_model * T * d_head
        mem += 2 * H * T * d_head
    return Cost(macs, mem)


def paper_cost(cfg: ModelConfig, C: int | None = None) -> Cost:
    H, dh, dm, T, C_cfg = symbols(cfg)
    C = C_cfg if C is None else C
    return paper_switchhead(H, dh, dm, T, C, cfg.n_experts, cfg.k, cfg.experts, cfg.pos == "xl")


def printed_cost(cfg: ModelConfig) -> Cost | None:
    """The printed equation covers XL with V and O experts only."""
    if cfg.pos != "xl" or sorted(cfg.experts) != ["o", "v"]:
        return None
    return printed_switchhead(*symbols(cfg), cfg.k)


def expert_matmuls(cfg: ModelConfig, batch: int) -> tuple[tuple, ...]:
    """Each expert projection: K and V over the window (the source side sees the memory too), Q and O over the
    current tokens; H routers of E experts, k slots each; O sums its heads' slots, gated."""
    H, E, k, d, D = cfg.n_heads, cfg.n_experts, cfg.k, cfg.d_model, cfg.d_head
    window, tokens = batch * cfg.T * (1 + cfg.context_blocks), batch * cfg.T
    shapes = {"q": (tokens, 1, H * k, H, E, H, d, D, True), "k": (window, 1, H * k, H, E, H, d, D, True),
              "v": (window, 1, H * k, H, E, H, d, D, True), "o": (tokens, H, H * k, 1, E, H, D, d, True)}  # fmt: skip
    return tuple((f"switchhead-{p}", *shapes[p]) for p in "qkvo" if p in cfg.experts)


FAMILY = register(
    Family(
        name="switchhead",
        label="SwitchHead",
        attention=SwitchHeadAttention,
        exact_cost=exact_cost,
        validate=validate,
        describe=describe,
        routing="experts",
        expert_matmuls=expert_matmuls,
        paper_cost=paper_cost,
        printed_cost=printed_cost,
        presets=lambda declared: {
            "bytes-920k-switchhead-h2": ModelConfig(
                **BYTES, model="switchhead", n_heads=2, d_head=32, n_experts=4, k=2, d_ff=472
            )
        },
        roles={
            "47m": "c4-47m-switchhead-h2",
            "262m": "c4-262m-switchhead-h4",
            "45m-rope": "wikitext103-45m-switchhead-h2",
            "244m-rope": "wikitext103-243m-switchhead-h4",
            "tiny": "tiny-switchhead",
            "tiny-rope": "tiny-switchhead-rope",
            "listops": "listops-switchhead-h2",
            "bytes": "bytes-920k-switchhead-h2",
            "quality": "wikitext103-47m-switchhead-h2",
        },
    )
)
