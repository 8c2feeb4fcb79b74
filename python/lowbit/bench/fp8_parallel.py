"""FP8 training Linear across GPUs: a transformer MLP block (up 4096 ->
14336, GELU, down 14336 -> 4096) under tensor + sequence parallelism,
forward + backward, compiled (fullgraph), in FP8 (lowbit.nn.Fp8Linear with
parallel="column" / "row") beside the same block in BF16 with the same
collectives (lowbit.fp8_parallel around F.linear), and the
sequence-parallel all-gather of x alone, in BF16 and in FP8.

    python -m lowbit.bench fp8_parallel        # one process per GPU on the first 2 GPUs
    torchrun --nproc-per-node 2 -m lowbit.bench fp8_parallel   # the same under torchrun

Timing: every rank captures each provider's step in a CUDA graph, then the
providers' graphs are replayed in turns, a fixed number of times (the
ranks' collectives must pair up, so no rank may adapt its counts), and each
sample is the slowest rank's. Rows: ``us`` per step, ``x_bf16`` (BF16's
time over this one), ``x_allgather_MB`` (the bytes of x the forward's
all-gather delivers to each rank: BF16 or FP8 codes; the row layer's
backward all-gathers dy in BF16 for every provider), ``%floor`` (the GEMMs
at the measured peak, FP8 or BF16, over the time; communication not in the
floor), ``bar`` and ``note``.

Bars (issue 41), on 2 GPUs: the block in FP8 >= 1.4x BF16, communication
included, with an all-gather of <= 55% of BF16's bytes; the ``bar``
column checks both against each lowbit recipe that gathers x in FP8
(tensorwise, delayed).

``lowbit:tensorwise, scatter overlap`` and ``lowbit:delayed, scatter
overlap``: the same blocks compiled with Inductor's
``reorder_for_peak_memory`` off. Their column layer's backward starts dx's
reduce-scatter before the weight gradient's GEMM and waits for it after
(lowbit.fp8_parallel); by default Inductor's peak-memory reordering moves
the wait before that GEMM, and the two run one after the other.

torchao (0.18, a benchmark-only dependency): the same block converted
with ``convert_to_float8_training`` (tensorwise) and parallelized over
DTensor with ``Float8ColwiseParallel(input_layouts=Shard(0))`` and
``Float8RowwiseParallel(output_layouts=Shard(0))``: the same TP + SP
layout, x all-gathered in FP8, the output reduce-scattered. Its row reads
n/a with the reason where torchao is not importable or the block fails
(gloo, for one, has no FP8 all-gather). This provider has not run on GPUs
yet.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowbit.bench.harness import Hardware
from lowbit.fp8_parallel import FP8_GATHER_RECIPES

WORLD = 2
SEQ_PER_GPU, D, HIDDEN = 8192, 4096, 14336
RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")
BAR_X_BF16 = 1.4
BAR_BYTES = 0.55
COLUMNS = ["provider", "tokens/GPU", "us", "x_bf16", "x_allgather_MB", "%floor", "bar", "note"]


class Bf16ParallelLinear(nn.Module):
    """The BF16 baseline: this rank's shard of ``linear`` with the
    collectives of lowbit.fp8_parallel around ``F.linear``."""

    def __init__(self, linear: nn.Linear, parallel: str, process_group, sequence_parallel: bool):
        super().__init__()
        from lowbit.fp8_parallel import shard_of

        self.parallel, self.process_group, self.sequence_parallel = parallel, process_group, sequence_parallel
        self.weight = nn.Parameter(shard_of(linear.weight.detach(), parallel, process_group).clone())
        self.bias = nn.Parameter(shard_of(linear.bias.detach(), parallel, process_group, dim_of_bias=True).clone())

    def forward(self, x):
        from lowbit.fp8_parallel import group_name, parallel_input, parallel_output

        group = group_name(self.process_group)
        column = self.parallel == "column"
        x = parallel_input(x, self.parallel, group, self.sequence_parallel)
        y = F.linear(x, self.weight, self.bias if column else None)
        return parallel_output(y, None if column else self.bias, self.parallel, group, self.sequence_parallel)


OVERLAP = ", scatter overlap"  # the provider compiled with Inductor's peak-memory reordering off


def provider_names() -> list[str]:
    return (["bf16"] + [f"lowbit:{r}" for r in RECIPES] + [f"lowbit:{r}{OVERLAP}" for r in FP8_GATHER_RECIPES]
            + ["lowbit:tensorwise, bf16 all-gather", "torchao"] + ["all-gather x: bf16", "all-gather x: fp8"])


def gathers_fp8(name: str) -> bool:
    """Whether provider ``name``'s column layer all-gathers x in FP8."""
    if name == "torchao":
        return True
    if not name.startswith("lowbit:") or name.endswith("bf16 all-gather"):
        return False
    return name.split(":", 1)[1].split(",")[0] in FP8_GATHER_RECIPES


