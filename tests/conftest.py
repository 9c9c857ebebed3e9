import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before triton.jit runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
