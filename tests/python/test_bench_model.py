"""The whole-model benchmark's logic on the CPU at toy sizes: the stacks
build from transformers' classes with their checkpoint-only state, the
floors follow the model's structure, and every row (BF16, lowbit w4a16 and
auto) comes out with lowbit's logits close to the BF16 model on the same
weights' NVFP4 round trip."""

import pytest
import torch

pytest.importorskip("transformers")

from lowbit.bench import model as bench_model  # noqa: E402
from lowbit.bench.harness import Hardware  # noqa: E402

HW = Hardware("test", 132, 50 << 20, 3e12, 800e12, 1400e12)


def test_real_configs_have_the_real_layer_sizes():
    v3 = bench_model.stack_config("v3")
    assert (v3.hidden_size, v3.moe_intermediate_size, v3.n_routed_experts, v3.num_experts_per_tok) == (7168, 2048, 256, 8)
    assert v3.num_hidden_layers == 3 and v3.first_k_dense_replace == 1
    v4 = bench_model.stack_config("v4")
    assert v4.num_hidden_layers == 3 and v4.mlp_layer_types == ["hash_moe", "moe", "moe"]
    assert v4.hidden_size == 4096 and v4.n_routed_experts == 256


def test_floor_counts_touched_experts():
    model = bench_model.build_stack("v3", "cpu", small=True)
    e, k = model.config.n_routed_experts, model.config.num_experts_per_tok
    one, all_ = (bench_model.weight_floor_bytes(model, b, 1.0) for b in (1, 10_000))
    expert = sum(p.numel() / p.shape[0] for n, p in model.named_parameters() if ".mlp.experts." in n)
    # Batch 1 reads k of each MoE layer's experts; a huge batch reads all.
    assert all_ - one == pytest.approx(expert * (e - k), rel=1e-6)
    assert bench_model.gemm_flops(model, 10) == pytest.approx(10 * bench_model.gemm_flops(model, 1))


@pytest.mark.slow
@pytest.mark.parametrize("family", bench_model.FAMILIES)
def test_rows_on_the_cpu(family):
    rows = bench_model.measure_family(HW, family, "cpu", batches=(1, 4), prefills=(24,), small=True, samples=1)
    assert [(r["phase"], r["tokens"], r["provider"]) for r in rows] == [
        (phase, n, p) for phase, sizes in (("decode", (1, 4)), ("prefill", (24,))) for n in sizes
        for p in bench_model.PROVIDERS]
    for r in rows:
        assert r["us"] > 0 and r["floor_us"] > 0
        if r["provider"] != "bf16":
            # lowbit against the BF16 model on the NVFP4 round trip of the
            # weights: BF16 rounding apart (the transformers tests bound the
            # same comparison by 1.5x the model's own BF16 noise, ~1e-2).
            assert 0 < r["logits_rel"] < 5e-2, r
    # Issue 42's bars sit on the V3 rows of "auto" that they name (here decode at batch 1).
    barred = [(r["phase"], r["tokens"], r["provider"]) for r in rows if "bar" in r]
    assert barred == ([("decode", 1, "lowbit:auto")] if family == "v3" else [])


def run_main_with_a_fake_suite(monkeypatch, argv):
    """python -m lowbit.bench with argv, bench model's run replaced by one
    that records the keyword arguments it gets; returns (rc, those)."""
    from lowbit.bench import __main__ as bench_main

    seen = {}

    def fake_run(hw, quick, out_dir=".", profile=False):
        seen.update(out_dir=out_dir, profile=profile)
        return [], bench_model.COLUMNS

    monkeypatch.setattr(bench_model, "run", fake_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_main, "measure_hardware",
                        lambda: Hardware("fake", 132, 50 * 2**20, 3e12, 7e14, 1.4e15))
    return bench_main.main(argv), seen


def test_decode_plot_goes_beside_the_json(monkeypatch, tmp_path):
    # python -m lowbit.bench model --json DIR/x.json writes its plot into DIR
    # (a GPU machine returns only what is under one folder).
    rc, seen = run_main_with_a_fake_suite(monkeypatch, ["model", "--quick", "--json", str(tmp_path / "rows.json")])
    assert rc == 0 and seen["out_dir"] == str(tmp_path)


