"""The Triton expert matmul against the PyTorch path and a float64 loop: forward and every gradient.

Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py), so the shapes stay small.
"""

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import naive

from switchbench.ops import tuned as tuning
from switchbench.ops.expert_matmul.cases import CASES, Case, float64_inputs, reference
from switchbench.ops.expert_matmul.op import expert_matmul, route

CUDA = torch.cuda.is_available()
# The Triton path runs where it stands: compiled on a GPU, in the interpreter on CPU tensors otherwise.
TRITON_DEVICE = "cuda" if CUDA else "cpu"
NAMES = naive.NAMES


def run(impl, x, weight, indices, scores, s_out, grad_out):
    """Output and gradients of one implementation (Triton on TRITON_DEVICE), as float64 CPU tensors."""
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    return naive.outputs(impl, x, weight, indices, scores, s_out, grad_out, device)


# The fast loop keeps one case of the interpreter; the rest run in the full suite.
FAST_CASES = ("single-token",)


@pytest.mark.parametrize("gated", [True, False], ids=["gates", "no-gates"])
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if c in FAST_CASES else pytest.mark.slow) for c in CASES]
)
def test_triton_matches_float64_and_torch_path(case, gated):
    s_out = CASES[case].out_groups
    x, weight, indices, scores, grad_out = float64_inputs(CASES[case])
    scores = scores if gated else None
    exact = run("torch", x, weight, indices, scores, s_out, grad_out)  # the PyTorch path in float64
    y_loop = reference(x, weight, indices, scores, s_out)
    torch.testing.assert_close(exact[0], y_loop, rtol=1e-12, atol=1e-12)
    f32 = [t.float() for t in (x, weight)] + [None if scores is None else scores.float()]
    triton_out = run("triton", f32[0], f32[1], indices, f32[2], s_out, grad_out)
    torch_out = run("torch", f32[0], f32[1], indices, f32[2], s_out, grad_out)
    for what, got, ref, ref32 in zip(NAMES[: len(exact)], triton_out, exact, torch_out, strict=True):
        scale = ref.abs().max().clamp(min=1)
        torch.testing.assert_close(
            got / scale, ref / scale, rtol=0, atol=2e-6, msg=lambda m, w=what: f"{w}: {m}"
        )
        torch.testing.assert_close(got / scale, ref32 / scale, rtol=0, atol=2e-6)


@pytest.mark.slow
def test_experts_without_tokens_get_zero_weight_gradient():
    x, weight, indices, scores, grad_out = float64_inputs(CASES["empty-experts"])
    _, _, grad_w, _ = run("triton", x.float(), weight.float(), indices, scores.float(), 1, grad_out)
    unused = sorted(set(range(weight.shape[0])) - set(indices.flatten().tolist()))
    assert unused and grad_w[unused].abs().max() == 0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["switchhead-o", "k-1", "moa-q"])
def test_deterministic_and_every_element_written(case):
    """Two runs agree bit for bit, and no element is left unwritten: under deterministic mode torch fills every
    new tensor with NaN first, so an element a kernel skipped (a padded column, a slot) stays NaN."""
    x, weight, indices, scores, grad_out = float64_inputs(CASES[case], seed=3)
    args = (x.float(), weight.float(), indices, scores.float(), CASES[case].out_groups, grad_out)
    exact = run("torch", x, weight, indices, scores, CASES[case].out_groups, grad_out)
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.empty(3).isnan().all()  # the poisoning is on
        first, second = run("triton", *args), run("triton", *args)
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b, ref in zip(first, second, exact, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, ref, rtol=0, atol=2e-5 * ref.abs().max().item())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["switchhead-v", "empty-experts"])  # padded widths, and 16-wide ones
def test_non_contiguous_inputs_and_scores(case):
    """Scores, x and weight read through their strides: a transposed scores view gives the same gates."""
    x, weight, indices, scores, grad_out = float64_inputs(CASES[case], seed=7)
    s_out = CASES[case].out_groups
    exact = run("torch", x, weight, indices, scores, s_out, grad_out)
    scores_t = scores.float().t().contiguous().t()  # [N, E] with strides (1, N)
    x_nc = torch.stack([x, x], -1).float()[..., 0]  # feature stride 2
    weight_nc = weight.float().transpose(1, 2).contiguous().transpose(1, 2)
    assert not (scores_t.is_contiguous() or x_nc.is_contiguous() or weight_nc.is_contiguous())
    got = run("triton", x_nc, weight_nc, indices, scores_t, s_out, grad_out)
    for what, a, ref in zip(NAMES, got, exact, strict=True):
        scale = ref.abs().max().clamp(min=1)
        torch.testing.assert_close(
            a / scale, ref / scale, rtol=0, atol=2e-6, msg=lambda m, w=what: f"{w}: {m}"
        )


