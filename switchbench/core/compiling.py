"""Room for torch.compile to compile one function many times: one policy for every compiled path here."""

import sys

import torch

# Compilations of one code object a process may make
COMPILATIONS = 64


def allow_recompilations() -> None:
    """Raise dynamo's limit on compilations of one code object to COMPILATIONS. Each shape and grad mode is one,
    and so is each family for the blocks' shared ``forward``: past dynamo's default of 8 the code runs eager with
    only a log line (an H200's 262M pair on FlexAttention: the no-grad forwards, compiled after the training
    steps, took 614 ms against the training step's 388; a six-family group's blocks need 12)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, COMPILATIONS)
    # and past it an error (past_the_limit), not the eager code: the rows of a member that ran eager beside
    # compiled ones were saved as measured. Dynamo refuses it beside suppress_errors, which asks for the eager code
    if not config.suppress_errors:
        config.fail_on_recompile_limit_hit = True


def past_the_limit(error: BaseException) -> bool:
    """Whether ``error`` is dynamo's refusal to compile past the limit. Looked up only when an error comes, so
    that importing this module imports no Dynamo (1.6 s of every command's start)."""
    dynamo = sys.modules.get("torch._dynamo")
    refusal = getattr(getattr(dynamo, "exc", None), "FailOnRecompileLimitHit", None)
    return refusal is not None and isinstance(error, refusal)
