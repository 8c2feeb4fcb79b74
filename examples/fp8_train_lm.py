"""Trains a small byte-level decoder-only language model on the Python
standard library's source, once in BF16 and once per FP8 recipe (the Linear
layers of attention and MLP converted by lowbit.convert_to_fp8_training,
policy="all"; embeddings, norms and the output head stay BF16), with the
same initial weights and the same batches, and compares the loss curves.

    python examples/fp8_train_lm.py                      # 1000 steps per run, on the GPU
    python examples/fp8_train_lm.py --tiny --steps 20    # a smoke test on the CPU

Writes OUT/losses.csv (the training loss of every step and the validation
loss every --eval-every steps, one column per run), OUT/loss_curves.png
(matplotlib) or OUT/loss_curves.svg (without it), and OUT/summary.txt; prints
the final losses and their relative difference to BF16. The bar: every FP8
run ends within 2% of BF16's validation loss and never diverges.

The corpus: every .py file under the running interpreter's stdlib
directory (sysconfig), site-packages excluded, in sorted order; every 20th
file is held out for validation. Its size depends on the Python version,
which the summary records.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import lowbit

RUNS = ("bf16", "tensorwise", "delayed", "rowwise", "blockwise")
# Runs beyond the default set, by name: a recipe with other options.
EXTRA_RUNS = {"tensorwise-e5m2": lowbit.Fp8Recipe("tensorwise", grad_format="e5m2")}
SIZES = {
    # About 43M parameters and 8k tokens a step: about a minute per 1000 steps on one H100.
    "full": dict(d=768, layers=6, heads=12, ffn=3072, seq=512, batch=16, lr=6e-4, warmup=100, max_files=None),
    "tiny": dict(d=128, layers=2, heads=2, ffn=512, seq=64, batch=8, lr=3e-3, warmup=2, max_files=150),
}
VAL_EVERY_NTH_FILE = 20
BAR_REL = 0.02


def corpus_files(root: Path) -> list[Path]:
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted((p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)),
                  key=lambda p: p.relative_to(root).as_posix())


def load_corpus(max_files: int | None) -> tuple[torch.Tensor, torch.Tensor, str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = corpus_files(root)[:max_files]
    train, val = bytearray(), bytearray()
    for i, path in enumerate(files):
        (val if i % VAL_EVERY_NTH_FILE == 0 else train).extend(path.read_bytes() + b"\n")
    about = (f"Python {sys.version.split()[0]} stdlib {root}: {len(files)} files, "
             f"{len(train)} train bytes, {len(val)} validation bytes")
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8), about


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class ByteLM(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, ffn: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads, ffn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's initialisation; residual outputs scaled by depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def batch(data: torch.Tensor, starts: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    chunk = data[starts[:, None] + torch.arange(seq + 1, device=data.device)].long()
    return chunk[:, :-1], chunk[:, 1:]


def lm_loss(model, ids, targets) -> torch.Tensor:
    return F.cross_entropy(model(ids).float().flatten(0, 1), targets.flatten())


def train(run: str, args, cfg: dict, train_data, val_data, device) -> dict:
    torch.manual_seed(args.seed)  # the same initial weights for every run
    model = ByteLM(cfg["d"], cfg["layers"], cfg["heads"], cfg["ffn"], cfg["seq"]).to(device, torch.bfloat16)
    if run != "bf16":
        lowbit.convert_to_fp8_training(model, recipe=EXTRA_RUNS.get(run, run), policy="all", progress=False,
                                       filter_fn=lambda mod, name: name.startswith("blocks."))
    step_model = torch.compile(model) if args.compile else model
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg["lr"], betas=(0.9, 0.95))
    data_gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches for every run
    val_gen = torch.Generator().manual_seed(args.seed + 2)
    val_starts = torch.randint(0, len(val_data) - cfg["seq"] - 1, (args.val_batches, cfg["batch"]), generator=val_gen)

    def validate() -> float:
        model.eval()
        with torch.no_grad():
            losses = [lm_loss(step_model, *batch(val_data, s.to(device), cfg["seq"])) for s in val_starts]
        model.train()
        return torch.stack(losses).mean().item()

    train_losses, val_losses = [], {}
    diverged = False
    start = time.perf_counter()
    for step in range(args.steps):
        lr = cfg["lr"] * min(1.0, (step + 1) / cfg["warmup"])
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # cosine to a tenth
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_data) - cfg["seq"] - 1, (cfg["batch"],), generator=data_gen)
        loss = lm_loss(step_model, *batch(train_data, starts.to(device), cfg["seq"]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_losses.append(loss.detach())
        last = step + 1 == args.steps
        if (step + 1) % args.eval_every == 0 or last:
            val_losses[step + 1] = validate()
            latest = train_losses[-1].item()
            print(f"  {run:>10} step {step + 1:5d}  train {latest:.4f}  val {val_losses[step + 1]:.4f}", flush=True)
            if not (math.isfinite(latest) and math.isfinite(val_losses[step + 1])):
                diverged = True
                break
    elapsed = time.perf_counter() - start
    train_losses = torch.stack(train_losses).float().cpu().tolist()
    tokens = len(train_losses) * cfg["batch"] * cfg["seq"]
    print(f"  {run:>10} {len(train_losses)} steps in {elapsed:.1f} s ({tokens / elapsed:.0f} tokens/s, "
          f"compile included)", flush=True)
    return {"train": train_losses, "val": val_losses, "diverged": diverged}


def write_csv(path: Path, results: dict) -> None:
    steps = max(len(r["train"]) for r in results.values())
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["step"] + [f"{run}_{kind}" for run in results for kind in ("train", "val")])
        for s in range(1, steps + 1):
            row = [s]
            for r in results.values():
                row.append(f"{r['train'][s - 1]:.6f}" if s <= len(r["train"]) else "")
                row.append(f"{r['val'][s]:.6f}" if s in r["val"] else "")
            out.writerow(row)


def smooth(values: list[float], window: int = 20) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(out_dir: Path, results: dict, title: str) -> Path:
    """The smoothed training losses (PNG with matplotlib, SVG without)."""
    curves = {run: smooth(r["train"]) for run, r in results.items()}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_svg(out_dir / "loss_curves.svg", curves, title)
    # Left: the whole run (log scale, so a divergence or a slow start shows);
    # right: the validation loss, the quantity of the bar, over the second
    # half, where the runs' differences are visible.
    fig, (whole, val) = plt.subplots(1, 2, figsize=(12, 4.8))
    for run, ys in curves.items():
        whole.plot(range(1, len(ys) + 1), ys, label=run, linewidth=1.0)
    whole.set(xlabel="step", ylabel="training loss (20-step mean, nats/byte)", yscale="log", title="training loss")
    late = {run: {s: v for s, v in r["val"].items() if 2 * s >= len(r["train"])} for run, r in results.items()}
    for run, points in late.items():
        if points:
            val.plot(list(points), list(points.values()), marker="o", markersize=3, label=run, linewidth=1.0)
    val.set(xlabel="step", ylabel="validation loss (nats/byte)", title="validation loss, second half")
    for ax in (whole, val):
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.suptitle(title)
    path = out_dir / "loss_curves.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def read_csv(path: Path) -> dict:
    """The results a run wrote with write_csv (for --replot)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    runs = [c[: -len("_train")] for c in rows[0][1::2]]
    results = {run: {"train": [], "val": {}, "diverged": False} for run in runs}
    for row in rows[1:]:
        step = int(row[0])
        for i, run in enumerate(runs):
            train, val = row[1 + 2 * i], row[2 + 2 * i]
            if train:
                results[run]["train"].append(float(train))
            if val:
                results[run]["val"][step] = float(val)
    return results