@pytest.mark.slow
def test_fp16_inputs_accumulate_in_fp32():
    x, weight, indices, scores, grad_out = float64_inputs(CASES["sigma-moe-down"], seed=5)
    half = [t.half() for t in (x, weight, scores)]
    got = run("triton", half[0], half[1], indices, half[2], 1, grad_out)
    exact = run("torch", *[t.double() for t in half[:2]], indices, half[2].double(), 1, grad_out)
    for a, b in zip(got, exact, strict=True):
        scale = b.abs().max().clamp(min=1)
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=2e-3)


def test_triton_rejects_float64():
    x, weight, indices, scores, _ = float64_inputs(CASES["k-1"])
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        expert_matmul(x, weight, route(indices, 3), scores, 2, impl="triton")


@pytest.mark.skipif(CUDA, reason="Triton's interpreter alone multiplies bf16 wrongly")
def test_triton_refuses_bf16_in_its_interpreter():
    """Its tl.dot on bf16 came out 1e10 off, all finite: the rows of a bf16 CPU run were silently wrong."""
    x, weight, indices, scores, _ = float64_inputs(CASES["k-1"])
    bf16 = [t.bfloat16() for t in (x, weight, scores)]
    with pytest.raises(ValueError, match="the Triton expert matmul takes no bf16 on the CPU"):
        expert_matmul(bf16[0], bf16[1], route(indices, 3), bf16[2], 2, impl="triton")


def test_environment_forces_the_implementation(monkeypatch):
    """CPU tensors take the PyTorch path unless SWITCHBENCH_EXPERT_MATMUL says otherwise."""
    x, weight, indices, scores, _ = float64_inputs(CASES["k-1"])
    routing = route(indices, 3)
    expert_matmul(x, weight, routing, scores, 2)  # float64: only the PyTorch path takes it
    monkeypatch.setenv("SWITCHBENCH_EXPERT_MATMUL", "triton")
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        expert_matmul(x, weight, routing, scores, 2)
    monkeypatch.setenv("SWITCHBENCH_EXPERT_MATMUL", "cublas")
    with pytest.raises(
        ValueError, match="must be one of auto, torch, triton, grouped_mm, all_experts; got 'cublas'"
    ):
        expert_matmul(x, weight, routing, scores, 2)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_real_sizes(dtype):
    """262M C4 SwitchHead V projection shapes (4 heads x 4 experts, k=2), batch 8, on the GPU."""
    gen = torch.Generator().manual_seed(0)
    n, heads, n_experts, k, d_model, d_head = 8 * 1024, 4, 4, 2, 1024, 112
    choices = torch.rand(n, heads, n_experts, generator=gen).argsort(-1)[..., :k]  # [N, H, k]
    indices = (choices + torch.arange(heads)[:, None] * n_experts).reshape(n, heads * k)
    x = torch.randn(n, 1, d_model, generator=gen, dtype=torch.float64)
    weight = (
        torch.randn(heads * n_experts, d_model, d_head, generator=gen, dtype=torch.float64) / d_model**0.5
    )
    scores = torch.rand(n, heads * n_experts, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(n, heads, d_head, generator=gen, dtype=torch.float64)
    exact = run("torch", x, weight, indices, scores, heads, grad_out)
    got = run("triton", *(t.to(dtype) for t in (x, weight)), indices, scores.to(dtype), heads, grad_out)
    tol = {torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    for a, b in zip(got, exact, strict=True):
        scale = b.abs().max()
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=tol)


def test_custom_op_registration():
    """Schema, fake implementation and autograd registration agree with the real op (opcheck)."""
    x, weight, indices, scores, _ = float64_inputs(CASES["switchhead-v"])
    for impl in ("torch", "triton"):
        dtype, device = (torch.float64, "cpu") if impl == "torch" else (torch.float32, TRITON_DEVICE)
        routing = route(indices.to(device), weight.shape[0])
        leaves = [t.detach().to(device, dtype).requires_grad_() for t in (x, weight, scores)]
        torch.library.opcheck(
            torch.ops.switchbench.expert_matmul.default,
            (*leaves, routing.indices, routing.order, routing.experts, routing.offsets, 3, impl),
            test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
        )


@pytest.mark.slow
def test_torch_compile_traces_a_switchhead_layer():
    from switchbench.models.config import ModelConfig
    from switchbench.models.families.switchhead import SwitchHeadAttention
    from switchbench.models.layers.window import make_window

    cfg = ModelConfig(model="switchhead", d_model=32, n_layers=2, n_heads=2, d_head=8, n_experts=4, k=2, T=8)
    layer = SwitchHeadAttention(cfg)
    x = torch.randn(2, 8, 32)
    window = make_window(0, 0, 8, 8, 1, True, "cpu")
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=False)
    torch.testing.assert_close(compiled(x, None, window)[0], layer(x, None, window)[0])


