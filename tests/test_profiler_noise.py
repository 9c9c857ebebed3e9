"""The profiler over a block, without kineto's start and stop lines on standard error (torch 2.13 prints them)."""

import os

import torch
from torch.profiler import ProfilerActivity

from switchbench.core import profiler


def test_only_kineto_s_lines_are_dropped_while_the_profiler_starts_or_stops(capfd):
    with profiler._filtered_stderr():
        os.write(
            2, b"USDT:2026-11-26 17:03:56 2674:2674 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
        )
        os.write(2, b"CUPTI_ERROR_NOT_INITIALIZED: a line a user needs\n")
    assert capfd.readouterr().err == "CUPTI_ERROR_NOT_INITIALIZED: a line a user needs\n"


def test_a_profiled_block_records_its_operators_and_prints_only_its_own(capfd):
    with profiler.profiled([ProfilerActivity.CPU]) as prof:
        torch.ones(3).add(1)
        os.write(2, b"USDT: written by the block itself, kept\n")
    assert any(e.name == "aten::add" for e in prof.events())
    assert capfd.readouterr().err == "USDT: written by the block itself, kept\n"  # torch 2.13 wrote two more
