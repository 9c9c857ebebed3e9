"""Softmax attention kernels (explicit, SDPA, FlexAttention) and the process-wide choice between them."""
