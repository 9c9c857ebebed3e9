"""Cost of one attention layer on one sequence of T tokens, forward pass, in every view the suite compares.

Compute is in MACs (multiply-accumulates of matmul-like products: linear, matmul, bmm, einsum, the expert
matmul). Memory is in floats kept for the backward pass (activations, not bytes, not parameters). Symbols as in
the SwitchHead paper: H heads, d_head, d_model, T tokens per chunk, C = 1 + cached chunks, E experts, k active.

Three views, each declared by the attention family (switchbench/models/families/): the exact count of this
project's modules, op by op; the equations printed in the paper's appendix A.2 (``printed_*``); and the convention
of the script behind its Tables 1, 2, 3 and 7 (``paper_*``), which differs from the printed equations and is the
one that reproduces the published cells. The last two exist only for the families the paper has.
"""

from switchbench.models.config import ModelConfig
from switchbench.models.cost import Cost


def exact_cost(cfg: ModelConfig) -> Cost:
    """One attention layer of ``cfg``: T current tokens after (C - 1) T cached ones, S = C T keys, forward pass.

    Each term names the op of models/ that performs the MACs or saves the floats; auxiliary losses are left out
    (they are computed only when their coefficient is non-zero). Memory counts distinct storages of floating
    tensors that autograd saves, parameters excluded.
    """
    return cfg.family.exact_cost(cfg)


def paper_cost(cfg: ModelConfig, C: int | None = None) -> Cost | None:
    """The published tables' convention for ``cfg`` (``C`` overrides 1 + context_blocks); None for a family the
    paper does not have."""
    convention = cfg.family.paper_cost
    return None if convention is None else convention(cfg, C)


def printed_cost(cfg: ModelConfig) -> Cost | None:
    """The printed equation of ``cfg``'s family; None where the paper prints none (RoPE, non-default experts,
    families the paper does not have)."""
    equation = cfg.family.printed_cost
    return None if equation is None else equation(cfg)


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


def model_macs(cfg: ModelConfig, batch: int = 1) -> int:
    """Forward MACs of the whole language model on ``batch`` sequences: L layers of attention and MLP, and the
    head."""
    T, dm = cfg.T, cfg.d_model
    if cfg.mlp == "dense":
        mlp = 2 * T * dm * cfg.d_ff
    else:  # router, then K experts of size G up and down
        mlp = T * dm * cfg.mlp_experts + 2 * T * cfg.mlp_k * dm * cfg.mlp_expert_size
    return cfg.n_layers * (exact_cost(cfg).batched_macs(batch) + batch * mlp) + batch * T * dm * cfg.vocab


def model_scores(cfg: ModelConfig, batch: int = 1) -> int:
    """Attention scores of the whole language model's forward pass on ``batch`` sequences: what its softmaxes
    normalise, H T S a layer and sequence (:class:`~switchbench.models.cost.Cost`)."""
    return cfg.n_layers * batch * exact_cost(cfg).scores
