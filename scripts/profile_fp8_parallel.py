"""Where the time of one tensor + sequence parallel MLP step goes
(development tool): the block of `python -m lowbit.bench fp8_parallel`
(up 4096 -> 14336, GELU, down; 8192 tokens per GPU), compiled (fullgraph),
on 2 GPUs, for the providers named (bench fp8_parallel's names; default:
BF16, tensorwise with the FP8 all-gather and with the BF16 all-gather).
Rank 0 prints each kernel's time per step, largest first, and the step's
time replayed as a CUDA graph.

  python scripts/profile_fp8_parallel.py ["lowbit:tensorwise" ...]
"""

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.profiler import ProfilerActivity, profile

from lowbit.bench.fp8_parallel import D, HIDDEN, SEQ_PER_GPU, _block

STEPS = 5


def _kernels(prof) -> tuple[list, float]:
    totals: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = totals.setdefault(ev.name[:100], [0.0, 0])
            t[0] += ev.device_time_total
            t[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return rows, sum(v[0] for v in totals.values()) / STEPS


def _worker(rank, world, init_file, providers):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=dev)
    try:
        gen = torch.Generator().manual_seed(0)
        up, down = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)
        with torch.no_grad():
            for p in (*up.parameters(), *down.parameters()):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        up, down = up.to(dev, torch.bfloat16), down.to(dev, torch.bfloat16)
        x = torch.randn(SEQ_PER_GPU, D, generator=gen).to(dev, torch.bfloat16).requires_grad_()
        dy = torch.randn(SEQ_PER_GPU, D, generator=gen).to(dev, torch.bfloat16)
        for name in providers:
            block = torch.compile(_block(name, up, down, dist.group.WORLD), fullgraph=True)

            def step(block=block):
                torch.autograd.grad(block(x), [x, *block.parameters()], dy)

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(STEPS):
                    step()
                torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            for _ in range(3):
                graph.replay()
            dist.barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
            replay_us = (time.perf_counter() - start) / 20 * 1e6
            if rank == 0:
                rows, total = _kernels(prof)
                print(f"\n== {name}: kernels {total:.0f} us per step, CUDA-graph replay {replay_us:.0f} us", flush=True)
                for kname, (t, n) in rows[:28]:
                    print(f"{t / STEPS:9.1f} us  x{n // STEPS:<3d} {kname}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    names = sys.argv[1:] or ["bf16", "lowbit:tensorwise", "lowbit:tensorwise, bf16 all-gather"]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "init"), names), nprocs=2)
