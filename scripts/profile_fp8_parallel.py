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

from lowbit.bench.fp8_parallel import D, HIDDEN, SEQ_PER_GPU, _block, block_tensors
from lowbit.bench.harness import profile_kernels

STEPS = 5


def _worker(rank, world, init_file, providers):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=dev)
    try:
        up, down, x, dy = block_tensors(dev, SEQ_PER_GPU, D, HIDDEN)
        for name in providers:
            block = torch.compile(_block(name, up, down, dist.group.WORLD), fullgraph=True)

            def step(block=block):
                torch.autograd.grad(block(x), [x, *block.parameters()], dy)

            rows, total = profile_kernels(step, STEPS)
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
                print(f"\n== {name}: kernels {total:.0f} us per step, CUDA-graph replay {replay_us:.0f} us", flush=True)
                for kname, us, n in rows[:28]:
                    print(f"{us:9.1f} us  x{n:<3d} {kname}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    names = sys.argv[1:] or ["bf16", "lowbit:tensorwise", "lowbit:tensorwise, bf16 all-gather"]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "init"), names), nprocs=2)
