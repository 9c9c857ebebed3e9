"""MFU beside every training-step time: `train` logs each interval's model FLOPs over its seconds at the measured
peak; the model FLOPs are the exact count (held here against PyTorch's FlopCounterMode on the classifier)."""

import pandas as pd
import pytest
import torch

from switchbench.bench.cost import measure
from switchbench.bench.cost.accounting import model_macs
from switchbench.bench.cost.measure import counted_macs
from switchbench.bench.timing import timer
from switchbench.models.lm import LanguageModel, SequenceClassifier
from switchbench.models.presets import PRESETS
from switchbench.train import listops, run


@pytest.mark.parametrize("preset", ["listops-transformer-h8", "listops-switchhead-h2", "listops-moa-h4"])
@pytest.mark.parametrize(("length", "batch"), [(9, 1), (31, 1), (31, 3)])
def test_the_classifier_count_is_what_runs(preset, length, batch):
    cfg = PRESETS[preset]
    torch.manual_seed(0)
    model = SequenceClassifier(cfg, listops.N_CLASSES).eval()
    tokens = torch.randint(len(listops.VOCAB), (batch, length))
    with torch.no_grad():
        assert counted_macs(lambda: model(tokens)) == run.classifier_macs(cfg, length, batch)


LM_PRESETS = [
    "tiny-transformer",
    "tiny-switchhead",
    "tiny-switchall",
    "tiny-moa",
    "tiny-gqa-kv2",
    "tiny-moh",
    "tiny-transformer-rope",
    "tiny-switchhead-rope",
]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("preset", LM_PRESETS)
def test_the_language_model_count_is_what_runs(preset, batch):
    """The LM's count (the train log's MFU, quality's training MACs, the MAC floors) against FlopCounterMode, the
    σ-MoE MLP's branch included: a chunk that starts a stream attends to no memory, the next to a chunk of it. A
    batch projects XL's positions once for all its sequences."""
    cfg = PRESETS[preset]
    torch.manual_seed(0)
    model = LanguageModel(cfg).eval()
    tokens = torch.randint(cfg.vocab, (batch, cfg.T))
    with torch.no_grad():
        state = model(tokens).state
        assert counted_macs(lambda: model(tokens)) == model_macs(cfg.replace(context_blocks=0), batch)
        assert counted_macs(lambda: model(tokens, state)) == model_macs(cfg, batch)
    if cfg.context_blocks:
        assert model_macs(cfg, batch) > model_macs(cfg.replace(context_blocks=0), batch)


@pytest.mark.parametrize("preset", LM_PRESETS)
def test_a_batch_shares_only_the_position_projection(preset):
    """What a batch of 3 computes once is XL's position projection, D distances x d_model x heads x d_head a
    layer (a hand count), and nothing with RoPE."""
    cfg = PRESETS[preset]
    D = (1 + cfg.context_blocks) * cfg.T
    heads = 1 if cfg.model == "moa" else cfg.n_heads
    by_hand = cfg.n_layers * D * cfg.d_model * heads * cfg.d_head if cfg.pos == "xl" else 0
    assert 3 * model_macs(cfg) - model_macs(cfg, 3) == 2 * by_hand


@pytest.mark.parametrize("task", ["lm", "listops"])
def test_each_logged_interval_carries_its_mfu(task, tmp_path, monkeypatch):
    monkeypatch.setattr(run, "matmul_peak_tflops", lambda device, dtype: 1.0)  # a peak of 1 TFLOP/s
    preset = "tiny-transformer" if task == "lm" else "listops-transformer-h8"
    cfg = run.TrainConfig(task, preset, steps=4, batch=2, eval_every=2, val_size=20)
    run.train(cfg, tmp_path, progress=False)
    log = pd.read_csv(tmp_path / "log.csv")
    model_cfg = PRESETS[preset]
    if task == "lm":  # a step that starts the streams again has no XL memory to attend to
        chunks = run.LMTask(cfg, model_cfg).chunks
        memory = [model_cfg if step % chunks else model_cfg.replace(context_blocks=0) for step in range(4)]
        per_step = [6 * model_macs(c, 2) for c in memory]
        assert per_step[0] < per_step[1]
    else:
        task = run.ListOpsTask(cfg, model_cfg)
        lengths = [len(task.examples(s)[0][0]) for s in range(4)]
        per_step = [6 * run.classifier_macs(model_cfg, n, 2) for n in lengths]
    seconds = [0.0, *log["train_seconds"]]
    for i, row in enumerate(log.itertuples()):
        flops = sum(per_step[2 * i : 2 * i + 2])
        assert row.mfu == pytest.approx(flops / (seconds[i + 1] - seconds[i]) / 1e12)


@pytest.mark.parametrize(
    ("ms", "rows", "best"),
    [
        (
            {128: 0.1, 256: 0.4, 512: 6.0, 1024: 45.0},
            1024,
            256,
        ),  # float32: up to the largest, each under 20 ms
        ({128: 1.0, 256: 25.0, 512: 200.0, 1024: 1600.0}, 256, 128),  # bf16 without the CPU's support
    ],
    ids=["fast", "slow"],
)
def test_the_cpu_peak_is_the_best_rate_of_products_up_to_one_that_takes_a_moment(monkeypatch, ms, rows, best):
    """On the CPU the yardstick product doubles from 128 rows until one takes 20 ms (at most 1024): bf16 without the
    CPU's support took 2.6 s a product of 1024, half a minute of every bf16 command. The CPU's rate is not monotone
    in size, so the peak is the best rate of every size tried (each at its fastest timed call), and no larger
    product is built. Each size's fastest call here is 10% faster than its others."""
    sizes = []

    def timed(product) -> float:  # a product of n rows takes ms[n], its fourth timed call 10% less
        sizes.append(product.args[0].shape[0])
        return ms[sizes[-1]] * (0.9 if sizes.count(sizes[-1]) == 8 else 1.0)

    monkeypatch.setattr(timer, "Timer", lambda device: timed)
    assert timer.matmul_peak_tflops("cpu", torch.float32) == pytest.approx(
        2 * best**3 / (0.9 * ms[best]) / 1e9
    )
    assert sizes == sorted(sizes) and max(sizes) == rows and sizes.count(rows) == 14  # sized, warm-up, timed


def test_every_fused_attention_is_counted_with_fewer_key_heads_than_query_heads():
    """Decoding keeps GQA's and MoA's fewer key heads (SDPA's enable_gqa). torch 2.11's own formula for the fused
    kernels asserts as many key heads as query heads, and an H200's decode of the 262M group raised there; each
    fused kernel is counted by the suite's formula: every query head's scores and values, by hand."""
    batch, heads, kv_heads, t, s, d = 2, 8, 2, 5, 7, 16
    q, k = (batch, heads, t, d), (batch, kv_heads, s, d)
    formulas = measure._flop_formulas()
    for op in (
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        torch.ops.aten._scaled_dot_product_flash_attention,
        torch.ops.aten._scaled_dot_product_efficient_attention,
        torch.ops.aten._scaled_dot_product_cudnn_attention,
    ):
        assert formulas[op](q, k, k) == 2 * (batch * heads * t * s * d + batch * heads * t * s * d), op