def test_profile_lists_the_ops_of_a_step():
    # --profile's table: the GEMM-like ops of a step with their input shapes
    # and time per step, largest first; lowbit's ops among them.
    from lowbit.nn import Nvfp4Linear

    torch.manual_seed(0)
    dense = torch.nn.Linear(256, 128, bias=False)
    quant = Nvfp4Linear.from_linear(torch.nn.Linear(128, 64, bias=False))
    x = torch.randn(4, 256)
    total, ops = bench_model.profile_ops(lambda: quant(dense(x)), "cpu", steps=2)
    names = [r["op"] for r in ops]
    assert "lowbit::nvfp4_linear" in names and any(n in names for n in ("aten::mm", "aten::addmm")), ops
    assert total > 0 and all(r["us"] > 0 and r["calls"] >= 1 for r in ops)
    assert [r["us"] for r in ops] == sorted((r["us"] for r in ops), reverse=True)
    linear = ops[names.index("lowbit::nvfp4_linear")]
    assert linear["calls"] == 1 and "[4, 128]" in linear["shapes"], linear
    assert str(list(quant.weight.shape)) in linear["shapes"], linear
    text = bench_model.format_profile("toy step", total, ops)
    assert text.splitlines()[0].startswith("## profile: toy step:") and "lowbit::nvfp4_linear" in text


def test_profile_flag_reaches_the_suite(monkeypatch, capsys):
    rc, seen = run_main_with_a_fake_suite(monkeypatch, ["model", "--quick", "--profile"])
    assert rc == 0 and seen["profile"] is True
    with pytest.raises(SystemExit):  # a suite without a profile says so
        run_main_with_a_fake_suite(monkeypatch, ["quant", "--profile"])
    assert "--profile: suite 'quant' has no profile" in capsys.readouterr().err


@pytest.mark.slow
def test_decode_steps_compile():
    # The GPU run compiles the decode steps (Inductor); here the same tracing
    # on aot_eager: every provider's step compiles (no "compile failed" note)
    # and gives the eager step's logits.
    rows = bench_model.measure_family(HW, "v3", "cpu", batches=(1,), prefills=(16,), small=True, samples=1,
                                      compile_backend="aot_eager")
    decode = [r for r in rows if r["phase"] == "decode"]
    assert [r["provider"] for r in decode] == list(bench_model.PROVIDERS)
    assert all("note" not in r for r in decode), decode
    model = bench_model.build_stack("v3", "cpu", small=True)
    torch.manual_seed(0)
    eager, _ = bench_model._decode_step(model, "v3", 2, torch.device("cpu"))
    torch.manual_seed(0)  # the same token ids, a fresh cache of its own
    compiled, note = bench_model._decode_step(model, "v3", 2, torch.device("cpu"), "aot_eager")
    assert note == ""
    with torch.no_grad():
        want = eager()
        got = compiled()
    # aot_eager runs the same ops, some decomposed: BF16 rounding apart
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


def test_plot_from_saved_results(tmp_path, capsys):
    # The decode plot from a saved run's JSON, on a machine with matplotlib
    # (the GPU machine may have none); a file of another suite is refused.
    import json

    rows = [{"model": "v3", "phase": "decode", "tokens": b, "provider": p, "x_bf16": x}
            for b, x in ((1, 2.7), (8, 2.9), (64, 1.7)) for p in bench_model.PROVIDERS[1:]]
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps({"suite": "model", "rows": rows}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"suite": "linear", "rows": []}))
    with pytest.raises(SystemExit):
        bench_model.main(["--plot", str(other)])
    assert "is not a bench model result" in capsys.readouterr().err
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert bench_model.main(["--plot", str(saved)]) == 2
        assert "needs matplotlib" in capsys.readouterr().err
        return
    out = tmp_path / "decode.png"
    assert bench_model.main(["--plot", str(saved), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
