"""A host-free training step: no family's step waits on the host. On the CPU the proof has two parts. The
compiler's: every family's forward and loss trace into one graph (``fullgraph=True`` raises at any graph break,
which ``.item()`` causes), AOTAutograd derives the backward from it, and AdamW's step traces as one graph; the
compiled step gives eager's loss and gradients in float64. And the operators': no operator of a forward and backward is one
whose CUDA kernel reads a value back to the host. The compiler alone let MoA's ``bincount`` through, which sizes its
output from its largest value, and an H100 refused to capture MoA's step in a CUDA graph. On CUDA a step runs under
``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronisation."""

import pytest
import torch
from small import SEQ, TIGHT, TRITON_DEVICE, T, checked_dtype, random_tokens, small_cfg, within
from torch.utils._python_dispatch import TorchDispatchMode

from switchbench.core import optim
from switchbench.core.sync import syncs_raise
from switchbench.models import family as registry
from switchbench.models.lm import LanguageModel
from switchbench.ops.attention import choice as attention_choice
from switchbench.ops.expert_matmul import choice as expert_matmul_choice
from switchbench.ops.expert_matmul.op import routing_selected

FAMILIES = registry.names()
CASES = [(model, "xl") for model in FAMILIES] + [("transformer", "rope"), ("switchhead", "rope")]
aten = torch.ops.aten
# Operators whose CUDA kernels wait on the host: each reads a value back (item), or sizes its output by the data
# (bincount by its largest value; nonzero, masked_select, unique by how many; repeat_interleave by the sum of its
# repeats when no output size is given)
SYNCING = {
    aten._local_scalar_dense.default,
    aten.bincount.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}


class SyncingOps(TorchDispatchMode):
    """Records every operator of :data:`SYNCING` run under it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def model_and_batch(model: str, pos: str, device: str = "cpu", dtype=torch.float64):
    cfg = small_cfg(model, pos)
    torch.manual_seed(0)
    lm = LanguageModel(cfg).to(device, dtype).train()  # train(): the routers' training paths
    tokens = random_tokens(cfg, SEQ).to(device)
    with torch.no_grad():
        state = lm(tokens[:, :T]).state  # memory of a first chunk: the window a training step sees
    return lm, tokens[:, T:], state


@pytest.mark.slow
# torch's own code, as dynamo traces AdamW, touches a deprecated torch.jit name
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize(("model", "pos"), CASES)
def test_every_familys_step_compiles_whole_and_equals_eager(model, pos):
    lm, tokens, state = model_and_batch(model, pos)
    compiles_whole_and_equals_eager(lm, tokens, state)

    # AdamW's step: torch's own step wrapper puts a graph break around it on purpose (its no_grad boundary), so
    # fullgraph cannot be asked of it; dynamo's account must show no break inside
    optimizer = optim.adamw(lm.parameters(), 1e-3, "cpu")
    before = {n: p.detach().clone() for n, p in lm.named_parameters()}
    explanation = torch._dynamo.explain(optimizer.step)()
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons
    assert any(not torch.equal(p, before[n]) for n, p in lm.named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize("model", ["switchhead", "switchall", "moa"])
def test_a_step_routed_by_the_triton_kernels_compiles_whole_and_equals_eager(model):
    """The Triton top-k and grouping (custom ops, run by the interpreter here) trace into the one graph."""
    lm, tokens, state = model_and_batch(model, "xl", TRITON_DEVICE)
    with routing_selected("triton"):
        compiles_whole_and_equals_eager(lm, tokens, state)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["transformer", "switchhead"])
def test_a_step_on_the_triton_flash_attention_compiles_whole_and_equals_eager(model):
    """Triton's flash attention and its backward (custom ops, run by the interpreter here) trace into the one
    graph."""
    lm, tokens, state = model_and_batch(model, "xl", TRITON_DEVICE, checked_dtype("triton"))
    with attention_choice.selected("triton"):
        compiles_whole_and_equals_eager(lm, tokens, state, within("triton"))


def compiles_whole_and_equals_eager(lm, tokens, state, tolerance: dict = TIGHT) -> None:
    """The loss of ``lm`` on ``tokens`` compiles into one graph (fullgraph) whose loss and gradients are eager's."""

    def loss(x):
        return lm(x, state).loss(x)

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    expected = loss(tokens)
    expected.backward()
    eager_grads = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad(set_to_none=True)
    got = compiled(tokens)
    got.backward()
    torch.testing.assert_close(got, expected, **tolerance)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(dict(lm.named_parameters())[name].grad, grad, **tolerance)


@pytest.mark.parametrize("impl", ["grouped_mm", "all_experts"])
@pytest.mark.parametrize(("model", "pos"), CASES)
def test_no_operator_of_a_training_step_reads_back_to_the_host(model, pos, impl):
    # float32: grouped GEMMs take no float64. AdamW's step is torch's: host-free on CUDA with capturable=True, which
    # the CPU refuses, and its CPU step reads its step count back
    lm, tokens, state = model_and_batch(model, pos, dtype=torch.float32)
    # the kernels the GPU runs: fused attention, the expert matmul of grouped GEMMs or of every expert (the CPU's
    # default, torch's padded one, reads its capacity back; the GPU's Triton kernels run only in the interpreter here)
    with SyncingOps() as ops, attention_choice.selected("sdpa"), expert_matmul_choice.selected(impl):
        lm(tokens, state).loss(tokens).backward()
    assert not ops.seen


def test_the_probe_sees_a_read_back():
    with SyncingOps() as ops:
        torch.bincount(torch.tensor([0, 2, 2]))
        torch.tensor([1.0]).item()
    assert ops.seen == ["aten.bincount.default", "aten._local_scalar_dense.default"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attention", ["sdpa", "flex", "triton"])
@pytest.mark.parametrize(
    ("impl", "routing"),
    [("triton", "auto"), ("triton", "triton"), ("grouped_mm", "auto"), ("all_experts", "auto")],
)
@pytest.mark.parametrize(("model", "pos"), CASES)
def test_no_host_sync_in_a_cuda_training_step(model, pos, impl, routing, attention):
    from switchbench.ops.expert_matmul import grouped

    if impl == "grouped_mm" and grouped.unavailable():
        pytest.skip(grouped.unavailable())
    lm, tokens, state = model_and_batch(model, pos, "cuda", torch.float32)
    optimizer = optim.adamw(lm.parameters(), 1e-3, "cuda", capturable=True)  # fused, as the speed steps run

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = lm(tokens, state).loss(tokens)
        loss.backward()
        optimizer.step()

    with (
        expert_matmul_choice.selected(impl),
        attention_choice.selected(attention),
        routing_selected(routing),
    ):
        step()  # lazy initialisation, autotuning and compilation may synchronise; a step after them may not
        torch.cuda.synchronize()
        with syncs_raise():
            step()
