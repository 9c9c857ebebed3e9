"""The built-in attention families, registered in this order on import: dense first (the baseline of every
comparison), then the paper's SwitchHead, MoA and SwitchAll, then the families the paper does not have."""

from . import dense, switchhead, moa, switchall  # noqa: F401, I001  (the import order is the registry's)
