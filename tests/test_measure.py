"""The exact analytic count equals three independent measurements on the real modules."""

import json
import sys

import pytest
import torch

pytest.importorskip("hypothesis")  # a GPU node without it skips this module, naming it
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from naive import assert_counted_exactly
from optional import needs

from switchbench.bench.cost import measure, tables
from switchbench.bench.cost.accounting import exact_cost, paper_cost
from switchbench.cli import main
from switchbench.models.config import ModelConfig
from switchbench.models.presets import PRESETS


@st.composite
def configs(draw):
    model = draw(st.sampled_from(["transformer", "switchhead", "moa", "switchall"]))
    causal = draw(st.booleans())
    E = draw(st.integers(1, 5))
    H = draw(st.integers(1, E if model == "moa" else 4))
    return ModelConfig(
        model=model,
        pos=draw(st.sampled_from(["xl", "rope"])),
        causal=causal,
        context_blocks=draw(st.integers(0, 2)) if causal else 0,
        d_model=draw(st.integers(4, 24)),
        n_heads=H,
        d_head=draw(st.integers(1, 9)),
        T=draw(st.integers(1, 7)),
        n_experts=E,
        k=draw(st.integers(1, E)),
        experts="".join(draw(st.lists(st.sampled_from("qkvo"), min_size=1, max_size=4, unique=True))),
        shared_selection=draw(st.booleans()),
        moa_gating=draw(st.sampled_from(["softmax", "sigmoid"])),
        xl_bias_and_scale=draw(st.booleans()),
        n_layers=2,
        mlp_experts=4,
        mlp_k=2,
    )


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_exact_count_equals_fvcore_flop_counter_and_saved_floats(cfg):
    assert_counted_exactly(cfg)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "c4-262m-switchhead-h4",
        "c4-262m-transformer-h16",
        "wikitext103-244m-transformer-h16",
        "wikitext103-47m-moa-h8",
    ],
)
@needs("fvcore")
def test_exact_count_at_published_sizes(name):
    views = measure.cost_views(PRESETS[name])
    assert views["macs_exact"] == views["macs_fvcore"] == views["macs_flop_counter"]
    assert views["mem_exact"] == views["mem_saved_floats"]


@needs("fvcore")
def test_switchhead_memory_does_not_grow_with_k():
    """The expert matmul keeps no per-expert copy: only its MACs grow with k."""
    cfg = PRESETS["c4-47m-switchhead-h2"].replace(T=32, experts="qkvo")
    floats = {k: measure.saved_floats(cfg.replace(k=k)) for k in range(1, cfg.n_experts + 1)}
    macs = {k: measure.fvcore_macs(cfg.replace(k=k)) for k in (1, 2)}
    assert len(set(floats.values())) == 1, floats
    assert macs[2] > macs[1]


def test_dense_xl_gap_to_the_paper_convention_term_by_term():
    """Ours recomputes K and V of the memory, projects the C T distances once and multiplies q by them; the
    convention counts K and V of T tokens and 2 C T d_head d_model for the positions, per head."""
    cfg = PRESETS["c4-262m-transformer-h16"]
    H, dh, dm, T, C = cfg.n_heads, cfg.d_head, cfg.d_model, cfg.T, 2
    S = C * T
    gap = exact_cost(cfg).macs - paper_cost(cfg).macs
    assert gap == 2 * (S - T) * dm * H * dh + C * H * T * T * dh - C * T * dm * H * dh


@needs("fvcore")
def test_an_op_without_a_mac_count_is_an_error(monkeypatch):
    monkeypatch.setattr(measure, "NO_MACS", set())
    with pytest.raises(RuntimeError, match="fvcore has no MAC count for aten::"):
        measure.fvcore_macs(PRESETS["tiny-switchhead"])


