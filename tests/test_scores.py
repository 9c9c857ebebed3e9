"""The attention-score count (models/cost.py), the work a MAC count leaves out, against the softmaxes the explicit
kernel runs: every family, XL and RoPE, causal or not, with and without cached chunks, one layer and whole models;
and the ratio a speed row and the report put beside the MAC floor."""

import pytest
import torch

from switchbench.bench.cost.accounting import exact_cost, model_scores
from switchbench.bench.cost.measure import layer_and_inputs
from switchbench.bench.timing import speed
from switchbench.models.lm import LanguageModel
from switchbench.models.presets import PRESETS
from switchbench.ops.attention import choice, kernels
from switchbench.reports.summary import _against_floor

TINY = [name for name in PRESETS if name.startswith("tiny-")]


@pytest.fixture
def normalised(monkeypatch) -> list[int]:
    """The elements each explicit softmax of a run normalises, read off the maps it returns."""
    counted, explicit = [], kernels.explicit

    def counting(q, k, v, mask, bias, scale, return_maps):
        out, maps = explicit(q, k, v, mask, bias, scale, True)
        counted.append(maps.numel())
        return out, maps if return_maps else None

    monkeypatch.setattr(kernels, "explicit", counting)
    return counted


# every family over the training window; two chunks of memory and a window without a mask for two of them in the
# fast loop, for all in the full suite
BOTH_WAYS = ("tiny-switchhead", "tiny-moh-rope")
WINDOWS = [
    pytest.param(
        name,
        causal,
        blocks,
        marks=() if (causal, blocks) == (True, 1) or name in BOTH_WAYS else pytest.mark.slow,
    )
    for name in TINY
    for causal, blocks in ((True, 1), (True, 2), (False, 0))
]


@pytest.mark.parametrize(("name", "causal", "blocks"), WINDOWS)
def test_a_layer_normalises_the_scores_it_is_counted(name, causal, blocks, normalised):
    cfg = PRESETS[name].replace(causal=causal, context_blocks=blocks)
    layer, x, mem, window = layer_and_inputs(cfg, batch=3)
    with choice.selected("explicit"), torch.no_grad():
        layer(x, mem, window)
    assert sum(normalised) == 3 * exact_cost(cfg).scores > 0


@pytest.mark.parametrize("name", ["tiny-transformer", "tiny-switchhead", "tiny-moa", "tiny-moh-rope"])
def test_a_model_normalises_the_scores_it_is_counted(name, normalised):
    """Every layer, with the cache a training step carries."""
    cfg = PRESETS[name].replace(dropout=0.0)
    model = LanguageModel(cfg)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.T))
    with choice.selected("explicit"), torch.no_grad():
        state = model(tokens).state
        normalised.clear()
        model(tokens, state)
    assert sum(normalised) == model_scores(cfg, 2)


def test_a_rows_scores_ratio_is_the_models_counted_scores(normalised):
    """A model row's ratio is over whole models (their layer counts may differ: these differ by a layer), a layer
    row's over one layer; a row written before the suite counted scores gets it from its presets."""
    counts = {}
    for name, layers in (("tiny-transformer", 2), ("tiny-switchhead", 3)):
        cfg = PRESETS[name].replace(n_layers=layers, dropout=0.0)
        tokens = torch.randint(0, cfg.vocab, (1, cfg.T))
        model = LanguageModel(cfg)
        with choice.selected("explicit"), torch.no_grad():
            state = model(tokens).state
            normalised.clear()
            model(tokens, state)
        counts[name] = sum(normalised), exact_cost(cfg).scores
    row = {
        "preset": "tiny-switchhead:n_layers=3",
        "baseline": "tiny-transformer:n_layers=2",
        "scope": "model",
    }
    assert speed.scores_ratio(row) == pytest.approx(
        counts["tiny-switchhead"][0] / counts["tiny-transformer"][0]
    )
    row["scope"] = "layer"
    assert speed.scores_ratio(row) == pytest.approx(
        counts["tiny-switchhead"][1] / counts["tiny-transformer"][1]
    )
    assert speed.scores_ratio(row | {"ratio_scores": 0.3}) == 0.3  # as written
    assert speed.scores_ratio({"preset": "tiny-switchhead", "scope": "model"}) is None  # no baseline
    assert speed.scores_ratio(row | {"baseline": "no-such-preset"}) is None
    # rows the report may read from older runs: overrides this code no longer takes, a baseline read as NaN
    assert speed.scores_ratio(row | {"preset": "tiny-switchhead:no_such_field=1"}) is None
    assert speed.scores_ratio(row | {"baseline": float("nan")}) is None


def test_the_summary_puts_the_scores_beside_the_floor():
    row = {
        "preset": "c4-262m-switchhead-h4",
        "baseline": "c4-262m-transformer-h16",
        "scope": "model",
        "ratio_time": 0.748,
        "ratio_macs": 0.796,
        "time_over_floor": 0.94,
    }
    # 262M: 4 heads against 16, the same window and layers
    assert _against_floor(row) == "0.75 (MAC floor 0.80: 0.940x it; scores 0.25)"