def _plot_svg(path: Path, curves: dict, title: str) -> Path:
    w, h, pad = 800, 500, 60
    steps = max(len(ys) for ys in curves.values())
    lo = min(min(ys) for ys in curves.values()) * 0.95
    hi = lo / 0.95 * 1.6
    sx = lambda s: pad + (w - 2 * pad) * (s - 1) / max(steps - 1, 1)  # noqa: E731
    sy = lambda v: h - pad - (h - 2 * pad) * (min(max(v, lo), hi) - lo) / (hi - lo)  # noqa: E731
    colors = ["#000000", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
             f'font-size="12"><rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{w / 2}" y="25" text-anchor="middle" font-size="14">{title}</text>',
             f'<rect x="{pad}" y="{pad}" width="{w - 2 * pad}" height="{h - 2 * pad}" fill="none" stroke="#888"/>']
    for i in range(5):
        v = lo + (hi - lo) * i / 4
        parts.append(f'<text x="{pad - 5}" y="{sy(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for s in (1, steps // 2, steps):
        parts.append(f'<text x="{sx(s):.1f}" y="{h - pad + 18}" text-anchor="middle">{s}</text>')
    parts.append(f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">step (training loss, 20-step mean)</text>')
    for i, (run, ys) in enumerate(curves.items()):
        color = colors[i % len(colors)]
        points = " ".join(f"{sx(s + 1):.1f},{sy(v):.1f}" for s, v in enumerate(ys))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{points}"/>')
        parts.append(f'<text x="{w - pad - 5}" y="{pad + 18 + 16 * i}" text-anchor="end" fill="{color}">{run}</text>')
    path.write_text("\n".join(parts + ["</svg>"]) + "\n")
    return path


def summarize(results: dict) -> tuple[str, bool]:
    """Final losses (validation at the last step; training as the mean of
    the last 20 steps), their relative difference to BF16, and the bar."""
    lines = [f"{'run':>10}  {'train':>8}  {'val':>8}  {'val vs bf16':>11}  bar (within {BAR_REL:.0%}, no divergence)"]
    base = results.get("bf16")
    base_val = base["val"][max(base["val"])] if base and base["val"] else None
    ok = True
    for run, r in results.items():
        train = sum(r["train"][-20:]) / len(r["train"][-20:])
        val = r["val"][max(r["val"])] if r["val"] else float("nan")
        rel, verdict = "", ""
        if run != "bf16" and base_val is not None:
            d = (val - base_val) / base_val
            passed = not r["diverged"] and math.isfinite(d) and abs(d) <= BAR_REL
            ok &= passed
            rel, verdict = f"{d:+.2%}", "PASS" if passed else "MISS"
        if r["diverged"]:
            verdict = "MISS (diverged)"
            ok = False
        lines.append(f"{run:>10}  {train:8.4f}  {val:8.4f}  {rel:>11}  {verdict}")
    return "\n".join(lines), ok


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    known = RUNS + tuple(EXTRA_RUNS)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from {','.join(known)}")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--tiny", action="store_true", help="a small model and corpus, for a CPU smoke test")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on CUDA)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="fp8_train_lm_out")
    p.add_argument("--replot", action="store_true",
                   help="no training: draw OUT/loss_curves.png again from OUT/losses.csv")
    args = p.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    for r in args.runs:
        if r not in known:
            p.error(f"unknown run {r!r}: choose from {', '.join(known)}")
    if args.compile is None:
        args.compile = args.device.startswith("cuda")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.replot:
        results = read_csv(Path(args.out) / "losses.csv")
        steps = max(len(r["train"]) for r in results.values())
        print(f"# wrote {plot(Path(args.out), results, f'byte-level LM on the Python stdlib, {steps} steps')}")
        return results
    cfg = SIZES["tiny" if args.tiny else "full"]
    device = torch.device(args.device)
    train_cpu, val_cpu, about = load_corpus(cfg["max_files"])
    train_data, val_data = train_cpu.to(device), val_cpu.to(device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"# {about}\n# model {cfg}, {args.steps} steps, device {device}, compile {args.compile}", flush=True)
    results = {}
    for run in args.runs:
        torch._dynamo.reset()
        results[run] = train(run, args, cfg, train_data, val_data, device)
        write_csv(out_dir / "losses.csv", results)  # after every run: a late failure keeps the earlier ones
    summary, ok = summarize(results)
    title = f"byte-level LM on the Python stdlib, {args.steps} steps ({'tiny' if args.tiny else 'full'})"
    figure = plot(out_dir, results, title)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    text = f"# {about}\n# {device_name}, torch {torch.__version__}, model {cfg}\n{summary}\n"
    (out_dir / "summary.txt").write_text(text)
    print(summary)
    print(f"# wrote {out_dir / 'losses.csv'}, {figure}, {out_dir / 'summary.txt'}; bar {'met' if ok else 'missed'}")
    return results


if __name__ == "__main__":
    main()
