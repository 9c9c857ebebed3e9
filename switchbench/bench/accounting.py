"""Cost of one attention layer on one sequence of T tokens, forward pass.

Compute is in MACs (multiply-accumulates of matmul-like products: linear, matmul, bmm, einsum, the expert
matmul). Memory is in floats kept for the backward pass (activations, not bytes, not parameters). Symbols as in
the SwitchHead paper: H heads, d_head, d_model, T tokens per chunk, C = 1 + cached chunks, E experts, k active.

Two views of the paper live here: the equations printed in its appendix A.2 (``printed_*``), and the convention
of the script behind its Tables 1, 2, 3 and 7 (``paper_*``), which differs from the printed equations and is
the one that reproduces the published cells.
"""

from dataclasses import dataclass

from switchbench.models.attention_rope import sdpa_width
from switchbench.models.config import ModelConfig


@dataclass(frozen=True)
class Cost:
    macs: int
    mem: int  # floats kept for backward


# Printed equations (SwitchHead paper, appendix A.2)


def printed_xl(H: int, d_head: int, d_model: int, T: int, C: int) -> Cost:
    """Dense Transformer-XL: MACs = H(4 T dh dm + 2 C T^2 dh + 2 C T dh dm), mem = H(4 T dh + 2 C T^2 + 2 C T dh)."""
    return Cost(
        H * (4 * T * d_head * d_model + 2 * C * T * T * d_head + 2 * C * T * d_head * d_model),
        H * (4 * T * d_head + 2 * C * T * T + 2 * C * T * d_head),
    )


def printed_switchhead(H: int, d_head: int, d_model: int, T: int, C: int, k: int) -> Cost:
    """SwitchHead (V, O experts): MACs = H(2 T dh dm + 2 T k dh (dm + 1) + 2 C T^2 dh + 2 C T dh dm);
    memory as dense XL."""
    macs = H * (
        2 * T * d_head * d_model
        + 2 * T * k * d_head * (d_model + 1)
        + 2 * C * T * T * d_head
        + 2 * C * T * d_head * d_model
    )
    return Cost(macs, printed_xl(H, d_head, d_model, T, C).mem)


def printed_moa(H: int, d_head: int, d_model: int, T: int, C: int) -> Cost:
    """MoA: MACs = (2H + 2) T dh dm + 2H C T^2 dh + 2 C T dh dm, mem = (2H + 2) T dh + 2H C T^2 + 2 C T dh."""
    return Cost(
        (2 * H + 2) * T * d_head * d_model + 2 * H * C * T * T * d_head + 2 * C * T * d_head * d_model,
        (2 * H + 2) * T * d_head + 2 * H * C * T * T + 2 * C * T * d_head,
    )


def printed_cost(cfg: ModelConfig) -> Cost | None:
    """The printed equation of ``cfg``'s family; None where the paper prints none (RoPE, non-default experts)."""
    if cfg.pos != "xl" or (cfg.attention == "switchhead" and sorted(cfg.experts) != ["o", "v"]):
        return None
    H, dh, dm, T, C = _symbols(cfg)
    if cfg.attention == "dense":
        return printed_xl(H, dh, dm, T, C)
    if cfg.attention == "switchhead":
        return printed_switchhead(H, dh, dm, T, C, cfg.k)
    return printed_moa(H, dh, dm, T, C)


# The convention behind the published tables (reproduces Tables 1, 2, 3 and 7)


def paper_dense(H: int, d_head: int, d_model: int, T: int, C: int, xl: bool) -> Cost:
    """MACs = 2 H dh T^2 C + 4 dm H dh T [+ 2 H dm T dh C for XL];
    mem = 2 H T^2 C + 4 H dh T [+ 2 H T dh C for XL]."""
    macs = 2 * H * d_head * T * T * C + 4 * d_model * H * d_head * T
    mem = 2 * H * T * T * C + 4 * H * d_head * T
    if xl:
        macs += 2 * H * d_model * T * d_head * C
        mem += 2 * H * T * d_head * C
    return Cost(macs, mem)


def paper_switchhead(
    H: int, d_head: int, d_model: int, T: int, C: int, E: int, k: int, experts: str, xl: bool
) -> Cost:
    """With n_exp = number of expert projections among Q, K, V, O and n_sel = [K or V expert] + [Q or O expert]:
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


def paper_moa(H: int, d_head: int, d_model: int, T: int, C: int, E: int) -> Cost:
    """H active heads of E experts: MACs = 2 H dh T^2 C + (2H + 2) dm dh T + 2 H T dh + E dm T + 2 dm T dh C;
    mem = 2 H T^2 C + (2H + 2) dh T + 2 T dh + E T C."""
    return Cost(
        2 * H * d_head * T * T * C
        + (2 * H + 2) * d_model * d_head * T
        + 2 * H * T * d_head
        + E * d_model * T
        + 2 * d_model * T * d_head * C,
        2 * H * T * T * C + (2 * H + 2) * d_head * T + 2 * T * d_head + E * T * C,
    )


def paper_cost(cfg: ModelConfig, C: int | None = None) -> Cost:
    """The published tables' convention for ``cfg``; ``C`` overrides 1 + context_blocks."""
    H, dh, dm, T, C_cfg = _symbols(cfg)
    C = C_cfg if C is None else C
    xl = cfg.pos == "xl"
    if cfg.attention == "dense":
        return paper_dense(H, dh, dm, T, C, xl)
    if cfg.attention == "switchhead":
        return paper_switchhead(H, dh, dm, T, C, cfg.n_experts, cfg.k, cfg.experts, xl)
    return paper_moa(H, dh, dm, T, C, cfg.n_experts)


