"""Attention layers at the 47M shapes on the CPU, forward and backward, for pytest-benchmark's history.

Compare a run with a saved one: tox -e bench -- --benchmark-compare --benchmark-compare-fail=median:10%.
SwitchHead/dense ratios are checked by `switchbench check`, which times the two interleaved in one run.
"""

import pytest
import torch

from switchbench.bench.timing.speed import GATE_LAYERS, layer_benches


@pytest.mark.parametrize("what", ["forward", "forward+backward"])
@pytest.mark.parametrize("preset", GATE_LAYERS)
def test_attention_layer(benchmark, preset, what):
    bench = next(b for b in layer_benches(preset, 4, "cpu", torch.float32) if b.what == what)
    benchmark.group = f"47M attention layer, {what}"
    benchmark.pedantic(bench.run, rounds=10, warmup_rounds=2)
