"""FP8 training Linear: forward + backward of one layer (y = x W^T, then
dx and dW from dy) for each lowbit recipe (lowbit.nn.Fp8Linear), beside
nn.Linear in BF16 (cuBLAS) and torchao's float8 training
(convert_to_float8_training with Float8LinearConfig.from_recipe_name:
tensorwise, rowwise, rowwise_with_gw_hp), all under
torch.compile(fullgraph=True) and timed the same way (CUDA graphs of the
whole step, cold L2 via rotating input sets, samples taken in turns:
harness.time_calls_in_turns).

"lowbit:auto" is what lowbit.convert_to_fp8_training gives with its
default policy and recipe (tensorwise, FP8 from its measured token
crossover on, BF16 below): its bar is >= 0.97x BF16 on every shape.

torchao is optional: without it (or with an import error) its rows read
"n/a" and the note says why. The reference version is 0.18.0.

One row per shape and provider. Columns: us (per step), TFLOP/s (three
GEMMs of 2 M N K), x_bf16 (BF16's time over this one), peer and x_peer
(torchao's corresponding recipe and its time over this one; lowbit rows
only), %floor, bar (lowbit rows: the targets of issue 40, below) and note.

Floor: the three GEMMs at the measured FP8 peak plus the bytes at the
measured bandwidth, added (the casts are passes of their own, apart from
the GEMMs): 3 x 2 M N K FLOPs, and each BF16 tensor read or written once
(x, W, dy read; y, dx, dW written: 2 (2 M K + 2 N K + 2 M N) bytes).
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.bench.harness import Hardware, format_table, rotation_count, time_calls_in_turns

SHAPES = [  # (M tokens, K in, N out)
    (16384, 4096, 14336), (16384, 14336, 4096), (16384, 4096, 4096),
    (8192, 4096, 6144), (4096, 7168, 18432), (2048, 4096, 4096),
]
QUICK_SHAPES = [(16384, 4096, 14336), (2048, 4096, 4096)]

RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
TORCHAO_VERSION = "0.18.0"
# torchao's recipe each lowbit recipe is held against: torchao has dropped
# delayed scaling, so delayed meets its current-scaling tensorwise; it has no
# blockwise recipe in convert_to_float8_training.
PEER = {"tensorwise": "tensorwise", "delayed": "tensorwise", "rowwise": "rowwise", "blockwise": None}

# Issue 40's targets: these speedups over BF16 on BAR_SHAPES, and faster
# than the peer recipe on every shape.
BAR_SHAPES = SHAPES[:2]
BAR_X_BF16 = {"tensorwise": 1.60, "delayed": 1.65, "rowwise": 1.40, "blockwise": 1.40}
AUTO_BAR_X_BF16 = 0.97  # the default policy, on every shape

COLUMNS = ["M", "K", "N", "provider", "us", "TFLOP/s", "x_bf16", "peer", "x_peer", "%floor", "bar", "note"]


def floor_s(hw: Hardware, m: int, k: int, n: int) -> float:
    """The step's floor (module docstring): GEMMs at the FP8 peak plus bytes at the bandwidth."""
    flops = 3 * 2.0 * m * n * k
    moved = 2 * (2 * m * k + 2 * n * k + 2 * m * n)
    return flops / hw.fp8_flops + moved / hw.hbm_bytes_per_s


def provider_names() -> list[str]:
    return ["bf16"] + [f"lowbit:{r}" for r in RECIPES] + ["lowbit:auto"] + [f"torchao:{r}" for r in TORCHAO_RECIPES]


def bar(shape: tuple[int, int, int], recipe: str, x_bf16: float, x_peer: float | None) -> str:
    """"ok", or "MISS: " and the targets missed; "(peer n/a)" when the
    torchao comparison could not be made."""
    missed = []
    need = BAR_X_BF16[recipe] if tuple(shape) in BAR_SHAPES else None
    if need is not None and x_bf16 < need:
        missed.append(f"x_bf16 < {need:.2f}")
    if PEER[recipe] is not None and x_peer is not None and x_peer <= 1.0:
        missed.append(f"not faster than torchao:{PEER[recipe]}")
    verdict = "MISS: " + ", ".join(missed) if missed else "ok"
    if PEER[recipe] is not None and x_peer is None:
        verdict += " (peer n/a)"
    return verdict


def make_rows(hw: Hardware, shape: tuple[int, int, int], times: dict[str, float | None],
              notes: dict[str, str]) -> list[dict]:
    """The rows of one shape from seconds per step by provider name
    (provider_names; None or absent: it did not run, notes says why)."""
    m, k, n = shape
    floor = floor_s(hw, m, k, n)
    flops = 6.0 * m * n * k
    bf16 = times.get("bf16")
    rows = []
    for name in provider_names():
        t = times.get(name)
        row = {"M": m, "K": k, "N": n, "provider": name, "floor_us": floor * 1e6}
        if t is None:
            row.update({"us": "n/a", "note": notes.get(name, "not run")})
            if name.startswith("lowbit:"):
                row["bar"] = "n/a"
            rows.append(row)
            continue
        row.update({"us": t * 1e6, "TFLOP/s": flops / t / 1e12, "%floor": 100 * floor / t})
        row["x_bf16"] = bf16 / t if bf16 is not None else "n/a"
        if name == "lowbit:auto":
            row["bar"] = "n/a" if bf16 is None else \
                "ok" if row["x_bf16"] >= AUTO_BAR_X_BF16 else f"MISS: x_bf16 < {AUTO_BAR_X_BF16:.2f}"
        elif name.startswith("lowbit:"):
            recipe = name.split(":", 1)[1]
            peer = PEER[recipe]
            t_peer = times.get(f"torchao:{peer}") if peer else None
            row["peer"] = f"torchao:{peer}" if peer else "-"
            row["x_peer"] = "-" if not peer else t_peer / t if t_peer is not None else "n/a"
            row["bar"] = bar(shape, recipe, row["x_bf16"], row["x_peer"] if t_peer is not None else None) \
                if bf16 is not None else "n/a"
        if name in notes:
            row["note"] = notes[name]
        rows.append(row)
    return rows


