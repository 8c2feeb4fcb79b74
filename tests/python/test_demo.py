"""The README's main job (python -m lowbit.demo) runs end to end."""

import re

import lowbit.demo


def test_demo_runs_on_cpu(capsys):
    assert lowbit.demo.main(["--device", "cpu", "--rows", "256", "--cols", "512", "--batch", "3"]) == 0
    out = capsys.readouterr().out
    assert "NVFP4" in out and "Nvfp4Linear" in out
    # the reported accuracy is the format's: ~9-10% relative error, cosine > 0.99
    cosines = [float(c) for c in re.findall(r"cosine =? ?([0-9.]+)", out)]
    assert len(cosines) == 2 and all(0.99 < c < 1.0 for c in cosines), out
