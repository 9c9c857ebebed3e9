"""Exact cost of the pieces every attention layer of models/ shares: its inputs, the softmax attention of its
position scheme, the laid-out input of its output projection. A family's ``exact_cost`` adds its projections.

One attention layer, one sequence, forward pass: T current tokens after (C - 1) T cached ones, S = C T keys.
Compute is in MACs (multiply-accumulates of matmul-like products); memory in floats that autograd saves for the
backward pass (distinct storages of floating tensors, parameters excluded); attention scores in the logits a
softmax normalises, H T S. Scores are the work MACs leave out: each takes an exponential (twice in a flash
backward, which recomputes it), a running maximum and sum, and with Transformer-XL a read of the position term and a
write of its gradient, whatever the head's width; a family with fewer, wider heads computes fewer of them for its
MACs. A batch of B sequences computes
B times the MACs of one, less what depends on positions alone (XL's projected positions), which it computes once
(:meth:`Cost.batched_macs`).
"""

from dataclasses import dataclass

from switchbench.models.config import ModelConfig
from switchbench.ops.attention.kernels import sdpa_width


@dataclass(frozen=True)
class Cost:
    macs: int
    mem: int  # floats kept for backward
    shared_macs: int = 0  # of macs, those a batch computes once for all its sequences
    # attention logits a softmax normalises (the causal mask's half not taken off, as in macs)
    scores: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(
            self.macs + other.macs,
            self.mem + other.mem,
            self.shared_macs + other.shared_macs,
            self.scores + other.scores,
        )

    def batched_macs(self, batch: int) -> int:
        """MACs of ``batch`` sequences. Counting the shared part once per sequence overstated a 262M dense step's
        FLOPs at batch 64 by 11% (its MFU, and every MAC floor beside it)."""
        return batch * self.macs - (batch - 1) * self.shared_macs


def symbols(cfg: ModelConfig) -> tuple[int, int, int, int, int]:
    """The paper's H, d_head, d_model, T and C = 1 + cached chunks."""
    return cfg.n_heads, cfg.d_head, cfg.d_model, cfg.T, 1 + cfg.context_blocks


def layer_inputs(cfg: ModelConfig) -> int:
    """Floats of the layer's inputs kept: the current tokens; the window [memory; current] is a new tensor."""
    _, _, dm, T, C = symbols(cfg)
    return T * dm + (C * T * dm if C > 1 else 0)


def o_input(cfg: ModelConfig) -> int:
    """Floats of the heads' outputs made [T, H d_head]-contiguous for the O projection. With RoPE, SDPA keeps its
    output anyway, and it has this layout already (no copy) with one head and one token, or with one of them when
    SDPA padded no channels that had to be dropped."""
    H, dh, _, T, _ = symbols(cfg)
    laid_out = H * T == 1 or ((H == 1 or T == 1) and sdpa_width(dh) == dh)
    return 0 if cfg.pos == "rope" and laid_out else T * H * dh


def softmax_attention(
    cfg: ModelConfig, n_kv_heads: int, kept_queries: int = 0, position_heads: int | None = None
) -> Cost:
    """H query heads over S keys of ``n_kv_heads`` key heads (each read by its group of query heads, none
    repeated); XL adds projected positions, ``position_heads`` of them (default: one per key head).
    ``kept_queries``: extra [T, H d_head] queries the XL extras keep (the learned scale keeps the unscaled query,
    the global biases a second one)."""
    H, dh, dm, T, C = symbols(cfg)
    S, Hk = C * T, n_kv_heads
    Hp = Hk if position_heads is None else position_heads
    if cfg.pos == "xl":
        D = S if cfg.causal else S + T - 1  # distances 0..S-1, and the negative ones without a causal mask
        positions = D * dm * Hp * dh  # their projection: the same for every sequence of a batch
        macs = 2 * H * T * S * dh + positions + H * T * dh * D  # q k^T and A v, the projection, q r^T
        # sinusoids, projected positions, q, k, the attention map (after softmax), v
        mem = D * dm + D * Hp * dh + T * H * dh + S * Hk * dh + H * T * S + S * Hk * dh
        return Cost(macs, mem + kept_queries * T * H * dh, shared_macs=positions, scores=H * T * S)
    half = int(dh * 0.5) // 2  # rotated channel pairs
    rotation = 2 * (T + S) * half  # cos and sin of the query and key positions
    dp = sdpa_width(dh)  # SDPA runs on heads zero-padded to this width
    # q and k rotated, v and the output (all four padded), its logsumexp, and the boolean mask made additive
    sdpa = T * H * dp + S * Hk * dp + S * Hk * dp + T * H * dp + H * T + (T * S if cfg.causal else 0)
    return Cost(2 * H * T * S * dp, rotation + sdpa, scores=H * T * S)


def printed_xl(H: int, d_head: int, d_model: int, T: int, C: int) -> Cost:
    """SwitchHead paper, appendix A.2, dense Transformer-XL: MACs = H(4 T dh dm + 2 C T^2 dh + 2 C T dh dm),
    mem = H(4 T dh + 2 C T^2 + 2 C T dh)."""
    return Cost(
        H * (4 * T * d_head * d_model + 2 * C * T * T * d_head + 2 * C * T * d_head * d_model),
        H * (4 * T * d_head + 2 * C * T * T + 2 * C * T * d_head),
    )
