"""MoA, Mixture of Attention heads (Zhang et al. 2022): one shared K and V head and a pool of E experts, each
owning a Q and an O projection; a router picks the H active experts of every token."""

from switchbench.models.config import MOA_GATINGS, ModelConfig, in_range, one_of
from switchbench.models.cost import Cost, layer_inputs, o_input, softmax_attention, symbols
from switchbench.models.family import BYTES, Family, register
from switchbench.models.moa import MoAAttention


def validate(cfg: ModelConfig) -> None:
    in_range("n_experts", cfg.n_experts, 1)
    in_range("n_heads", cfg.n_heads, 1, cfg.n_experts)
    one_of("moa_gating", cfg.moa_gating, MOA_GATINGS)


def exact_cost(cfg: ModelConfig) -> Cost:
    """Router, Q through H of E experts, one K and one V head over the window, O through the same experts; the
    T x E router probabilities kept; attention over one key head, its learned scale keeping the query."""
    H, dh, dm, T, C = symbols(cfg)
    S, E = C * T, cfg.n_experts
    macs = T * dm * E + T * H * dm * dh + 2 * S * dm * dh + T * H * dh * dm
    kept = 1 if cfg.pos == "xl" and cfg.xl_bias_and_scale else 0
    return Cost(macs, layer_inputs(cfg) + T * E + o_input(cfg)) + softmax_attention(cfg, 1, kept)


def printed_moa(H: int, d_head: int, d_model: int, T: int, C: int) -> Cost:
    """SwitchHead paper, appendix A.2, MoA: MACs = (2H + 2) T dh dm + 2H C T^2 dh + 2 C T dh dm,
    mem = (2H + 2) T dh + 2H C T^2 + 2 C T dh."""
    return Cost(
        (2 * H + 2) * T * d_head * d_model + 2 * H * C * T * T * d_head + 2 * C * T * d_head * d_model,
        (2 * H + 2) * T * d_head + 2 * H * C * T * T + 2 * C * T * d_head,
    )


def paper_moa(H: int, d_head: int, d_model: int, T: int, C: int, E: int) -> Cost:
    """The convention behind the paper's tables, H active heads of E experts: MACs = 2 H dh T^2 C + (2H + 2) dm
    dh T + 2 H T dh + E dm T + 2 dm T dh C; mem = 2 H T^2 C + (2H + 2) dh T + 2 T dh + E T C."""
    return Cost(
        2 * H * d_head * T * T * C
        + (2 * H + 2) * d_model * d_head * T
        + 2 * H * T * d_head
        + E * d_model * T
        + 2 * d_model * T * d_head * C,
        2 * H * T * T * C + (2 * H + 2) * d_head * T + 2 * T * d_head + E * T * C,
    )


def paper_cost(cfg: ModelConfig, C: int | None = None) -> Cost:
    H, dh, dm, T, C_cfg = symbols(cfg)
    return paper_moa(H, dh, dm, T, C_cfg if C is None else C, cfg.n_experts)


def expert_matmuls(cfg: ModelConfig, batch: int) -> tuple[tuple, ...]:
    """Q: each token's H slots from the pool of E; O: the slots summed, weighted by the router."""
    H, E, d, D, tokens = cfg.n_heads, cfg.n_experts, cfg.d_model, cfg.d_head, batch * cfg.T
    return (("moa-q", tokens, 1, H, H, E, 1, d, D, False), ("moa-o", tokens, H, H, 1, E, 1, D, d, True))


FAMILY = register(
    Family(
        name="moa",
        label="MoA",
        attention=MoAAttention,
        exact_cost=exact_cost,
        validate=validate,
        describe=lambda cfg: f"E{cfg.n_experts} {cfg.moa_gating}",
        routing="heads",
        head_slots=True,
        expert_matmuls=expert_matmuls,
        paper_cost=paper_cost,
        printed_cost=lambda cfg: printed_moa(*symbols(cfg)) if cfg.pos == "xl" else None,
        # the byte-level model: 4 active of 8 query experts
        presets=lambda declared: {
            "bytes-920k-moa-h4": ModelConfig(
                **BYTES, model="moa", n_heads=4, d_head=32, n_experts=8, d_ff=524
            )
        },
        roles={
            "47m": "wikitext103-47m-moa-h4",
            "262m": "wikitext103-262m-moa-h8",
            "tiny": "tiny-moa",
            "listops": "listops-moa-h4",
            "bytes": "bytes-920k-moa-h4",
            "quality": "wikitext103-47m-moa-h4",
        },
    )
)
