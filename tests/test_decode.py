"""Decoding with a KV cache: from an empty cache, token by token or chunk by chunk, every family gives the logits
of one forward pass over the whole sequence, with XL and RoPE positions; the cache holds what the family declares."""

import pytest
import torch
from small import SEQ, TIGHT, WINDOWS, T, make_lm, random_tokens, small_cfg

from switchbench.models import family as registry
from switchbench.models.layers.kv_cache import INPUTS, CacheEntry, KVCache, elements_per_token
from switchbench.models.lm import LanguageModel
from switchbench.models.presets import PRESETS

FAMILIES = [f.name for f in registry.families() if f.kv_cache is not None]
PIECES = {"token by token": [1] * SEQ, "uneven": [5, 1, T, 2, 3], "straddling": [T - 1, T + 1, 3]}


def decode_pieces(
    lm: LanguageModel, tokens: torch.Tensor, sizes, cache: KVCache | None = None
) -> torch.Tensor:
    cache = cache or lm.new_cache(tokens.shape[0], tokens.shape[1])
    logits, start = [], 0
    with torch.no_grad():
        for n in sizes:
            logits.append(lm.decode(tokens[:, start : start + n], cache))
            start += n
    assert cache.length == tokens.shape[1]
    return torch.cat(logits, dim=1)


def full_forward(lm: LanguageModel, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return lm(tokens).logits


def test_every_built_in_family_decodes():
    assert set(FAMILIES) == set(registry.names())


@pytest.mark.parametrize(("pos", "context_blocks"), WINDOWS)
@pytest.mark.parametrize("model", FAMILIES)
def test_decoding_gives_the_full_forward_float64(model, pos, context_blocks):
    """Any split, from an empty cache, gives one forward pass's logits to 1e-10 in float64: the positions (RoPE's
    absolute, XL's relative, the chunked window of XL memory) are right at every step."""
    cfg = small_cfg(model, pos, context_blocks=context_blocks)
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, SEQ)
    reference = full_forward(lm, tokens)
    for name, sizes in PIECES.items():
        torch.testing.assert_close(
            decode_pieces(lm, tokens, sizes), reference, **TIGHT, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_a_cache_of_layer_inputs_decodes_too(model, pos):
    """Transformer-XL's way, open to any family: the layers' inputs cached and re-projected at every step."""
    cfg = small_cfg(model, pos)
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, SEQ)
    cache = KVCache(
        (CacheEntry(INPUTS, 1, cfg.d_model, "layer inputs"),), cfg.n_layers, 2, SEQ, "cpu", torch.float64
    )
    torch.testing.assert_close(
        decode_pieces(lm, tokens, PIECES["uneven"], cache), full_forward(lm, tokens), **TIGHT
    )


TINY = sorted({p for f in registry.families() for role in ("tiny", "tiny-rope") if (p := f.roles.get(role))})


@pytest.mark.parametrize(  # beyond dense and SwitchHead, a family sweep's cases are slow (docs/layout.md)
    "preset",
    [
        p
        if p.startswith(("tiny-transformer", "tiny-switchhead"))
        else pytest.param(p, marks=pytest.mark.slow)
        for p in TINY
    ],
)
def test_tiny_presets_decode_within_1e4_in_float32(preset):
    """The presets `decode` times, in float32, token by token over two chunks: within 1e-4 of the forward pass."""
    cfg = PRESETS[preset].replace(T=32)
    torch.manual_seed(0)
    lm = LanguageModel(cfg).eval()
    tokens = random_tokens(cfg, 2 * cfg.T + 5)
    got = decode_pieces(lm, tokens, [1] * tokens.shape[1])
    assert (got - full_forward(lm, tokens)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("model", FAMILIES)
def test_the_cache_holds_what_the_family_declares(model):
    cfg = small_cfg(model)
    lm = make_lm(cfg).float()
    cache = lm.new_cache(3, 20)
    entries = cfg.family.kv_cache(cfg)
    assert cache.nbytes == 3 * 20 * 4 * elements_per_token(entries, cfg.n_layers)
    assert [b.shape for b in cache.layers[0]] == [(3, e.heads, 20, e.width) for e in entries]


def per_token(preset: str) -> int:
    cfg = PRESETS[preset]
    return elements_per_token(cfg.family.kv_cache(cfg), cfg.n_layers)


def test_cache_sizes_by_family():
    """GQA keeps fewer heads than dense; SwitchHead keeps K and V of its H heads (2 H d_head per layer, values after
    the expert mix); MoA one shared K and V head, as MQA; MoH every head, as dense."""
    dense = per_token("c4-47m-transformer-h10")
    assert per_token("c4-47m-gqa-h10-kv2") == dense // 5
    assert per_token("c4-47m-mqa-h10") == dense // 10
    assert per_token("c4-47m-moh-h10") == dense
    sh = PRESETS["c4-47m-switchhead-h2"]
    assert per_token("c4-47m-switchhead-h2") == 2 * sh.n_heads * sh.d_head * sh.n_layers
    moa = PRESETS["wikitext103-47m-moa-h4"]
    assert per_token("wikitext103-47m-moa-h4") == 2 * moa.d_head * moa.n_layers


def test_a_family_without_a_declaration_has_no_decode_path():
    import dataclasses

    cfg = small_cfg("transformer")
    lm = make_lm(cfg)
    family = dataclasses.replace(cfg.family, kv_cache=None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(registry._REGISTRY, "transformer", family)
        with pytest.raises(ValueError, match="no decode path"):
            lm.new_cache(1, 4)


def test_a_full_cache_says_so():
    cfg = small_cfg("transformer")
    lm = make_lm(cfg)
    cache = lm.new_cache(1, 4)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        lm.decode(random_tokens(cfg, 5, batch=1), cache)


@pytest.mark.parametrize("model", ["transformer", "switchhead"])
def test_rewinding_the_cache_decodes_the_same_token_again(model):
    """Back to any length after decoding past it, the next token's logits are the forward pass's: the window's start
    follows the length both ways (a benchmark rewinds to time one step again)."""
    cfg = small_cfg(model, "xl", context_blocks=1)
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, SEQ)
    reference = full_forward(lm, tokens)
    cache = lm.new_cache(2, SEQ)
    with torch.no_grad():
        lm.decode(tokens[:, : SEQ - 1], cache)
        for length in (T - 2, T + 3, 2 * T - 1):
            cache.rewind(length)
            got = lm.decode(tokens[:, length : length + 1], cache)
            torch.testing.assert_close(got[:, 0], reference[:, length], **TIGHT)


@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_bf16_weights_decode_with_experts_on_every_projection(pos):
    """Q, K, V and O experts gate in float32 while the weights and the cache are bf16: the decode runs, near the
    float64 forward pass."""
    cfg = small_cfg("switchhead", pos, experts="qkvo")
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, SEQ)
    reference = full_forward(lm, tokens)
    got = decode_pieces(lm.bfloat16(), tokens, [5, *[1] * (SEQ - 5)])
    assert got.dtype == torch.bfloat16
    error = (got.double() - reference).abs()
    assert (
        error.median().item() < 0.02 and error.max().item() < 0.5
    )  # bf16 rounding; a near-tie may pick another expert
