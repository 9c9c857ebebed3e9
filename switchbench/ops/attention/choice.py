"""Which kernel runs softmax attention: one process-wide choice, ``auto`` or a named backend.

The choice in force is, first to last: the innermost :func:`selected` (the command line's ``--attention``),
``SWITCHBENCH_ATTENTION``, ``auto``. A call resolves it with what it knows of itself: whether it adds a position
bias to the logits (Transformer-XL) and whether the caller wants the attention maps, which only the explicit kernel
has. Every resolution is recorded in the logs opened by :func:`recording`, so a run can say what it ran on.
"""

from switchbench.core.choice import Choice, traced_once

BACKENDS = ("explicit", "sdpa", "flex", "triton")
CHOICES = ("auto", *BACKENDS)
ENV = "SWITCHBENCH_ATTENTION"
NEEDS_CUDA = {"flex": "torch has no FlexAttention backward on the CPU"}  # a backend, and why it needs CUDA
NEEDS_TRITON = ("triton",)  # backends of Triton kernels: CUDA, or the CPU in Triton's interpreter
# Backends that take no float64 on a GPU, and why: Triton compiles no float64 product for sm_90 (Triton 3.6), in this
# suite's flash kernel or in the kernel Inductor writes for FlexAttention (a float64 product into its float32 sum)
NO_FLOAT64_ON_CUDA = {
    "triton": "Triton compiles no float64 product for the GPU",
    "flex": "Inductor's kernel sums a float64 product in float32, which Triton does not compile",
}
# The widest heads (channels) a backend takes, where it has a limit: Triton's flash attention holds a block's dK and
# dV for a whole head in registers, and past 128 channels every key-block candidate spilled on sm_90
WIDEST = {"triton": 128}
# auto on the CPU keeps Transformer-XL's logits explicit: SDPA with an additive bias was slower there (the 47M dense
# layer's forward+backward 190 ms against 166 ms, one thread), and the exact memory counts (cost.softmax_attention)
# and the CPU gate's baseline describe the explicit path
AUTO_RULE = (
    "explicit for maps; SDPA on CUDA; on the CPU SDPA without a position bias (RoPE), explicit with one (XL)"
)

_CHOICE = Choice("attention kernel", ENV, CHOICES)
selected = _CHOICE.selected
choice = _CHOICE.choice
resolutions = _CHOICE.resolutions  # {"device | bias[ | maps]": backend}
recording = _CHOICE.recording
check = _CHOICE.check
as_named = _CHOICE.as_named


def lookup(device_type: str, biased: bool, maps: bool, named: str | None = None) -> str:
    """The backend ``named`` (default: the choice in force) gives a call on ``device_type``."""
    named = named or choice()
    if maps:  # only the explicit kernel has the maps, whatever is named
        return "explicit"
    if named != "auto":
        return named
    return "explicit" if biased and device_type != "cuda" else "sdpa"


@traced_once
def resolve(device_type: str, biased: bool, maps: bool) -> str:
    """:func:`lookup`, recorded in every open recording. Under torch.compile it runs once, as the graph is traced."""
    backend = lookup(device_type, biased, maps)
    key = f"{device_type} | {'position bias' if biased else 'no bias'}{' | maps' if maps else ''}"
    _CHOICE.record(key, backend)
    return backend


def check_width(d_head: int, what: str) -> None:
    """A ValueError when the backend named in force cannot run heads of ``d_head`` channels (``what`` names the
    model), so that a command refuses before its work, not at its first forward."""
    named = choice()
    if d_head > WIDEST.get(named, d_head):
        raise ValueError(
            f"{as_named('--attention')} takes heads of at most {WIDEST[named]} channels; {what} has {d_head} "
            "(use sdpa)"
        )