def torchao_float8():
    """(convert_to_float8_training, Float8LinearConfig, version) or the
    reason torchao cannot be used, as a string."""
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # an ImportError, or a torchao built for another torch
        return f"torchao not importable ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    return convert_to_float8_training, Float8LinearConfig, getattr(torchao, "__version__", "?")


def _layer_builders(ao) -> dict:
    from lowbit import convert_to_fp8_training
    from lowbit.nn import Fp8Linear

    def auto(lin):  # the layer (converted or kept) that the default policy leaves
        return convert_to_fp8_training(nn.Sequential(lin), progress=False)[0]

    builders = {"bf16": lambda lin: lin}
    for r in RECIPES:
        builders[f"lowbit:{r}"] = lambda lin, r=r: Fp8Linear.from_linear(lin, recipe=r)
    builders["lowbit:auto"] = auto
    if not isinstance(ao, str):
        convert, config, _ = ao
        for r in TORCHAO_RECIPES:
            # A root nn.Linear comes back as a new Float8Linear sharing its weight.
            builders[f"torchao:{r}"] = lambda lin, r=r: convert(lin, config=config.from_recipe_name(r))
    return builders


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:100] if text else ''}"


def build_steps(shape, ao, n_sets: int, device="cuda", backend="inductor") -> tuple[list, list, dict]:
    """For each provider that runs ``shape``: a step ``call(i)`` (forward
    and both gradients of set i, compiled with ``backend``, fullgraph),
    run once per set here (compiling it). Returns the providers as
    ``(call, n_sets)``, their names, and notes: why the others did not run."""
    m, k, n = shape
    bases = [nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16) for _ in range(n_sets)]
    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16).requires_grad_() for _ in range(n_sets)]
    dys = [torch.randn(m, n, device=device, dtype=torch.bfloat16) for _ in range(n_sets)]
    notes: dict[str, str] = {}
    if isinstance(ao, str):
        notes.update({f"torchao:{r}": ao for r in TORCHAO_RECIPES})
    providers, names = [], []
    for name, build in _layer_builders(ao).items():
        try:
            layers = [build(base) for base in bases]
            steps = [torch.compile(layer, backend=backend, fullgraph=True) for layer in layers]

            def call(i, steps=steps, layers=layers):
                y = steps[i](xs[i])
                torch.autograd.grad(y, (xs[i], layers[i].weight), dys[i])

            for i in range(n_sets):  # a provider that cannot run this shape says why here
                call(i)
            if device != "cpu":
                torch.cuda.synchronize()
        except Exception as e:
            notes[name] = _first_line(e)
            continue
        providers.append((call, n_sets))
        names.append(name)
    return providers, names, notes


def _time_shape(hw: Hardware, shape, ao, use_graph: bool) -> tuple[dict, dict]:
    m, k, n = shape
    n_sets = rotation_count(2 * (m * k + n * k + m * n), hw.l2_bytes, maximum=8)
    providers, names, notes = build_steps(shape, ao, n_sets)
    times = dict(zip(names, time_calls_in_turns(providers, use_graph=use_graph)))
    return times, notes


def run(hw: Hardware, quick: bool, shapes=None, use_graph: bool = True):
    """The suite; ``shapes`` (a list of (M, K, N)) runs others than the
    defaults, e.g. half of them per process."""
    for shape in shapes or ():
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"fp8_train: shapes are (M tokens, K in, N out), each >= 1; got {tuple(shape)}")
    ao = torchao_float8()
    if isinstance(ao, str):
        print(f"# {ao}: its rows are n/a")
    else:
        warn = "" if ao[2] == TORCHAO_VERSION else f" (the reference version is {TORCHAO_VERSION})"
        print(f"# torchao {ao[2]}{warn}")
    rows = []
    for shape in shapes or (QUICK_SHAPES if quick else SHAPES):
        # A fresh compile cache per shape: every provider's layer is one
        # code object compiled once per recipe and shape, and past the
        # recompile limit Dynamo would fall back to eager quietly.
        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
            times, notes = _time_shape(hw, tuple(shape), ao, use_graph)
        shape_rows = make_rows(hw, tuple(shape), times, notes)
        # Each shape's rows as soon as they are measured (a long run cut
        # short keeps them); the whole table follows at the end.
        print(format_table(shape_rows, COLUMNS), flush=True)
        rows += shape_rows
        torch.cuda.empty_cache()
    return rows, COLUMNS
