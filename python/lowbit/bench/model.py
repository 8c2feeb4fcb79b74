"""Whole models: DeepSeek-V3- and V4-shaped decoder stacks built from
transformers' own model classes at the real layer sizes (the configs'
defaults; a few layers: V3 one dense and two MoE layers, V4 a hash-routed
and two routed MoE layers), random weights (std 0.02), the checkpoint-only
state filled (``e_score_correction_bias``, V4's hash tables). Each stack
runs in BF16 and after ``lowbit.quantize_`` with ``compute="w4a16"`` and
``compute="auto"``:

- decode steps at batch 1, 8, 32, 64, each a forward of one token per
  sequence (V3: against a static cache of CONTEXT positions; V4, whose
  cache transformers' StaticCache does not hold: without a cache),
  compiled with torch.compile (Inductor, as serving engines compile their
  models: the attention's and norms' small ops fused) and then captured in
  a CUDA graph and replayed (a provider whose step cannot be compiled or
  captured runs eagerly, and says so);
- prefill of 2048 and 8192 tokens (one sequence, no cache), eagerly.

With ``--profile`` each decode step is also run under torch.profiler and
its GEMM-like ops (lowbit's ops, torch's matmuls and grouped / scaled GEMMs,
the attention) are printed by device time per step and input shape, below
the table: where a step's time goes, e.g. transformers' DeepseekV3
attention expanding its whole latent cache through ``kv_b_proj`` every
step. An op's time includes the ops it calls (lowbit's FP8 paths call
``aten::_scaled_mm``, listed too).

The decode plot (speedup against batch, PNG) goes beside the --json file
where matplotlib is installed; elsewhere ``python -m lowbit.bench.model
--plot RESULTS.json`` makes it from the saved rows.

The BF16 MoE runs transformers' grouped_mm experts (``torch._grouped_mm``).
Columns: ``us`` per step, ``x_bf16``, ``floor_us`` (decode: the weights a
step must read, at the measured bandwidth: every non-expert weight, the
shared expert, and the expected number of distinct routed experts that
batch tokens touch, each picking k of them uniformly; prefill: the step's GEMM FLOPs at the
measured peak, BF16 or FP8), ``%floor``, ``logits_rel`` (the relative
Frobenius distance of lowbit's logits from the BF16 model's on the same
weights' NVFP4 round trip, :func:`lowbit.quantize.nvfp4_round_trip_`,
measured on the prefill), ``bar`` (issue 42, V3 rows) and ``note``.

The BF16 model's weights are rounded through NVFP4 in place before it is
timed (its speed does not depend on the values), so that one model in
memory serves as the reference; ``quantize_`` then quantizes the rounded
weights, which NVFP4's rule maps back to the same codes (the block holding
the global maximum keeps scale 448 and code 6), so the reference is the
quantized model's own dequantized weights.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from lowbit.bench.harness import Hardware

FAMILIES = ("v3", "v4")
BATCHES = (1, 8, 32, 64)
PREFILLS = (2048, 8192)
CONTEXT = 512  # V3's static cache length for the decode steps (64 x 512 positions: 8 GB of cache over 3 layers)
PROVIDERS = ("bf16", "lowbit:w4a16", "lowbit:auto")
COLUMNS = ["model", "phase", "tokens", "provider", "us", "x_bf16", "floor_us", "%floor", "logits_rel", "bar",
           "note"]
# Issue 42's bars (V3 stack, "auto"): decode >= 3.0x BF16 at batch 1 and 8,
# >= 3.5x at 64; prefill of 2048 tokens >= 1.6x.
BARS = {("decode", 1): 3.0, ("decode", 8): 3.0, ("decode", 64): 3.5, ("prefill", 2048): 1.6}
NVFP4_BYTES_PER_WEIGHT = 0.5625  # 4-bit codes and an E4M3 scale per 16


def stack_config(family: str, small: bool = False):
    """The transformers config of a family's stack: real sizes, or (small)
    a toy one for the CPU test."""
    import transformers

    if family == "v3":
        if small:
            return transformers.DeepseekV3Config(
                vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=32,
                n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, n_shared_experts=1,
                max_position_embeddings=CONTEXT)
        return transformers.DeepseekV3Config(num_hidden_layers=3, first_k_dense_replace=1,
                                             max_position_embeddings=CONTEXT)
    base = transformers.DeepseekV4Config()
    kwargs = dict(num_hidden_layers=3, mlp_layer_types=["hash_moe", "moe", "moe"], layer_types=base.layer_types[:3],
                  num_nextn_predict_layers=0)
    if small:
        kwargs.update(vocab_size=512, hidden_size=256, moe_intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=64, q_lora_rank=128, num_experts_per_tok=2,
                      n_routed_experts=8, hc_mult=2, hc_sinkhorn_iters=3, o_groups=2, o_lora_rank=128,
                      index_n_heads=2, index_head_dim=32, index_topk=8, sliding_window=16,
                      max_position_embeddings=256)
    return transformers.DeepseekV4Config(**kwargs)


def build_stack(family: str, device, small: bool = False) -> torch.nn.Module:
    """The family's stack in BF16 on ``device``, random weights, the
    checkpoint-only state filled, BF16 experts on grouped_mm."""
    import transformers

    cfg = stack_config(family, small)
    cfg._experts_implementation = "grouped_mm"
    cls = transformers.DeepseekV3ForCausalLM if family == "v3" else transformers.DeepseekV4ForCausalLM
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in BF16: an FP32 build of the real sizes would not fit
    try:
        with torch.device(device):
            model = cls(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.05)
            if name.endswith("tid2eid"):
                n = cfg.n_routed_experts
                buf.copy_(torch.rand(buf.shape[0], n, device=buf.device).argsort(dim=1)[:, : buf.shape[1]])
    return model


def weight_floor_bytes(model: torch.nn.Module, batch: int, bytes_per_weight: float) -> float:
    """The weights one decode step of ``batch`` tokens reads (module
    docstring), in bytes; computed from the BF16 model's structure."""
    cfg = model.config
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)  # expected distinct experts: each token picks k of e uniformly
    total = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name:  # norms, biases; an embedding reads only its rows
            continue
        if ".mlp.experts." in name:
            total += p.numel() / p.shape[0] * touched  # [experts, ...]: per expert
        else:
            total += p.numel()
    return total * bytes_per_weight


