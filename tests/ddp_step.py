"""Run under torchrun (gloo, float64): one AdamW step of a tiny language model under DistributedDataParallel, each
rank on its share of a batch of 4 sequences, against the same step in one process on the whole batch. Rank 0 prints
the largest difference between the ranks' weights and between them and the one-process step, as JSON."""

import json
import sys

import torch

from switchbench.core import distributed
from switchbench.models.lm import LanguageModel
from switchbench.models.presets import PRESETS


def step(model: torch.nn.Module, trained: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trained(tokens[:, :-1]).loss(tokens[:, 1:]).backward()
    optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def fresh(preset: str) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(PRESETS[preset].replace(dropout=0.0)).double()


def main(preset: str) -> None:
    cfg = PRESETS[preset]
    tokens = torch.randint(cfg.vocab, (4, cfg.T + 1), generator=torch.Generator().manual_seed(1))
    with distributed.process_group("cpu") as world:
        model = fresh(preset)
        weights = step(model, distributed.wrap(model, world), tokens[distributed.share(4, world)])
        every = distributed.gathered(weights, world)
    if world.main:
        alone = fresh(preset)
        reference = step(alone, alone, tokens)
        print(
            json.dumps(
                {
                    "world_size": world.size,
                    "between_ranks": max((w - every[0]).abs().max().item() for w in every),
                    "against_one_process": (every[0] - reference).abs().max().item(),
                    "moved": (reference - torch.cat([p.flatten() for p in fresh(preset).parameters()]))
                    .abs()
                    .max()
                    .item(),
                }
            )
        )


if __name__ == "__main__":
    main(sys.argv[1])
