"""The README's main job (python -m lowbit.demo) runs end to end."""

import re

import pytest

import lowbit.demo


def test_demo_runs_on_cpu(capsys):
    assert lowbit.demo.main(["--device", "cpu", "--rows", "256", "--cols", "512", "--batch", "3"]) == 0
    out = capsys.readouterr().out
    assert "NVFP4" in out and "Nvfp4Linear" in out and "NVFP4 MoE" in out
    # the reported accuracy is the format's: ~9-10% relative error, cosine > 0.99
    # for one quantized weight; three NVFP4 GEMMs in the MoE compound to ~16%
    cosines = [float(c) for c in re.findall(r"cosine =? ?([0-9.]+)", out)]
    assert len(cosines) == 3 and all(0.99 < c < 1.0 for c in cosines[:2]), out
    assert 0.97 < cosines[2] < 1.0, out
    # the MoE kernel reproduces the dequantized experts up to bf16 rounding
    kernel_err = float(re.search(r"relative error ([0-9.e+-]+) \(bf16 rounding", out).group(1))
    assert kernel_err < 5e-3, out
    # a transformers model saved and loaded back computes the same logits
    pytest.importorskip("transformers")
    assert "the loaded model's logits equal the quantized model's: True" in out, out
