"""Which implementation an expert matmul runs on: named choices, the environment, auto's measured table and its
fallback, and the record of what each call resolved to."""

import json

import pytest
import torch

from switchbench.core.choice import traced_once
from switchbench.models.config import ModelConfig
from switchbench.models.families.switchhead import SwitchHeadAttention
from switchbench.models.layers.window import make_window
from switchbench.ops.attention import choice as attention_choice
from switchbench.ops.expert_matmul import choice
from switchbench.ops.expert_matmul import op as expert_matmul_op
from switchbench.ops.expert_matmul.cases import CASES, float64_inputs, reference
from switchbench.ops.expert_matmul.op import route

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)
H100 = "NVIDIA H100 80GB HBM3"


def _bucket(dtype: torch.dtype) -> str:
    """The 262M SwitchHead value projection's bucket at batch 64, as the op makes it."""
    return choice.shape_bucket(65536, 1024, 112, dtype, True, 8, 16)


BF16 = _bucket(torch.bfloat16)


@pytest.fixture
def table(monkeypatch):
    """A measured table for an H100, and this process's GPU named so."""
    tables = ({"device": H100, "choices": {BF16: "grouped_mm"}},)
    monkeypatch.setattr(choice, "auto_tables", lambda: tables)
    monkeypatch.setattr(choice, "device_name", lambda device: H100 if device.type == "cuda" else "x86_64")


def test_shape_buckets():
    bucket = choice.shape_bucket(40000, 1024, 112, torch.bfloat16, True, 8, 16)
    assert bucket == "65536x1024x112 8of16 bfloat16 gates"
    assert choice.shape_bucket(1, 24, 20, torch.float32, False, 1, 4) == "1x24x20 1of4 float32"
    assert choice.shape_bucket(10**9, 8, 8, torch.float16, False, 2, 2) == "262144x8x8 2of2 float16"  # capped
    # MoA's 8 and 12 of 16 experts: computing every expert costs 2 and 1.33 times the routed MACs
    assert choice.shape_bucket(40000, 1024, 146, torch.bfloat16, False, 12, 16) != choice.shape_bucket(
        40000, 1024, 146, torch.bfloat16, False, 8, 16
    )
    # torch.jit.trace hands sizes over as tensors
    traced = choice.shape_bucket(torch.tensor(256), 64, 16, torch.float32, True, 2, 4)
    assert traced == choice.TRACED and choice.lookup(CPU, traced, "auto").reason == "fallback"


def test_auto_takes_the_measured_fastest_where_device_and_bucket_match(table):
    assert choice.lookup(GPU, BF16, "auto") == choice.Resolution("grouped_mm", "measured")
    fallback = choice.lookup(GPU, _bucket(torch.float32), "auto")  # another dtype: no entry
    assert fallback == choice.Resolution("triton", "fallback") and "fell back" in fallback.describe()
    # float64 (the exact checks, on a GPU too) is not Triton's: an H200 refused 51 tests' calls
    assert choice.lookup(GPU, _bucket(torch.float64), "auto") == choice.Resolution("torch", "fallback")
    assert choice.lookup(CPU, BF16, "auto") == choice.Resolution("torch", "fallback")
    assert choice.measured_entries(GPU) == 1 and choice.measured_entries(CPU) == 0


def test_precedence_named_then_environment_then_auto(table, monkeypatch):
    bucket = BF16
    monkeypatch.delenv(choice.ENV_IMPL, raising=False)
    assert choice.choice() == "auto" and choice.resolve(GPU, bucket) == "grouped_mm"
    monkeypatch.setenv(choice.ENV_IMPL, "torch")
    assert choice.resolve(GPU, bucket) == "torch"
    with choice.selected("triton"):
        assert choice.resolve(GPU, bucket) == "triton"
        with choice.selected(None):  # nothing chosen: as it was
            assert choice.choice() == "triton"
        assert choice.resolve(GPU, bucket, "auto") == "grouped_mm"  # an explicit impl= wins
    assert choice.choice() == "torch"
    monkeypatch.setenv(choice.ENV_IMPL, "cublas")
    with pytest.raises(
        ValueError, match="must be one of auto, torch, triton, grouped_mm, all_experts; got 'cublas'"
    ):
        choice.choice()
    with pytest.raises(ValueError, match="got 'fastest'"):
        choice.selected("fastest").__enter__()


def test_every_resolution_is_recorded_under_its_choice(table):
    with choice.selected("auto"):
        with choice.recording() as inner:
            choice.resolve(GPU, BF16)
        choice.resolve(CPU, "8x4x4 float32")
        seen = choice.resolutions()
    assert inner == {f"{H100} | {BF16}": choice.Resolution("grouped_mm", "measured")}
    assert seen == inner | {"x86_64 | 8x4x4 float32": choice.Resolution("torch", "fallback")}
    assert choice.resolutions() == {}  # outside any choice


