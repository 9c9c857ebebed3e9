"""The built-in attention families, registered on import: dense first (the baseline of every comparison), then the
paper's SwitchHead, MoA and SwitchAll, then every other module of this folder in name order (one module per
family: adding a family is adding its module)."""

import importlib
import pkgutil

PAPER = ("dense", "switchhead", "moa", "switchall")
OTHERS = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in PAPER)
for _name in (*PAPER, *OTHERS):
    importlib.import_module(f"{__name__}.{_name}")
