"""lowbit on a second GPU and a model spread over two (needs two GPUs).

Every op must give on cuda:1 exactly what it gives on cuda:0 (the same
kernels on the same kind of GPU are deterministic), and a model loaded with
a device_map must compute what it computes on one GPU, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import lowbit
from lowbit.nn import Nvfp4MoE

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

transformers = pytest.importorskip("transformers")

from hf_tiny_models import VOCAB, build  # noqa: E402
from test_checkpoint import nvfp4_state, write_checkpoint  # noqa: E402


def on_both(fn, *tensors):
    """fn's outputs from the same inputs on cuda:0 and on cuda:1."""
    outs = []
    for device in ("cuda:0", "cuda:1"):
        out = fn(*(t.to(device) for t in tensors))
        outs.append(out if isinstance(out, tuple) else (out,))
    for a, b in zip(*outs):
        assert b.device == torch.device("cuda:1")
        assert torch.equal(a.cpu(), b.cpu())


def test_ops_on_the_second_gpu():
    torch.manual_seed(0)
    w = torch.randn(512, 1024) * 0.02
    q = lowbit.nvfp4_quantize(w)
    on_both(lambda t: tuple(lowbit.nvfp4_quantize(t)), w)
    on_both(lambda p, s, g: lowbit.nvfp4_dequantize(p, s, g, torch.bfloat16), q.packed, q.block_scale, q.global_scale)
    wp, sp = lowbit.nvfp4_prepack(q.packed, q.block_scale)
    for m in (1, 16, 300, 3000):  # small-M, wide, wgmma and unpack + cuBLAS paths
        x = torch.randn(m, 1024).to(torch.bfloat16)
        on_both(lambda x, a, b, g: lowbit.nvfp4_linear(x, a, b, g), x, wp, sp, q.global_scale)

    moe = Nvfp4MoE.from_bf16(torch.randn(16, 256, 512).to(torch.bfloat16) * 0.02,
                             torch.randn(16, 512, 128).to(torch.bfloat16) * 0.02,
                             torch.randn(16, 512).to(torch.bfloat16) * 0.02, torch.randn(16) * 0.05,
                             k=4, score_func="sigmoid", n_group=4, topk_group=2)
    for m in (1, 64, 2048):
        x = torch.randn(m, 512).to(torch.bfloat16)
        outs = [moe.to(d)(x.to(d)).cpu() for d in ("cuda:0", "cuda:1")]
        assert torch.equal(*outs)
    logits = torch.randn(64, 256)
    on_both(lambda t: tuple(lowbit.topk(t, 8)), logits)
    on_both(lambda t: tuple(lowbit.route(t, None, 8)), logits)


@pytest.mark.parametrize("family", ["v3", "v4"])
def test_model_spread_over_two_gpus(family, tmp_path):
    model = build(family, "cpu")
    write_checkpoint(tmp_path, model, nvfp4_state(model))
    one = lowbit.load_pretrained(tmp_path, device="cuda:0", progress=False)
    halves = {"": "cuda:0", "model.layers.1": "cuda:1", "model.layers.2": "cuda:1", "model.norm": "cuda:1",
              "lm_head": "cuda:1"}
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 16), device="cuda:0")
    args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want, want_tokens = one(ids).logits, one.generate(ids, **args)
        for device_map in (halves, "auto"):
            two = lowbit.load_pretrained(tmp_path, device_map=device_map, progress=False)
            devices = {t.device for t in two.parameters()}
            assert devices == {torch.device("cuda:0"), torch.device("cuda:1")}, devices
            got = two(ids).logits
            assert got.device == ids.device  # the outputs come back to the input's device
            assert torch.equal(got, want)
            assert torch.equal(two.generate(ids, **args), want_tokens)
