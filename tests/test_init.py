"""The authors' initialisation at the published shapes: std = sqrt(2/L)/sqrt(fan_in) for every projection,
expert and router, with the fan-ins the authors use, and the row norms of the routers."""

import math

import pytest
import torch

from switchbench.models.config import ModelConfig
from switchbench.models.lm import Block, LanguageModel
from switchbench.models.presets import PRESETS

# One block of each family at the 47M and 262M shapes (a 262M block is about 14M weights: quick on a CPU).
PUBLISHED_BLOCKS = [
    "wikitext103-47m-transformer-h10",
    "wikitext103-47m-switchhead-h2",
    "wikitext103-47m-moa-h4",
    "wikitext103-47m-switchall-h2",
    "wikitext103-262m-transformer-h16",
    "c4-262m-switchhead-h4",
    "wikitext103-262m-moa-h8",
    "c4-262m-switchall-h4",
]


def authors_std(fan_in: int, n_layers: int) -> float:
    return math.sqrt(2.0 / n_layers) / math.sqrt(fan_in)


def assert_init(weight: torch.Tensor, expected_std: float, what: str, tolerance: float = 0.1) -> None:
    """Finite, zero-mean normal with the expected std (relative ``tolerance``)."""
    w = weight.detach().double().flatten()
    assert torch.isfinite(w).all(), what
    std = w.std().item()
    assert abs(std / expected_std - 1) < tolerance, f"{what}: std {std:.4g}, expected {expected_std:.4g}"
    assert abs(w.mean().item()) < 0.1 * expected_std, what
    # A normal's kurtosis is 3; a uniform (nn.Linear's default) has 1.8.
    kurtosis = (((w - w.mean()) / w.std()) ** 4).mean().item()
    assert abs(kurtosis - 3) < 0.4, f"{what}: kurtosis {kurtosis:.3g}"


def projections(cfg: ModelConfig, block) -> list[tuple[str, torch.Tensor, int]]:
    """(name, weight, fan_in) of every projection and router of a block, fan_in as the authors define it: the
    attention output H d_head, the dense MLP output d_ff, the sigma-MoE output experts N_E G, all else d_model."""
    d, hd, attn, mlp = cfg.d_model, cfg.n_heads * cfg.d_head, block.attn, block.mlp
    if cfg.attention == "dense":
        found = [("q", attn.q.weight, d), ("k", attn.k.weight, d), ("v", attn.v.weight, d)]
        found.append(("o", attn.o.weight, hd))
    elif cfg.attention == "switchhead":
        found = [("q", attn.q.weight, d), ("k", attn.k.weight, d), ("v", attn.v, d), ("o", attn.o, hd)]
    else:
        found = [("k", attn.k.weight, d), ("v", attn.v.weight, d), ("q", attn.q_experts, d)]
        found.append(("o", attn.o_experts, hd))
    if cfg.pos == "xl":
        found.append(("pos", attn.attention.pos_proj.weight, d))
    if cfg.mlp == "dense":
        found += [("up", mlp.up.weight, d), ("down", mlp.down.weight, cfg.d_ff)]
    else:
        found += [("up", mlp.up, d), ("down", mlp.down, cfg.mlp_experts * cfg.mlp_expert_size)]
    return found + [(name, weight, d) for name, weight in routers(block)]


def routers(block) -> list[tuple[str, torch.Tensor]]:
    found = [(name, getattr(block.attn, name, None)) for name in ("src_router", "dst_router", "router")]
    found.append(("mlp_router", getattr(block.mlp, "router", None)))
    return [(name, r.weight) for name, r in found if r is not None]


def _block(name: str) -> tuple[ModelConfig, Block]:
    cfg = PRESETS[name]
    torch.manual_seed(0)
    return cfg, Block(cfg)


@pytest.mark.parametrize(  # every family at 47M in the fast loop; the 262M blocks take a second each
    "name", [pytest.param(n, marks=pytest.mark.slow) if "-262m-" in n else n for n in PUBLISHED_BLOCKS]
)
def test_initial_std_follows_the_authors_formula(name):
    """Within 3% of sqrt(2/L)/sqrt(fan_in) (about 3 standard errors for the smallest router); the sigma-MoE output
    experts at the 47M SwitchAll shapes: sqrt(2/16)/sqrt(16 * 128) = 0.0078."""
    cfg, block = _block(name)
    found = projections(cfg, block)
    n_routers = {"dense": 0, "switchhead": 2, "moa": 1}[cfg.attention] + (cfg.mlp != "dense")
    assert len(routers(block)) == n_routers
    for what, weight, fan_in in found:
        assert_init(weight, authors_std(fan_in, cfg.n_layers), f"{name} {what}", tolerance=0.03)
    if name == "wikitext103-47m-switchall-h2":
        assert authors_std(dict((w, f) for w, _, f in found)["down"], cfg.n_layers) == pytest.approx(
            0.0078, abs=5e-5
        )


@pytest.mark.parametrize("name", [n for n in PUBLISHED_BLOCKS if "transformer" not in n])
def test_router_row_norms(name):
    """Attention routers keep the spread of a normal draw's row norms, a coefficient of variation of about
    1/sqrt(2 d_model) (0.035 at 47M, 0.022 at 262M); only the sigma-MoE router's rows share one norm."""
    cfg, block = _block(name)
    attention = [w for n, w in routers(block) if n != "mlp_router"]
    norms = torch.cat([w.detach().double().norm(dim=-1) for w in attention])
    cv = (norms.std() / norms.mean()).item()
    expected = 1 / math.sqrt(2 * cfg.d_model)
    assert 0.5 * expected < cv < 1.6 * expected, f"CV {cv:.4f}, expected about {expected:.4f}"
    if cfg.mlp == "sigma_moe":
        mlp_norms = block.mlp.router.weight.detach().double().norm(dim=-1)
        assert (mlp_norms.std() / mlp_norms.mean()).item() < 1e-6


@pytest.mark.parametrize("model", ["transformer", "switchhead", "moa", "switchall"])
def test_xl_positional_projection_initialised(model):
    """Every layer's XL position projection is initialised like the other projections (fan_in d_model)."""
    cfg = ModelConfig(model=model, d_model=256, n_layers=2, n_heads=4, d_head=48, n_experts=4, vocab=64)
    torch.manual_seed(0)
    lm = LanguageModel(cfg)
    for i, block in enumerate(lm.stack.blocks):
        weight = block.attn.attention.pos_proj.weight
        heads = 1 if model == "moa" else cfg.n_heads
        assert weight.shape == (heads * cfg.d_head, cfg.d_model)
        # sqrt(2 / L) = 1 sets the expected std well apart from nn.Linear's default of 1/sqrt(3 fan_in)
        assert_init(weight, authors_std(cfg.d_model, 2), f"layer {i} pos_proj")


def test_xl_biases_and_scale_start_neutral():
    """u and v start at zero and the learned logit scale at 1/sqrt(d_head): the initial logits are plain XL's."""
    cfg = PRESETS["wikitext103-47m-transformer-h10"]
    attention = Block(cfg).attn.attention
    assert attention.content_bias.shape == attention.position_bias.shape == (cfg.n_heads, cfg.d_head)
    assert not attention.content_bias.any() and not attention.position_bias.any()
    assert attention.logit_scale.item() == pytest.approx(1 / math.sqrt(cfg.d_head), rel=1e-7)