def test_a_layer_runs_on_the_choice_in_force():
    cfg = ModelConfig(model="switchhead", d_model=24, n_layers=2, n_heads=2, d_head=8, n_experts=3, k=2, T=6)
    layer = SwitchHeadAttention(cfg)
    x, mem, window = torch.randn(2, 6, 24), torch.randn(2, 6, 24), make_window(6, 6, 6, 6, 1, True, "cpu")
    outputs = {}
    for impl in ("torch", "grouped_mm"):
        with choice.selected(impl), choice.recording() as log:
            outputs[impl] = layer(x, mem, window)[0]
        assert {r.impl for r in log.values()} == {impl} and len(log) == 2  # V and O, two shapes
    torch.testing.assert_close(outputs["grouped_mm"], outputs["torch"], rtol=1e-5, atol=1e-6)


def test_a_table_choosing_an_implementation_the_op_lacks_fails_as_it_loads(tmp_path, monkeypatch):
    """The shipped table (empty until a GPU tunes it) is checked as auto_tables() loads it."""
    bucket = choice.shape_bucket(65536, 1024, 112, torch.bfloat16, True, 8, 16)
    good = [{"device": "NVIDIA H200", "choices": {bucket: "all_experts"}}]
    bad = [*good, {"device": H100, "choices": {bucket: "cutlass"}}]
    monkeypatch.setattr(choice, "SHIPPED", tmp_path / choice.AUTO_FILE)
    try:
        (tmp_path / choice.AUTO_FILE).write_text(json.dumps({"tables": good}))
        choice.auto_tables.cache_clear()
        assert choice.auto_tables() == tuple(good)
        (tmp_path / choice.AUTO_FILE).write_text(json.dumps({"tables": bad}))
        choice.auto_tables.cache_clear()
        with pytest.raises(ValueError, match=f"{H100} chooses cutlass; each choice is one of torch, "):
            choice.auto_tables()
    finally:
        choice.auto_tables.cache_clear()  # the next call reads the shipped table again


def test_a_resolution_is_marked_as_torch_compilers_assume_constant_result_marks_it():
    """traced_once marks without importing Dynamo; the marking must stay the one torch.compile reads."""

    def one():
        return "torch"

    def other():
        return "torch"

    assert vars(traced_once(one)) == vars(torch.compiler.assume_constant_result(other)) != {}
    assert vars(choice.resolve) == vars(attention_choice.resolve) == vars(one)


CPU_IMPLS = [impl for impl in choice.IMPLS if impl != "triton" and not expert_matmul_op.unavailable(impl)]


@pytest.mark.parametrize(
    "case", ["single-token", "switchhead-o", "sigma-moe-up"]
)  # gathered and padded paths
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_bf16_inputs_with_float32_scores_run_both_ways_in_the_dtypes_the_fakes_say(impl, case):
    """A model served in bf16 without autocast gates with float32 scores: the PyTorch paths returned float32
    where the op's fake (what torch.compile plans with) and Triton's kernels say bf16, and all_experts failed
    (scatter of float32 rows into a bf16 buffer). Every one: bf16, within bf16's rounding of the float64 loop."""
    x, weight, indices, scores, grad_out = float64_inputs(CASES[case])
    s_out = CASES[case].out_groups
    leaves = [t.detach().requires_grad_() for t in (x.bfloat16(), weight.bfloat16(), scores.float())]
    y = expert_matmul_op.expert_matmul(
        *leaves[:2], route(indices, weight.shape[0]), leaves[2], s_out, impl=impl
    )
    assert y.dtype == torch.bfloat16
    y.backward(grad_out.bfloat16())  # and the backward, which failed on the PyTorch and grouped paths
    exact = [t.detach().requires_grad_() for t in (x, weight, scores)]
    want = reference(*exact[:2], indices, exact[2], s_out)
    want.backward(grad_out)
    for got, expected in zip((y, *(t.grad for t in leaves)), (want, *(t.grad for t in exact)), strict=True):
        scale = expected.abs().max()
        torch.testing.assert_close(got.double() / scale, expected.detach() / scale, rtol=0, atol=3e-2)
    assert [t.grad.dtype for t in leaves] == [torch.bfloat16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_no_tokens_give_an_empty_output_and_gradients(impl):
    """The PyTorch path's sum over each group's slots could not size a view of no tokens (a RuntimeError)."""
    weight = torch.randn(4, 5, 9, requires_grad=True)
    x = torch.randn(0, 1, 5, requires_grad=True)
    indices = torch.zeros(0, 2, dtype=torch.long)
    y = expert_matmul_op.expert_matmul(x, weight, route(indices, 4), None, 2, impl=impl)
    assert y.shape == (0, 2, 9)
    y.sum().backward()
    assert x.grad.shape == (0, 1, 5) and torch.equal(weight.grad, torch.zeros_like(weight))
