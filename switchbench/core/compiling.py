"""Room for torch.compile to compile one function many times: one policy for every compiled path here."""

import torch

# Compilations of one code object a process may make
COMPILATIONS = 64


def allow_recompilations() -> None:
    """Raise dynamo's limit on compilations of one code object to COMPILATIONS. Each shape and grad mode is one,
    and so is each family for the blocks' shared ``forward``: past dynamo's default of 8 the code runs eager with
    only a log line (an H200's 262M pair on FlexAttention: the no-grad forwards, compiled after the training
    steps, took 614 ms against the training step's 388; a six-family group's blocks need 12)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILATIONS)
    # and past it, an error (PAST_THE_LIMIT), not the eager code: the rows of a member that ran eager beside
    # compiled ones were saved as measured
    torch._dynamo.config.fail_on_recompile_limit_hit = True


PAST_THE_LIMIT = torch._dynamo.exc.FailOnRecompileLimitHit