@pytest.mark.slow
@needs("fvcore")
def test_cli_count(capsys):
    assert main(["count", "c4-262m-switchhead-h4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["preset"] for r in out["published"]} == {"c4-262m-switchhead-h4", "pes2o-262m-switchhead-h4"}
    assert out["macs_paper"] == 2_358_116_352 and out["mem_paper"] == 5_578_752
    assert out["macs_exact"] == out["macs_fvcore"] == out["macs_flop_counter"]


@pytest.fixture
def without_fvcore(monkeypatch):
    """A node without fvcore: every import of it fails with ModuleNotFoundError, as when it is not installed
    (None in sys.modules halts the import, also of a submodule imported earlier in this process)."""
    for name in ["fvcore"] + [n for n in sys.modules if n.startswith("fvcore.")]:
        monkeypatch.setitem(sys.modules, name, None)
    measure.cost_views.cache_clear()
    yield
    measure.cost_views.cache_clear()


def test_without_fvcore_count_says_so_and_the_other_counters_count(without_fvcore, capsys):
    assert main(["count", "tiny-switchhead", "--json"]) == 0
    views = json.loads(capsys.readouterr().out)
    assert views["macs_fvcore"] == "fvcore not installed"
    assert (
        views["macs_exact"] == views["macs_flop_counter"] and views["mem_exact"] == views["mem_saved_floats"]
    )
    assert main(["count", "tiny-switchhead"]) == 0
    assert "fvcore not installed" in capsys.readouterr().out


def test_without_fvcore_the_tables_compare_what_was_measured_and_name_the_missing_counter(without_fvcore):
    views = measure.cost_views(PRESETS["tiny-switchhead"])
    assert views["macs_fvcore"] == "fvcore not installed"
    assert tables.measured_agree(views) == "yes, without fvcore"
    assert (
        tables.measured_agree(views | {"macs_flop_counter": views["macs_exact"] + 1}) == "NO, without fvcore"
    )
    assert (
        tables.measured_agree(views | {"macs_flop_counter": "OOM", "mem_saved_floats": "OOM"})
        == "not measured"
    )


def test_the_agreement_of_a_full_measurement():
    views = {"macs_exact": 7, "macs_fvcore": 7, "macs_flop_counter": 7, "mem_exact": 3, "mem_saved_floats": 3}
    assert tables.measured_agree(views) == "yes"
    assert tables.measured_agree(views | {"macs_fvcore": 8}) == "NO"
    assert tables.measured_agree(views | {"mem_saved_floats": "OOM"}) == "yes, without saved-tensor hooks"


def test_free_gpu_memory_counts_what_the_allocator_caches_unused(monkeypatch):
    """The estimate that turns a case away compares with the free memory after the cache is given back: blocks a
    member's freed warm-up left in the cache are free for the next member's allocations."""
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: calls.append("mem_get_info") or (7, 10))
    assert measure.free_memory("cuda") == 7 and calls == ["empty_cache", "mem_get_info"]


def test_a_layer_past_the_free_memory_is_not_built_for_counting(monkeypatch, capsys):
    """`count` of a layer larger than the machine: on Linux its allocation is not an error but the OOM killer (a
    1,000-head SwitchHead at d_model 100,000 grew to 12.8 GiB before it was stopped). Its lower bound, the real
    layer's weights and the floats it saves, is compared with the free memory first; past it, the measured views
    say OOM and nothing is built. The analytic counts stand."""
    cfg = PRESETS["tiny-switchhead"].replace(n_heads=3)  # a configuration no earlier count has cached
    weights = sum(p.numel() for p in cfg.family.attention(cfg).parameters())
    assert measure.layer_bytes_lower_bound(cfg) == 4 * (weights + measure.saved_floats(cfg))

    def built(cfg):
        raise AssertionError("a measurement was started")

    for counter in ("fvcore_macs", "flop_counter_macs", "saved_floats"):
        monkeypatch.setattr(measure, counter, built)
    monkeypatch.setattr(measure, "free_memory", lambda device: measure.layer_bytes_lower_bound(cfg) - 1)
    assert main(["count", "tiny-switchhead", "--n-heads", "3", "--json"]) == 0
    views = json.loads(capsys.readouterr().out)
    assert views["macs_flop_counter"] == views["mem_saved_floats"] == "OOM"
    assert views["macs_exact"] == exact_cost(cfg).macs
