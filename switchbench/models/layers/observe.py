"""Attention maps and expert selections, recorded on request and at no cost otherwise."""

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


class Observable:
    """Mixin: a module whose ``observation`` dict, when set, receives what its last forward computed."""

    observation: dict | None = None

    @property
    def observing(self) -> bool:
        return self.observation is not None

    def record(self, **values) -> None:
        if self.observation is not None:
            self.observation.update(values)


@contextmanager
def observe(model: nn.Module) -> Iterator[dict[str, dict]]:
    """Within the block, ``records[module_name]`` holds the maps and routing of each module's last forward."""
    modules = {name: m for name, m in model.named_modules() if isinstance(m, Observable)}
    records = {name: {} for name in modules}
    for name, m in modules.items():
        m.observation = records[name]
    try:
        yield records
    finally:
        for m in modules.values():
            m.observation = None
