"""A host-free training step: no family's step waits on the host. On the CPU the proof is the compiler's: every
family's forward and loss trace into one graph (``fullgraph=True`` raises at any graph break, which a host sync
such as ``.item()`` or a data-dependent size causes), AOTAutograd derives the backward from it, and AdamW's step
traces as one graph; the compiled step gives eager's loss and gradients in float64. On CUDA a step runs under
``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronisation."""

import pytest
import torch
from small import SEQ, TIGHT, T, random_tokens, small_cfg

from switchbench.models import family as registry
from switchbench.models.lm import LanguageModel
from switchbench.ops.attention import choice as attention_choice
from switchbench.ops.expert_matmul import choice as expert_matmul_choice

FAMILIES = registry.names()
CASES = [(model, "xl") for model in FAMILIES] + [("transformer", "rope"), ("switchhead", "rope")]


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
    torch.testing.assert_close(got, expected, **TIGHT)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(dict(lm.named_parameters())[name].grad, grad, **TIGHT)

    # AdamW's step: torch's own step wrapper puts a graph break around it on purpose (its no_grad boundary), so
    # fullgraph cannot be asked of it; dynamo's account must show no break inside
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in lm.named_parameters()}
    explanation = torch._dynamo.explain(optimizer.step)()
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons
    assert any(not torch.equal(p, before[n]) for n, p in lm.named_parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("impl", ["triton", "grouped_mm"])
@pytest.mark.parametrize(("model", "pos"), CASES)
def test_no_host_sync_in_a_cuda_training_step(model, pos, impl, attention):
    from switchbench.ops.expert_matmul import grouped

    if impl == "grouped_mm" and grouped.unavailable():
        pytest.skip(grouped.unavailable())
    lm, tokens, state = model_and_batch(model, pos, "cuda", torch.float32)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-3, capturable=True)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = lm(tokens, state).loss(tokens)
        loss.backward()
        optimizer.step()

    with expert_matmul_choice.selected(impl), attention_choice.selected(attention):
        step()  # lazy initialisation, autotuning and compilation may synchronise; a step after them may not
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