def gemm_flops(model: torch.nn.Module, tokens: int) -> float:
    """2 x tokens x (weights a token multiplies): every non-expert weight
    plus k routed experts' (attention's own products not counted)."""
    cfg = model.config
    per_token = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name:
            continue
        per_token += p.numel() / p.shape[0] * cfg.num_experts_per_tok if ".mlp.experts." in name else p.numel()
    return 2.0 * tokens * per_token


def _decode_step(model, family, batch, device, backend: str | None = None) -> tuple:
    """(a callable running one decode step, its inputs kept alive; a note).
    ``backend``: the step compiled with torch.compile on that backend, as a
    serving engine compiles its model (a step that does not compile runs
    eagerly, and the note says why)."""
    import transformers

    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    forward = model
    if backend is not None:
        torch._dynamo.reset()  # each (provider, batch) its own compiled code: no cache-size limit reached
        forward = torch.compile(model, backend=backend, dynamic=False)
    if family == "v3":
        cache = transformers.StaticCache(config=model.config, max_cache_len=CONTEXT)
        pos = torch.tensor([CONTEXT - 1], device=device)
        step = lambda: forward(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True).logits  # noqa: E731
    else:
        step = lambda: forward(input_ids=ids, use_cache=False).logits  # noqa: E731
    if backend is None:
        return step, ""
    try:
        with torch.no_grad():
            step()  # compiles here, outside any timing or capture
        return step, ""
    except Exception as e:
        torch._dynamo.reset()
        eager, _ = _decode_step(model, family, batch, device)
        return eager, f"eager (compile failed: {type(e).__name__})"


def _time(fn, device, use_graph: bool, samples: int = 10, reps: int = 3) -> tuple[float, str]:
    """Median seconds per call; with use_graph a CUDA-graph replay (a step
    that cannot be captured is timed eagerly, with a note)."""
    note = ""
    run = fn
    with torch.no_grad():
        for _ in range(2):
            fn()
        if use_graph:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                run = graph.replay
            except Exception as e:  # e.g. a host synchronization inside the step
                note = f"eager (not capturable: {type(e).__name__})"
                torch.cuda.synchronize()
                run = fn
        times = []
        for _ in range(samples):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                run()
                start.record()
                for _ in range(reps):
                    run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / reps)
            else:
                t0 = time.perf_counter()
                for _ in range(reps):
                    run()
                times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times), note