@pytest.mark.slow
def test_switchhead_layer_on_the_triton_path(monkeypatch):
    """A whole SwitchHead layer, forward and backward, gives the same result through either implementation."""
    from switchbench.models.config import ModelConfig
    from switchbench.models.families.switchhead import SwitchHeadAttention
    from switchbench.models.layers.window import make_window

    cfg = ModelConfig(model="switchhead", d_model=24, n_layers=2, n_heads=2, d_head=8, n_experts=3, k=2, T=6)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on both paths
    reference = SwitchHeadAttention(cfg)
    x, mem = torch.randn(2, 6, 24), torch.randn(2, 6, 24)
    results = {}
    for impl, device in (("torch", "cpu"), ("triton", TRITON_DEVICE)):
        monkeypatch.setenv("SWITCHBENCH_EXPERT_MATMUL", impl)
        layer = copy.deepcopy(reference).to(device)
        y, _ = layer(x.to(device), mem.to(device), make_window(6, 6, 6, 6, 1, True, device))
        y.square().sum().backward()
        results[impl] = [t.cpu() for t in (y.detach(), *(p.grad for p in layer.parameters()))]
    for a, b in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_autocast_runs_the_op_in_the_autocast_dtype():
    """Under autocast the op computes in bf16; fp32 leaves still get fp32 gradients of the right value."""
    x, weight, indices, scores, grad_out = float64_inputs(CASES["switchhead-o"])
    leaves = [t.float().requires_grad_() for t in (x, weight, scores)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = expert_matmul(leaves[0], leaves[1], route(indices, weight.shape[0]), leaves[2], 1, impl="torch")
    assert y.dtype == torch.bfloat16
    y.backward(grad_out.to(y.dtype))
    exact = run("torch", x, weight, indices, scores, 1, grad_out)
    for got, ref in zip([y.detach(), *(leaf.grad for leaf in leaves)], exact, strict=True):
        assert got.dtype in (torch.bfloat16, torch.float32)
        scale = ref.abs().max()
        torch.testing.assert_close(got.double() / scale, ref / scale, rtol=0, atol=3e-2)
    assert all(leaf.grad.dtype == torch.float32 for leaf in leaves)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_backward_takes_an_fp32_gradient_with_bf16_inputs(impl):
    """Under CUDA autocast the gradient reaching the op can be fp32 while its saved inputs are bf16: the backward
    op casts it to the forward's dtype (before, the PyTorch path's bmm and Triton's tl.dot refused the mix)."""
    x, weight, indices, scores, grad_out = float64_inputs(CASES["switchhead-o"])
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    # Triton 3.9's interpreter computes bf16 tl.dot wrongly; fp16 makes the same mix with an fp32 gradient.
    half = torch.float16 if device == "cpu" and impl == "triton" else torch.bfloat16
    routing = route(indices.to(device), weight.shape[0])
    inputs = [t.to(device, half) for t in (x, weight, scores)]
    got = torch.ops.switchbench.expert_matmul_backward(
        grad_out.to(device, torch.float32),
        *inputs,
        routing.indices,
        routing.order,
        routing.experts,
        routing.offsets,
        impl,
    )
    exact = run("torch", x, weight, indices, scores, 1, grad_out)[1:]
    for name, a, ref in zip(NAMES[1:], got, exact, strict=True):
        assert a.dtype == half, name
        scale = ref.abs().max()
        torch.testing.assert_close(a.double().cpu() / scale, ref / scale, rtol=0, atol=3e-2)


# A gated case whose input is wider than 128 columns: the input-gradient launch (whose epilogue gives the gate
# gradient) then has N tiles of different counts under different configurations.
WIDE = Case("wide", 6, 3, 6, 1, 5, 1, 130, 19, True)


def _config_pairs() -> list:
    from switchbench.ops.expert_matmul import triton_kernels as kernels

    scatter, outer = kernels.CONFIGS["scatter_matmul"], kernels.CONFIGS["grouped_outer"]
    return [(scatter[i % len(scatter)], outer[i % len(outer)]) for i in range(max(len(scatter), len(outer)))]


def _assert_matches_float64(case, got_impl="triton", seed=11, atol=2e-6):
    x, weight, indices, scores, grad_out = float64_inputs(case, seed=seed)
    exact = run("torch", x, weight, indices, scores, case.out_groups, grad_out)
    got = run(got_impl, x.float(), weight.float(), indices, scores.float(), case.out_groups, grad_out)
    for what, a, ref in zip(NAMES, got, exact, strict=True):
        scale = ref.abs().max().clamp(min=1)
        torch.testing.assert_close(
            a / scale, ref / scale, rtol=0, atol=atol, msg=lambda m, w=what: f"{w}: {m}"
        )


@pytest.mark.parametrize(
    "pair",
    [pytest.param(p, marks=() if i == 0 else pytest.mark.slow) for i, p in enumerate(_config_pairs())],
    ids=lambda p: " + ".join(map(str, map(lambda c: c.kwargs["BLOCK_N"], p))),
)
def test_every_configuration_alone_matches_float64(pair, monkeypatch):
    """Each autotuning candidate, pinned, gives the right output and gradients (the interpreter runs it too)."""
    from switchbench.ops.expert_matmul.triton_kernels import config_label

    scatter, outer = pair
    monkeypatch.setenv(
        tuning.ENV, f"scatter_matmul={config_label(scatter)};grouped_outer={config_label(outer)}"
    )
    _assert_matches_float64(WIDE)


@pytest.mark.slow
def test_autotuned_path_matches_float64(monkeypatch):
    """The autotuner launches every candidate into the same buffers, then the winner again. With the winner
    the widest-N candidate, benchmarked after narrower ones, the gate gradient used to take their stale
    partial rows (0.66 relative error on an H100). Here a stand-in benchmarker picks the last candidate."""
    from switchbench.ops.expert_matmul import triton_kernels as kernels

    def last_wins(kernel_call, quantiles):
        kernel_call()
        last_wins.calls += 1
        return [1.0 / last_wins.calls] * len(quantiles)

    last_wins.calls = 0
    monkeypatch.setattr(kernels, "_INTERPRETER_CONFIGS", {})  # autotune in the interpreter too
    for tuned in (kernels._scatter_matmul_tuned, kernels._grouped_outer_tuned):
        monkeypatch.setattr(tuned, "cache", {})
        monkeypatch.setattr(tuned, "cache_results", False)
        monkeypatch.setitem(tuned.__dict__, "do_bench", last_wins)  # not through the cached property
    monkeypatch.setattr(tuning, "_chosen", {})
    _assert_matches_float64(WIDE)
    assert last_wins.calls > len(kernels.CONFIGS["scatter_matmul"])  # several candidates per kernel ran
    chosen = tuning.chosen()  # what kernel-tune would keep: the last candidate of each launch
    assert chosen[("scatter_matmul", "64x32x144 float32 gate_grad gates")] == "M128 N128 K64 w8 s3"
    # a winner sharing the slots two ways, tuned after one sharing them four: its sum leaves their partials out
    assert chosen[("grouped_outer", "64x144x32 float32 gates")] == "M128 N64 K64 SPLIT2 w4 s3"


def test_a_launch_is_idempotent(monkeypatch):
    """Launching every kernel twice into the same outputs changes nothing: no output accumulates."""
    from switchbench.ops.expert_matmul import triton_kernels as kernels

    launch = kernels._launch

    def twice(*args, **kwargs):
        launch(*args, **kwargs)
        return launch(*args, **kwargs)

    monkeypatch.setattr(kernels, "_launch", twice)
    _assert_matches_float64(CASES["switchhead-o"])


def test_configurations_tuned_ahead_of_time_are_used_where_the_gpu_matches(monkeypatch):
    from switchbench.ops.expert_matmul import triton_kernels as kernels

    key = kernels.shape_key(3000, 1024, 112, torch.bfloat16, gates=True, gate_grad=False)
    assert key == "4096x1024x112 bfloat16 gates"
    label = kernels.config_label(kernels.CONFIGS["scatter_matmul"][3])
    table = {"device": "NVIDIA H100 80GB HBM3", "configs": {"scatter_matmul": {key: label}}}
    monkeypatch.setattr(tuning, "tables", lambda: (table,))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(tuning.ENV, raising=False)
    tuning.ahead_of_time.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    assert kernels._config("scatter_matmul", key, gpu) is kernels.CONFIGS["scatter_matmul"][3]
    assert kernels._config("scatter_matmul", key.replace("gates", "gate_grad"), gpu) is None  # autotuned
    assert tuning.ahead_of_time("scatter_matmul", key, torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    tuning.ahead_of_time.cache_clear()
    assert kernels._config("scatter_matmul", key, gpu) is None
    tuning.ahead_of_time.cache_clear()


def _check_labels(table: dict) -> None:
    """Every label of a table of tuned configurations names a candidate of its kernel (a ValueError if not)."""
    from switchbench.ops.attention import flash
    from switchbench.ops.expert_matmul import triton_kernels as kernels

    for kernel, labels in table["configs"].items():
        for key, label in labels.items():
            if kernel.startswith("flash_"):  # keyed "<t>x<S>x<D> ...": its candidates are D's
                width = int(key.split()[0].split("x")[2])
                flash.by_label(kernel.removeprefix("flash_"), width, label)
            else:
                kernels.by_label(kernel, label, "test")


def test_the_shipped_table_names_known_configurations():
    """The shipped table holds only labels the kernels have (it is empty until a GPU tunes it); the check itself
    passes the candidates' own labels and refuses one that no candidate has."""
    from importlib.resources import files

    from switchbench.bench.kernels.tune import TABLE
    from switchbench.ops.attention import flash
    from switchbench.ops.expert_matmul import triton_kernels as kernels

    assert TABLE.resolve() == Path(str(files("switchbench.ops") / "data" / tuning.FILE)).resolve()
    for table in tuning.tables():
        _check_labels(table)
    known = {
        "scatter_matmul": {
            "1024x1024x112 bfloat16": kernels.config_label(kernels.CONFIGS["scatter_matmul"][-1])
        },
        "flash_forward": {
            "512x1024x64 bfloat16 pos mask": flash.config_label(flash.candidates("forward", 64)[-1])
        },
    }
    _check_labels({"configs": known})
    for kernel in known:
        bogus = {kernel: dict.fromkeys(known[kernel], "M7 N7 w1 s1")}
        with pytest.raises(ValueError, match="M7 N7 w1 s1"):
            _check_labels({"configs": bogus})


def test_a_table_merged_for_one_gpu_keeps_the_others():
    from switchbench.bench.kernels.tune import merged

    before = {"tables": [{"device": "A", "configs": {}}, {"device": "B", "configs": {}}]}
    after = merged(before, "B", {"configs": {"scatter_matmul": {"k": "M64 N64 K64 w4 s4"}}})
    assert [t["device"] for t in after["tables"]] == ["A", "B"] and after["tables"][1]["configs"]
