"""Benchmark harness shared by every suite.

Timing: CUDA events around back-to-back CUDA-graph replays (as a serving
engine runs kernels), the median over many samples. Each graph holds one call
per input set and the sets rotate through more memory than the L2 cache
holds, so every call starts with a cold L2. The GPU is kept busy while the
timed replays are enqueued, so a sample is GPU time, not the host's graph
submission latency (see time_calls). Providers compared in one row take their
samples in turns (time_calls_in_turns), so the card's clocks drift under all
of them alike.

Floors: peak HBM bandwidth (a large device-to-device copy, bytes read +
written) and dense BF16 / FP8 matmul throughput (8192^3 on random data) are
measured in the same run, so every row can be compared with what the card
does, not with a datasheet.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch


@dataclass
class Hardware:
    name: str
    sms: int
    l2_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float

    def floor_s(self, bytes_moved: float = 0.0, flops: float = 0.0, fp8: bool = False) -> float:
        """Lower bound on time: the larger of bytes / bandwidth and flops / peak."""
        peak = self.fp8_flops if fp8 else self.bf16_flops
        return max(bytes_moved / self.hbm_bytes_per_s, flops / peak)


def rotation_count(bytes_per_set: int, l2_bytes: int, minimum: int = 2, maximum: int = 64) -> int:
    """How many input sets make one pass over them at least 3x the L2 size."""
    if bytes_per_set <= 0:
        return minimum
    return max(minimum, min(maximum, math.ceil(3 * l2_bytes / bytes_per_set)))


WARM_MS = 30.0  # GPU time spent replaying before the timed replays
SAMPLE_MS = 1.0  # at least this much GPU time per timed sample


def time_calls(
    call: Callable[[int], Any], n_sets: int, use_graph: bool = True, replays: int = 30, warmup: int = 3
) -> float:
    """Median seconds per call of ``call(i)`` for i in range(n_sets).

    With ``use_graph`` the n_sets calls are captured once into a CUDA graph
    and the graph is replayed; otherwise the calls are launched eagerly.
    Each of the ``replays`` samples times enough back-to-back runs for
    SAMPLE_MS of GPU time, behind one untimed run that keeps the GPU busy
    while the host enqueues them: timing a single replay from an idle GPU
    also counts the host's graph submission (several us, a share of 1 /
    n_sets of it per call; 3-4 us per call for a 50 us call at 2 sets).
    """
    return time_calls_in_turns([(call, n_sets)], use_graph, replays, warmup)[0]


def time_calls_in_turns(
    providers: Sequence[tuple[Callable[[int], Any], int]],
    use_graph: bool = True,
    replays: int = 30,
    warmup: int = 3,
) -> list[float]:
    """time_calls for several providers (``(call, n_sets)`` each) whose
    samples are taken in turns: sample 1 of every provider, then sample 2,
    and so on. Timed one after the other, a provider's samples would see the
    clocks and temperature the providers before it left (a card under
    sustained load slows by up to 10-20%: docs/perf/README.md), so a ratio of two
    rows would carry the drift between them; in turns, every provider sees
    the same conditions.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            for call, n_sets in providers:
                for i in range(n_sets):
                    call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    runs = []
    for call, n_sets in providers:
        if use_graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(n_sets):
                    call(i)
            graph.replay()
            runs.append(graph.replay)
        else:
            runs.append(lambda call=call, n_sets=n_sets: [call(i) for i in range(n_sets)])

    def timed_ms(run: Callable[[], Any], times: int) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        run()  # untimed: the GPU is busy while the timed runs are enqueued
        start.record()
        for _ in range(times):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / times

    # Keep the GPU busy for a while first: after the host-side work between
    # rows (building weights) the clocks have dropped, and a short kernel's
    # first replays would otherwise time the clock ramp, not the kernel.
    torch.cuda.synchronize()
    run_ms = [0.0] * len(runs)
    busy_ms = 0.0
    while busy_ms < WARM_MS:
        for j, run in enumerate(runs):
            run_ms[j] = timed_ms(run, 8)
            busy_ms += 9 * run_ms[j]
    batches = [max(1, min(64, math.ceil(SAMPLE_MS / max(ms, 1e-6)))) for ms in run_ms]
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(replays):
        for j, run in enumerate(runs):
            times[j].append(timed_ms(run, batches[j]) / 1e3 / providers[j][1])
    return [statistics.median(t) for t in times]


def measure_hardware(device: torch.device | None = None) -> Hardware:
    """Measures the copy bandwidth and matmul peaks of the current GPU."""
    device = device or torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))

    n = 1 << 28  # 1 GiB of bytes per buffer, far beyond L2
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_s = time_calls(lambda i: dst.copy_(src), 1, use_graph=False, replays=20)
    hbm = 2 * n / copy_s
    del src, dst

    size = 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    mm_s = time_calls(lambda i: torch.mm(a, b), 1, use_graph=False, replays=10)
    bf16 = 2 * size**3 / mm_s

    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    mm8_s = time_calls(
        lambda i: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        1,
        use_graph=False,
        replays=10,
    )
    fp8 = 2 * size**3 / mm8_s
    return Hardware(props.name, props.multi_processor_count, l2, hbm, bf16, fp8)


def profile_kernels(step: Callable[[], Any], steps: int = 5, warmup: int = 3,
                    name_chars: int = 100) -> tuple[list[tuple[str, float, int]], float]:
    """``step`` run ``warmup`` times, then ``steps`` times under
    torch.profiler: its CUDA kernels as [(name, us per step, launches per
    step)], largest first, and the total us per step (development scripts'
    profiles)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = totals.setdefault(ev.name[:name_chars], [0.0, 0])
            t[0] += ev.device_time_total
            t[1] += 1
    rows = sorted(((n, us / steps, count // steps) for n, (us, count) in totals.items()), key=lambda r: -r[1])
    return rows, sum(r[1] for r in rows)


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def write_json(path: str, suite: str, hardware: Hardware, rows: list[dict]) -> None:
    payload = {
        "suite": suite,
        "hardware": asdict(hardware),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "rows": rows,
    }
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