# Ops --profile lists (name prefixes): lowbit's, and torch's GEMMs and attention.
PROFILED_OPS = ("lowbit::", "aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm", "aten::_scaled_mm",
                "aten::_scaled_grouped_mm", "aten::_scaled_dot_product")


def profile_ops(fn, device, steps: int = 3, top: int = 16) -> tuple[float, list[dict]]:
    """``fn`` (one step) under torch.profiler: (the step's kernel time in us,
    on the CPU its ops' time; the PROFILED_OPS by time per step and input
    shape, the ``top`` largest, each {op, shapes, us, calls} per step)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad():
        fn()  # warm: nothing compiles or allocates for the first time inside the profile
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities, record_shapes=True, acc_events=True) as prof:
            for _ in range(steps):
                fn()
            if cuda:
                torch.cuda.synchronize()
    events = prof.key_averages(group_by_input_shape=True)
    if cuda:
        total = sum(e.device_time_total for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        time_of = lambda e: e.device_time_total  # noqa: E731
    else:
        total = sum(e.self_cpu_time_total for e in events)
        time_of = lambda e: e.cpu_time_total  # noqa: E731
    ops = [{"op": e.key, "shapes": str(e.input_shapes), "us": time_of(e) / steps, "calls": e.count / steps}
           for e in events if e.key.startswith(PROFILED_OPS)]
    ops.sort(key=lambda r: -r["us"])
    return total / steps, ops[:top]


def format_profile(label: str, total_us: float, ops: list[dict]) -> str:
    lines = [f"## profile: {label}: {total_us:.1f} us per step (GPU: kernel time; CPU: op time), its top ops "
             "(an op's time includes the ops it calls)"]
    lines += [f"  {r['us']:9.1f} us  x{r['calls']:4.1f}  {r['op'][:36]:36s} {r['shapes'][:120]}" for r in ops]
    return "\n".join(lines)


def measure_family(hw: Hardware | None, family: str, device, batches=BATCHES, prefills=PREFILLS,
                   small: bool = False, samples: int = 10, compile_backend: str | None = None,
                   profile: bool = False) -> list[dict]:
    """Every row of one family (module docstring); ``compile_backend``: the
    decode steps compiled on that torch.compile backend (None: eager);
    ``profile``: each decode step's ops printed (profile_ops)."""
    import lowbit
    from lowbit.nn import Nvfp4Linear, Nvfp4MoE
    from lowbit.quantize import nvfp4_round_trip_

    device = torch.device(device)
    use_graph = device.type == "cuda"
    model = nvfp4_round_trip_(build_stack(family, device, small))
    floors = {b: weight_floor_bytes(model, b, 2.0) for b in batches}
    floors_q = {b: weight_floor_bytes(model, b, NVFP4_BYTES_PER_WEIGHT) for b in batches}
    flops = {t: gemm_flops(model, t) for t in prefills}
    prompt = torch.randint(0, model.config.vocab_size, (1, max(prefills)), device=device)
    times: dict = {}
    notes: dict = {}
    logits_rel: dict = {}

    def measure(provider):
        for b in batches:
            step, step_note = _decode_step(model, family, b, device, compile_backend)
            t, note = _time(step, device, use_graph, samples)
            times[provider, "decode", b] = t
            notes[provider, "decode", b] = "; ".join(n for n in (step_note, note) if n)
            if profile:
                print(format_profile(f"{family} decode batch {b} {provider}", *profile_ops(step, device)), flush=True)
        for n in prefills:
            ids = prompt[:, :n]
            t, _ = _time(lambda ids=ids: model(input_ids=ids, use_cache=False).logits, device, False,
                         max(2, samples // 3), reps=1)
            times[provider, "prefill", n] = t

    measure("bf16")
    with torch.no_grad():
        check = prompt[:, : min(prefills)]
        reference = model(input_ids=check, use_cache=False).logits.float()
    lowbit.quantize_(model, progress=False)
    for provider in PROVIDERS[1:]:
        mode = provider.split(":")[1]
        for m in model.modules():
            if isinstance(m, (Nvfp4Linear, Nvfp4MoE)):  # as quantize_(compute=mode) sets them
                m.compute = mode
        measure(provider)
        with torch.no_grad():
            got = model(input_ids=check, use_cache=False).logits.float()
        logits_rel[provider] = ((got - reference).norm() / reference.norm()).item()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()

    rows = []
    for phase, sizes in (("decode", batches), ("prefill", prefills)):
        for n in sizes:
            bf16 = times.get(("bf16", phase, n))
            for provider in PROVIDERS:
                t = times[provider, phase, n]
                row = {"model": family, "phase": phase, "tokens": n, "provider": provider, "us": t * 1e6}
                if bf16 is not None:
                    row["x_bf16"] = bf16 / t
                if hw is not None:
                    if phase == "decode":
                        floor = (floors if provider == "bf16" else floors_q)[n] / hw.hbm_bytes_per_s
                    else:
                        # "auto": the Linears' FP8 path from 256 rows, the experts' from 1024
                        fp8 = provider == "lowbit:auto"
                        floor = flops[n] / (hw.fp8_flops if fp8 else hw.bf16_flops)
                    row["floor_us"] = floor * 1e6
                    row["%floor"] = 100 * floor / t
                if provider != "bf16":
                    row["logits_rel"] = logits_rel[provider]
                need = BARS.get((phase, n))
                if family == "v3" and provider == "lowbit:auto" and need is not None:
                    row["bar"] = "ok" if row["x_bf16"] >= need else f"MISS: x_bf16 < {need}"
                if notes.get((provider, phase, n)):
                    row["note"] = notes[provider, phase, n]
                rows.append(row)
    return rows


def plot(rows: list[dict], path: str) -> str | None:
    """Decode speedup over BF16 against batch size, per family and mode
    (PNG; None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family in FAMILIES:
        for provider in PROVIDERS[1:]:
            pts = [(r["tokens"], r["x_bf16"]) for r in rows if r["model"] == family and r["phase"] == "decode"
                   and r["provider"] == provider and isinstance(r.get("x_bf16"), float)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{family} {provider.split(':')[1]}")
    ax.set(xscale="log", xlabel="decode batch (tokens per step)", ylabel="speedup over BF16",
           title="lowbit NVFP4 decode, DeepSeek-shaped stacks")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def run(hw: Hardware, quick: bool, out_dir: str = ".", profile: bool = False):
    """The suite; ``quick``: the V3 stack, batches 1 and 64, prefill 2048.
    The decode plot goes to ``out_dir`` (the --json file's folder);
    ``profile``: each decode step's ops printed as it is measured."""
    rows = []
    families = ("v3",) if quick else FAMILIES
    for family in families:
        try:
            rows += measure_family(hw, family, "cuda", batches=(1, 64) if quick else BATCHES,
                                   prefills=(2048,) if quick else PREFILLS, compile_backend="inductor",
                                   profile=profile)
        except Exception as e:  # one family failing leaves the other's rows
            rows.append({"model": family, "note": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
        torch.cuda.empty_cache()
    path = plot(rows, os.path.join(out_dir, "bench_model_decode.png"))
    if path:
        print(f"# decode speedup plot: {path}")
    return rows, COLUMNS


def main(argv: list[str] | None = None) -> int:
    """``python -m lowbit.bench.model --plot RESULTS.json [OUT.png]``: the
    decode plot from a saved run (``python -m lowbit.bench model --json``),
    for a GPU machine without matplotlib."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m lowbit.bench.model", description=main.__doc__.splitlines()[0])
    parser.add_argument("--plot", required=True, metavar="RESULTS.json", help="a bench model --json file")
    parser.add_argument("out", nargs="?", help="the PNG to write (default: beside RESULTS.json)")
    args = parser.parse_args(argv)
    with open(args.plot) as f:
        payload = json.load(f)
    if payload.get("suite") != "model" or not isinstance(payload.get("rows"), list):
        parser.error(f"--plot: {args.plot} is not a bench model result (expected suite 'model' and its rows)")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.plot)), "bench_model_decode.png")
    if plot(payload["rows"], out) is None:
        print("lowbit.bench.model: the plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