def compile_options(name: str, backend: str) -> dict | None:
    """Inductor options of provider ``name``: the OVERLAP rows keep the
    backward's order (dx's reduce-scatter started before the dW GEMM, waited
    after it), which Inductor's peak-memory reordering undoes by default."""
    return {"reorder_for_peak_memory": False} if name.endswith(OVERLAP) and backend == "inductor" else None


def _block(provider: str, up: nn.Linear, down: nn.Linear, pg) -> nn.Module:
    from lowbit.nn import Fp8Linear

    if provider == "bf16":
        layers = [Bf16ParallelLinear(up, "column", pg, True), Bf16ParallelLinear(down, "row", pg, True)]
    else:
        recipe = provider.split(":")[1].split(",")[0]
        fp8_ag = not provider.endswith("bf16 all-gather")
        layers = [Fp8Linear.from_linear(up, recipe, parallel="column", process_group=pg, sequence_parallel=True,
                                        fp8_all_gather=fp8_ag),
                  Fp8Linear.from_linear(down, recipe, parallel="row", process_group=pg, sequence_parallel=True)]
    return nn.Sequential(layers[0], nn.GELU(approximate="tanh"), layers[1])


def block_tensors(device, seq: int, d: int, hidden: int) -> tuple:
    """(up, down, x, dy): the block's whole layers (BF16, the same on every
    rank: one seed), this rank's input tokens (requiring grad) and output
    gradient."""
    gen = torch.Generator().manual_seed(0)
    up = nn.Linear(d, hidden)
    down = nn.Linear(hidden, d)
    with torch.no_grad():
        for p in (*up.parameters(), *down.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    up, down = up.to(device, torch.bfloat16), down.to(device, torch.bfloat16)
    x = torch.randn(seq, d, generator=gen).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(seq, d, generator=gen).to(device, torch.bfloat16)
    return up, down, x, dy


def _torchao_block(up: nn.Linear, down: nn.Linear, pg) -> nn.Module:
    """The block in torchao's float8 training (tensorwise) under its DTensor
    tensor + sequence parallelism (module docstring); ImportError without
    torchao."""
    import copy

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    block = nn.Sequential(copy.deepcopy(up), nn.GELU(approximate="tanh"), copy.deepcopy(down))
    convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    mesh = DeviceMesh.from_group(pg, up.weight.device.type)
    return parallelize_module(block, mesh, {"0": Float8ColwiseParallel(input_layouts=Shard(0)),
                                            "2": Float8RowwiseParallel(output_layouts=Shard(0))})


def _timer(device):
    """now() in seconds, after the device's queued work."""
    def now():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


def build_and_time(rank: int, world: int, device, seq: int, d: int, hidden: int, use_graph: bool,
                   samples: int = 10, reps: int = 5, backend: str = "inductor") -> dict:
    """On every rank: each provider's step compiled and timed in turns.
    Returns {provider: seconds per step (this rank)} and the notes of those
    that could not run. Collective-safe: every rank runs the same calls in
    the same order (an exception on one rank is raised on all by the
    all-reduce of a failure flag)."""
    pg = dist.group.WORLD
    up, down, x, dy = block_tensors(device, seq, d, hidden)
    steps, notes = {}, {}
    # Every provider's block is nn.Sequential.forward, one code object
    # compiled once per provider: past Dynamo's default limit of 8 the last
    # providers (torchao's) would fail under fullgraph=True.
    with torch._dynamo.config.patch(recompile_limit=max(64, 2 * len(provider_names()))):
        for name in provider_names():
            if name.startswith("all-gather"):
                from lowbit.fp8_parallel import _all_gather, group_name

                src = x.detach() if name.endswith("bf16") else x.detach().to(torch.float8_e4m3fn).view(torch.uint8)
                steps[name] = lambda src=src: _all_gather(src, group_name(pg))
                continue
            failed = torch.zeros(1, device=device)
            try:
                module = _torchao_block(up, down, pg) if name == "torchao" else _block(name, up, down, pg)
                block = torch.compile(module, backend=backend, fullgraph=True, options=compile_options(name, backend))

                def step(block=block):
                    y = block(x)
                    torch.autograd.grad(y, [x, *block.parameters()], dy)

                for _ in range(2):
                    step()
            except Exception as e:  # reported in the row; the other ranks learn of it below
                notes[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
                failed += 1
            dist.all_reduce(failed)
            if failed.item():
                notes.setdefault(name, "failed on another rank")
                continue
            steps[name] = step
    runs = {}
    for name, step in steps.items():
        if use_graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            runs[name] = graph.replay
        else:
            runs[name] = step
    now = _timer(torch.device(device))
    times = {name: [] for name in runs}
    for _ in range(2):  # warm-up
        for run in runs.values():
            run()
    for _ in range(samples):
        for name, run in runs.items():
            start = now()
            for _ in range(reps):
                run()
            times[name].append((now() - start) / reps)
    return {"times": {n: statistics.median(t) for n, t in times.items()}, "notes": notes}


def make_rows(hw: Hardware | None, seq: int, d: int, hidden: int, world: int, times: dict, notes: dict) -> list[dict]:
    """Rows from the slowest rank's seconds per step (module docstring)."""
    tokens = seq * world
    gemm_flops = 2 * 3 * 2.0 * tokens * d * hidden / world  # two layers, three GEMMs each, per GPU
    bf16 = times.get("bf16")
    gathered = {"bf16": tokens * d * 2, "fp8": tokens * d}
    rows = []
    for name in provider_names():
        row = {"provider": name, "tokens/GPU": seq}
        t = times.get(name)
        if t is None:
            row.update({"us": "n/a", "note": notes.get(name, "not run")})
            rows.append(row)
            continue
        row["us"] = t * 1e6
        if name.startswith("all-gather"):
            row["x_allgather_MB"] = gathered[name.rsplit(" ", 1)[1]] / 1e6
            rows.append(row)
            continue
        fp8_gather = gathers_fp8(name)
        row["x_allgather_MB"] = gathered["fp8" if fp8_gather else "bf16"] / 1e6
        if bf16 is not None:
            row["x_bf16"] = bf16 / t
        if hw is not None:
            peak = hw.bf16_flops if name == "bf16" else hw.fp8_flops
            row["%floor"] = 100 * gemm_flops / peak / t
        if fp8_gather and name.startswith("lowbit:") and bf16 is not None:
            missed = []
            if row["x_bf16"] < BAR_X_BF16:
                missed.append(f"x_bf16 < {BAR_X_BF16}")
            if gathered["fp8"] / gathered["bf16"] > BAR_BYTES:
                missed.append(f"all-gather bytes > {BAR_BYTES:.0%} of BF16's")
            row["bar"] = "MISS: " + ", ".join(missed) if missed else "ok"
        if name in notes:
            row["note"] = notes[name]
        rows.append(row)
    return rows


def _slowest(result: dict, device) -> dict:
    """Every rank's times reduced to the slowest (max)."""
    names = sorted(result["times"])
    t = torch.tensor([result["times"][n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(names, t.tolist()))


def _worker(rank: int, world: int, init_file: str, out_file: str, hw_dict: dict | None) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                           device_id=torch.device("cuda", rank))
    try:
        device = torch.device("cuda", rank)
        result = build_and_time(rank, world, device, SEQ_PER_GPU, D, HIDDEN, use_graph=True)
        times = _slowest(result, device)
        if rank == 0:
            torch.save({"times": times, "notes": result["notes"]}, out_file)
    finally:
        dist.destroy_process_group()


def run(hw: Hardware, quick: bool):
    """The suite (``quick`` changes nothing: one block shape)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=device)
        result = build_and_time(rank, world, device, SEQ_PER_GPU, D, HIDDEN, use_graph=True)
        times = _slowest(result, device)
        notes = result["notes"]
    else:
        world = WORLD
        if torch.cuda.device_count() < world:
            why = f"needs {world} GPUs, found {torch.cuda.device_count()}"
            return make_rows(hw, SEQ_PER_GPU, D, HIDDEN, world, {}, {n: why for n in provider_names()}), COLUMNS
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.pt")
            mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), out, None), nprocs=world)
            got = torch.load(out)
        times, notes = got["times"], got["notes"]
    return make_rows(hw, SEQ_PER_GPU, D, HIDDEN, world, times, notes), COLUMNS
