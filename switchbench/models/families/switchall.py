"""SwitchAll (the SwitchHead paper's Table 3): SwitchHead attention with a sigma-MoE MLP."""

from dataclasses import replace

from switchbench.models.config import ModelConfig
from switchbench.models.families import switchhead
from switchbench.models.family import BYTES, register
from switchbench.ops.expert_matmul.cases import Case


def expert_matmuls(cfg: ModelConfig, batch: int) -> tuple[Case, ...]:
    """The sigma-MoE MLP's (its attention's are SwitchHead's): K of N_E experts of size G, up then down, one routing
    for both, gated."""
    NE, G, K, d, tokens = cfg.mlp_experts, cfg.mlp_expert_size, cfg.mlp_k, cfg.d_model, batch * cfg.T
    return (
        Case("sigma-moe-up", tokens, 1, K, K, NE, 1, d, G, False, shared_by=2),
        Case("sigma-moe-down", tokens, K, K, 1, NE, 1, G, d, True, shared_by=2),
    )


FAMILY = register(
    replace(
        switchhead.FAMILY,
        name="switchall",
        label="SwitchAll",
        attention_name="switchhead",
        mlp="sigma_moe",
        expert_matmuls=expert_matmuls,
        # the byte-level model: SwitchHead's attention and 16 MLP experts of which 4 are active
        presets=lambda declared: {
            "bytes-920k-switchall-h2": ModelConfig(
                **BYTES,
                model="switchall",
                n_heads=2,
                d_head=32,
                n_experts=4,
                k=2,
                mlp_experts=16,
                mlp_expert_size=29,
                mlp_k=4,
            )
        },
        roles={
            "47m": "c4-47m-switchall-h2",
            "262m": "c4-262m-switchall-h4",
            "tiny": "tiny-switchall",
            "listops": "listops-switchall-h2",
            "bytes": "bytes-920k-switchall-h2",
            "quality": "wikitext103-47m-switchall-h2",
        },
    )
)
