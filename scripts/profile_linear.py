"""One NVFP4 Linear call after warm-up, for a profiler (development tool):

  ncu -k regex:linear_ -c 1 python scripts/profile_linear.py K N M
"""

import sys

import torch

import lowbit

k, n, m = (int(v) for v in sys.argv[1:4])
w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
q = lowbit.nvfp4_quantize(w)
pw, ps = lowbit.nvfp4_prepack(q.packed, q.block_scale)
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    lowbit.nvfp4_linear(x, pw, ps, q.global_scale)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
lowbit.nvfp4_linear(x, pw, ps, q.global_scale)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
