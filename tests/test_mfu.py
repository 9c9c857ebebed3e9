"""MFU beside every training-step time: `train` logs each interval's model FLOPs over its seconds at the measured
peak; the model FLOPs are the exact count (held here against PyTorch's FlopCounterMode on the classifier)."""

import pandas as pd
import pytest
import torch

from switchbench.bench.cost.accounting import model_macs
from switchbench.bench.cost.measure import counted_macs
from switchbench.bench.timing import timer
from switchbench.models.lm import LanguageModel, SequenceClassifier
from switchbench.models.presets import PRESETS
from switchbench.train import listops, run


@pytest.mark.parametrize("preset", ["listops-transformer-h8", "listops-switchhead-h2", "listops-moa-h4"])
@pytest.mark.parametrize("length", [9, 31])
def test_the_classifier_count_is_what_runs(preset, length):
    cfg = PRESETS[preset]
    torch.manual_seed(0)
    model = SequenceClassifier(cfg, listops.N_CLASSES).eval()
    tokens = torch.randint(len(listops.VOCAB), (1, length))
    with torch.no_grad():
        assert counted_macs(lambda: model(tokens)) == run.classifier_macs(cfg, length)


@pytest.mark.parametrize(
    "preset",
    ["tiny-transformer", "tiny-switchhead", "tiny-switchall", "tiny-moa", "tiny-gqa-kv2", "tiny-moh"],
)
def test_the_language_model_count_is_what_runs(preset):
    """The LM's count (the train log's MFU, quality's training MACs, the MAC floors) against FlopCounterMode, the
    σ-MoE MLP's branch included: a chunk that starts a stream attends to no memory, the next to a chunk of it."""
    cfg = PRESETS[preset]
    torch.manual_seed(0)
    model = LanguageModel(cfg).eval()
    tokens = torch.randint(cfg.vocab, (1, cfg.T))
    with torch.no_grad():
        state = model(tokens).state
        assert counted_macs(lambda: model(tokens)) == model_macs(cfg.replace(context_blocks=0))
        assert (
            counted_macs(lambda: model(tokens, state))
            == model_macs(cfg)
            > model_macs(cfg.replace(context_blocks=0))
        )


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
        per_step = [6 * 2 * model_macs(c) for c in memory]
        assert per_step[0] < per_step[1]
    else:
        lengths = [
            len(listops.length_batch(2, s, 0, listops.ListOpsConfig(max_length=model_cfg.T))[0][0])
            for s in range(4)
        ]
        per_step = [6 * 2 * run.classifier_macs(model_cfg, n) for n in lengths]
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
