"""Where the time of one FP8 training step goes (development tool): forward
and backward of one Fp8Linear per recipe (nn.Linear for "bf16", torchao's
float8 training for "torchao:<recipe>"; "<recipe>:exact" with the forward
GEMM promoting to FP32, fast_accum=False), compiled (fullgraph), under
torch.profiler; prints each kernel's time per step, largest first.

  python scripts/profile_fp8_train.py [M K N] [recipe ...]
"""

import sys

import torch
from torch import nn

from lowbit.bench.harness import profile_kernels
from lowbit.nn import Fp8Linear

args = sys.argv[1:]
m, k, n = (int(v) for v in args[:3]) if len(args) >= 3 else (16384, 4096, 14336)
recipes = args[3:] or ["bf16", "tensorwise", "delayed", "rowwise", "blockwise"]
STEPS = 5

base = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
for recipe in recipes:
    if recipe == "bf16":
        layer = base
    elif recipe.startswith("torchao:"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        layer = convert_to_float8_training(base, config=Float8LinearConfig.from_recipe_name(recipe.split(":")[1]))
    elif recipe.endswith(":exact"):
        from lowbit import Fp8Recipe

        layer = Fp8Linear.from_linear(base, recipe=Fp8Recipe(recipe.split(":")[0], fast_accum=False))
    else:
        layer = Fp8Linear.from_linear(base, recipe=recipe)
    compiled = torch.compile(layer, fullgraph=True)

    def step():
        y = compiled(x)
        torch.autograd.grad(y, (x, layer.weight), dy)

    kernels, total = profile_kernels(step, STEPS, name_chars=90)
    # The same step replayed as a CUDA graph (as the benchmark times it):
    # what the kernels' sum leaves out (gaps, clocks) shows as the difference.
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    replay_us = start.elapsed_time(end) * 1e3 / 20
    print(f"\n## {recipe}  M={m} K={k} N={n}: {total:.0f} us of kernels per step, "
          f"{replay_us:.0f} us per CUDA-graph replay")
    for name, us, count in kernels[:12]:
        print(f"  {us:9.1f} us  x{count:<2d} {name}")
