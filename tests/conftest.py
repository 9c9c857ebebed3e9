import os

import torch
from hypothesis import settings

# The same examples on every run and machine: a property that fails in CI fails here too, from its seed alone.
settings.register_profile("switchbench", derandomize=True, database=None)
settings.load_profile("switchbench")

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before triton.jit runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
