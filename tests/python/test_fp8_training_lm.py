"""examples/fp8_train_lm.py, the FP8 training run, as a smoke test on the
CPU: a few steps of the tiny model train (finite losses that fall), the
CSV, the figure and the summary are written, and each FP8 recipe stays
near BF16."""

import csv
import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fp8_train_lm.py"



@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("fp8_train_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tiny(example, out, runs):
    return example.main(["--tiny", "--steps", "6", "--eval-every", "3", "--val-batches", "2", "--device", "cpu",
                         "--no-compile", "--runs", ",".join(runs), "--out", str(out)])


def check_trains(result):
    losses = result["train"]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and not result["diverged"]
    assert losses[-1] < losses[0] - 0.5, losses  # from about ln 256 = 5.5
    assert set(result["val"]) == {3, 6} and result["val"][6] < result["val"][3]


def test_corpus_is_the_stdlib_split_by_file(example):
    train, val, about = example.load_corpus(40)
    assert "40 files" in about and len(train) > 10 * len(val) > 0
    files = example.corpus_files(Path(example.sysconfig.get_paths()["stdlib"]))
    assert files == sorted(files) and not any("site-packages" in p.parts for p in files)


def test_bf16_run_trains_and_writes_its_outputs(example, tmp_path):
    results = run_tiny(example, tmp_path, ["bf16"])
    check_trains(results["bf16"])
    with open(tmp_path / "losses.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and rows[0].keys() == {"step", "bf16_train", "bf16_val"} and rows[2]["bf16_val"]
    assert (tmp_path / "loss_curves.png").exists() or (tmp_path / "loss_curves.svg").exists()
    assert "bf16" in (tmp_path / "summary.txt").read_text()
    # --replot draws the figure again from the CSV, which reads back as
    # the results it was written from (to its six decimals).
    for figure in tmp_path.glob("loss_curves.*"):
        figure.unlink()
    again = example.main(["--replot", "--out", str(tmp_path)])["bf16"]
    assert again["train"] == pytest.approx(results["bf16"]["train"], abs=1e-6)
    assert again["val"].keys() == results["bf16"]["val"].keys()
    assert list(again["val"].values()) == pytest.approx(list(results["bf16"]["val"].values()), abs=1e-6)
    assert (tmp_path / "loss_curves.png").exists() or (tmp_path / "loss_curves.svg").exists()


@pytest.mark.slow  # 8-40 s each on two busy CPU cores
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise", "blockwise", "tensorwise-e5m2"])
def test_fp8_run_trains_beside_bf16(example, tmp_path, recipe):
    results = run_tiny(example, tmp_path, ["bf16", recipe])
    check_trains(results[recipe])
    # Six steps from the same weights and batches: close to BF16 already.
    assert abs(results[recipe]["val"][6] / results["bf16"]["val"][6] - 1) < 0.05
    summary, _ = example.summarize(results)
    assert recipe in summary and "%" in summary


def test_extra_runs_take_their_recipe(example):
    recipe = example.EXTRA_RUNS["tensorwise-e5m2"]
    assert recipe.name == "tensorwise" and recipe.grad_format == "e5m2"
    with pytest.raises(SystemExit):
        example.parse_args(["--runs", "bf16,tensorwise-e4m4"])
