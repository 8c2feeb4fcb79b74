"""The benchmark harness's timers (lowbit.bench.harness): every provider runs
every input set, and each gets a time of its own."""

import math

import pytest
import torch

from lowbit.bench.harness import time_calls, time_calls_in_turns

cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("use_graph", [True, False])
def test_cuda_time_calls_in_turns_runs_every_provider(use_graph):
    # Two providers with different set counts, each adding one to its own
    # counter per call: afterwards every set of each has been run (the
    # warm-up, the graph's replays), and nothing ran a set past its count.
    counts = [torch.zeros(n + 1, device="cuda") for n in (3, 2)]

    def provider(j):
        def call(i):
            counts[j][i] += 1

        return call

    times = time_calls_in_turns([(provider(0), 3), (provider(1), 2)], use_graph=use_graph, replays=5)
    torch.cuda.synchronize()
    assert len(times) == 2
    assert all(math.isfinite(t) and t > 0 for t in times)
    for j, n in ((0, 3), (1, 2)):
        assert (counts[j][:n] > 0).all() and counts[j][n] == 0, (j, counts[j])
        assert torch.all(counts[j][:n] == counts[j][0]), (j, counts[j])  # every set as often

    # time_calls: the one-provider case.
    before = counts[0].clone()
    t = time_calls(provider(0), 3, use_graph=use_graph, replays=5)
    torch.cuda.synchronize()
    assert math.isfinite(t) and t > 0
    runs = counts[0] - before
    assert (runs[:3] > 0).all() and torch.all(runs[:3] == runs[0]) and runs[3] == 0, runs

