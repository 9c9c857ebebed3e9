"""SwitchAll (the SwitchHead paper's Table 3): SwitchHead attention with a sigma-MoE MLP."""

from dataclasses import replace

from ..family import register
from . import switchhead

FAMILY = register(
    replace(
        switchhead.FAMILY,
        name="switchall",
        label="SwitchAll",
        attention_name="switchhead",
        mlp="sigma_moe",
        roles={
            "47m": "c4-47m-switchall-h2",
            "262m": "c4-262m-switchall-h4",
            "tiny": "tiny-switchall",
            "listops": "listops-switchall-h2",
        },
    )
)