def _symbols(cfg: ModelConfig) -> tuple[int, int, int, int, int]:
    return cfg.n_heads, cfg.d_head, cfg.d_model, cfg.T, 1 + cfg.context_blocks


def format_paper(value: int, decimals: int, unit: str) -> str:
    """As the tables print: value / 1e6 with an M, or / 1e9 with a G, to ``decimals`` places."""
    return f"{value / (1e9 if unit == 'G' else 1e6):.{decimals}f}{unit}"


def parse_paper(cell: str) -> tuple[float, int, str]:
    """'170.4M' -> (170.4e6, 1, 'M'): the value, its printed decimals and its unit."""
    number, unit = cell[:-1], cell[-1]
    if unit not in "MG":
        raise ValueError(f"a published cost ends in M or G; got {cell!r}")
    decimals = len(number.split(".")[1]) if "." in number else 0
    return float(number) * (1e9 if unit == "G" else 1e6), decimals, unit


# Exact count of this project's modules (models/): every matmul-like product, every float saved for backward


def exact_cost(cfg: ModelConfig) -> Cost:
    """One attention layer of ``cfg``: T current tokens after (C - 1) T cached ones, S = C T keys, forward pass.

    Each term names the op of models/ that performs the MACs or saves the floats; auxiliary losses are left out
    (they are computed only when their coefficient is non-zero). Memory counts distinct storages of floating
    tensors that autograd saves, parameters excluded.
    """
    H, dh, dm, T, C = _symbols(cfg)
    S = C * T
    macs, mem = _exact_projections(cfg, H, dh, dm, T, S)
    core = _exact_core(cfg, H, dh, dm, T, S)
    return Cost(macs + core.macs, mem + core.mem)


def _exact_projections(cfg: ModelConfig, H: int, dh: int, dm: int, T: int, S: int) -> tuple[int, int]:
    """Routers and the Q, K, V, O projections; memory: the layer inputs, router scores, the O input."""
    inputs = T * dm + (S * dm if S > T else 0)  # current tokens; the window [memory; current] is a new tensor
    # The heads' outputs made [T, H d_head]-contiguous for the O projection. With RoPE, SDPA keeps its output
    # anyway, and it has this layout already (no copy) with one head and one token, or with one of them when SDPA
    # padded no channels that had to be dropped.
    laid_out = H * T == 1 or ((H == 1 or T == 1) and sdpa_width(dh) == dh)
    o_input = 0 if cfg.pos == "rope" and laid_out else T * H * dh
    if cfg.attention == "dense":
        return (T + 2 * S) * dm * H * dh + T * H * dh * dm, inputs + o_input
    if cfg.attention == "moa":
        E = cfg.n_experts
        macs = T * dm * E + T * H * dm * dh + 2 * S * dm * dh + T * H * dh * dm  # router, Q, K, V, O
        return macs, inputs + T * E + o_input  # T x E router probabilities
    E, k, experts = cfg.n_experts, cfg.k, cfg.experts
    src, dst = bool(set(experts) & set("kv")), bool(set(experts) & set("qo"))
    router_tokens = (S if src else 0) + (T if dst and not (cfg.shared_selection and src) else 0)
    scores = ((S if src else 0) + (T if dst else 0)) * H * E  # sigmoids of every expert, each side
    macs = router_tokens * dm * H * E
    for name, tokens, d_in, d_out in (("q", T, dm, dh), ("k", S, dm, dh), ("v", S, dm, dh), ("o", T, dh, dm)):
        macs += tokens * H * (k if name in experts else 1) * d_in * d_out
    return macs, inputs + scores + o_input


def _exact_core(cfg: ModelConfig, H: int, dh: int, dm: int, T: int, S: int) -> Cost:
    """Attention of H query heads over S keys with H_k key heads (1 for MoA); XL adds projected positions."""
    Hk = 1 if cfg.attention == "moa" else H
    if cfg.pos == "xl":
        macs = 2 * H * T * S * dh  # q k^T and A v
        D = S if cfg.causal else S + T - 1  # distances 0..S-1, and the negative ones without a causal mask
        macs += D * dm * Hk * dh + H * T * dh * D  # position projection, q r^T
        # sinusoids, projected positions, q, k, the attention map (after softmax), v
        mem = D * dm + D * Hk * dh + T * H * dh + S * Hk * dh + H * T * S + S * Hk * dh
        if cfg.xl_bias_and_scale and cfg.attention != "switchhead":
            # the learned scale keeps q, the unscaled query; the dense biases make two queries, q + u and q + v
            mem += T * H * dh * (2 if cfg.attention == "dense" else 1)
        return Cost(macs, mem)
    half = int(dh * 0.5) // 2  # rotated channel pairs
    rotation = 2 * (T + S) * half  # cos and sin of the query and key positions
    dp = sdpa_width(dh)  # SDPA runs on heads zero-padded to this width
    # q and k rotated, v and the output (all four padded), its logsumexp, and the boolean mask made additive
    sdpa = T * H * dp + S * Hk * dp + S * Hk * dp + T * H * dp + H * T + (T * S if cfg.causal else 0)
    return Cost(2 * H * T * S * dp, rotation + sdpa)


def model_macs(cfg: ModelConfig) -> int:
    """Forward MACs of the whole language model on one sequence: L layers of attention and MLP, and the head."""
    T, dm = cfg.T, cfg.d_model
    if cfg.mlp == "dense":
        mlp = 2 * T * dm * cfg.d_ff
    else:  # router, then K experts of size G up and down
        mlp = T * dm * cfg.mlp_experts + 2 * T * cfg.mlp_k * dm * cfg.mlp_expert_size
    return cfg.n_layers * (exact_cost(cfg).macs + mlp) + T * dm * cfg.vocab
