"""Recipes train for real: one end to end through `python -m recipes.run`, two in process."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import lightning as L
import torch

import remat.costs
import remat.dynamo_backend
from recipes import load_recipe, run_recipe

from .conftest import REPO, RECIPES_DIR

# Cross-entropy of a uniform guess: what an untrained classifier scores.
LN10 = math.log(10)
LN256 = math.log(256)


def _summary(text: str) -> dict[str, str]:
    block = text.split("== summary ==\n", 1)[1]
    return dict(line.split(": ", 1) for line in block.strip().splitlines())


def test_cli_runs_plain_cnn_recipe_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.run", str(RECIPES_DIR / "cnn_plain.yaml"),
         "trainer.max_steps=5", "trainer.print_every_n_steps=5"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # One line for the config (the YAML only with --print-config), no progress bar in a pipe,
    # none of the lines we cannot act on: c10's profiler line (NOTE [ Frees the profiler cannot
    # size ]), Lightning's LeafSpec warning (NOTE [ Lightning's LeafSpec warning ]).
    assert out.startswith(f"config: {RECIPES_DIR / 'cnn_plain.yaml'} + 2 overrides "
                          "(trainer.max_steps=5, trainer.print_every_n_steps=5); full config: "
                          "--print-config\n")
    assert "max_steps:" not in out and "resolved recipe" not in out
    for unwanted in ("CPUAllocator", "Memory block of unknown size", "LeafSpec", "\r"):
        assert unwanted not in proc.stderr, proc.stderr
    assert re.search(r"^step 5/5  train_loss \d+\.\d{4}  step_time \d+\.\d ms$", out, re.M)
    s = _summary(out)
    assert s["steps"] == "5"
    assert s["mean step time"].endswith(" ms (over 3 steps; first and memory-measured steps excluded)")
    assert float(s["mean step time"].split(" ms")[0]) > 0
    assert re.fullmatch(r"\d+\.\d\d s = setup \d+\.\d\d s \+ training \d+\.\d\d s \+ wrap-up "
                        r"\d+\.\d\d s", s["fit time"]), s["fit time"]
    assert re.fullmatch(r"\d+\.\d\d s before the first step; no plugin", s["setup"])
    assert re.fullmatch(r"\d+\.\d\d s for 5 steps, \d+\.\d\d ms/step \(data loading and "
                        r"validation during fit included\)", s["training"]), s["training"]
    assert abs(float(s["train_loss first"]) - LN10) < 0.3  # untrained 10-class guess
    assert 0.0 <= float(s["val_acc"]) <= 1.0 and math.isfinite(float(s["val_loss"]))
    assert s["legend"].startswith("train_loss = training cross-entropy per image, in nats; "
                                  "val_acc = validation accuracy, the fraction of images "
                                  "classified right; val_loss = ")
    # the step allocates at least the new gradients (4 bytes a parameter), and far less than 64 MiB
    peak = s["peak memory (step 5)"]
    assert peak.endswith(" MiB allocated inside the step on cpu (remat.track_memory)")
    peak_bytes = float(peak.split(" MiB")[0]) * 2**20
    assert 4 * int(s["parameters"]) < peak_bytes < 64 * 2**20
    assert "peak memory (fit)" not in s  # CUDA only
    assert s["data"].startswith("scikit-learn digits, 1437 train / 360 val images")
    assert list(tmp_path.iterdir()) == []  # no logs, checkpoints or outputs/ by default


def test_digits_cnn_learns(recipe_path):
    lines: list[str] = []
    recipe = load_recipe(recipe_path("cnn_plain.yaml"), ["trainer.max_steps=40", "optim.warmup_steps=5"])
    summary = run_recipe(recipe, printer=lines.append)
    assert summary.steps == 40 and len(summary.train_losses) == 40
    assert summary.step_peak_step == 40 and summary.timed_steps == list(range(1, 39))
    assert summary.val_metrics["val_acc"] > 0.9
    assert summary.final_train_loss < 0.5 * summary.first_train_loss
    assert lines[-1].startswith("== summary ==")


def test_gpt_lm_learns(recipe_path):
    overrides = [
        "trainer.max_steps=25", "model.n_layer=2", "model.n_embd=64", "model.block_size=64",
        "trainer.limit_val_batches=4", "optim.warmup_steps=5",
    ]
    summary = run_recipe(load_recipe(recipe_path("gpt_plain.yaml"), overrides), printer=lambda _: None)
    assert abs(summary.first_train_loss - LN256) < 0.3
    assert summary.final_train_loss < summary.first_train_loss - 1.5
    val = summary.val_metrics
    assert val["val_loss"] < LN256 - 1.5
    assert math.isclose(val["val_ppl"], math.exp(val["val_loss"]), rel_tol=1e-5)
    assert math.isclose(val["val_bpb"], val["val_loss"] / math.log(2), rel_tol=1e-5)


class _ProfilesLastStep(L.Callback):
    """Stands in for a callback that runs its own torch.profiler during a step."""

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == trainer.max_steps - 1:
            self.prof = torch.profiler.profile(profile_memory=True)
            self.prof.__enter__()

    def on_train_batch_end(self, trainer, *args):
        if hasattr(self, "prof"):
            self.prof.__exit__(None, None, None)


def test_step_memory_is_not_reported_as_zero_under_another_profiler(recipe_path, monkeypatch):
    import recipes.train

    build = recipes.train.plugin_callbacks
    monkeypatch.setattr(recipes.train, "plugin_callbacks",
                        lambda r: {**build(r), "profiler": _ProfilesLastStep()})
    lines: list[str] = []
    summary = run_recipe(load_recipe(recipe_path("cnn_plain.yaml"), ["trainer.max_steps=2"]), printer=lines.append)
    assert summary.step_peak_bytes is None and summary.step_peak_step == 2
    assert "peak memory (step 2): n/a (another torch.profiler session was active in this step)" in lines[-1]


def test_gpt_remat_on_variable_length_batches_solves_a_few_times(recipe_path, monkeypatch):
    import recipes.train

    built = []
    original = recipes.train.plugin_callbacks

    def keep(recipe):
        callbacks = original(recipe)
        built.extend(callbacks.values())
        return callbacks

    monkeypatch.setattr(recipes.train, "plugin_callbacks", keep)
    # Op times modelled, not measured: which schedules the solver picks among near-equal ones
    # follows the measured times, and so does how often a bucket's schedule misses a batch's
    # share (NOTE [ A bucket solved for its batch ]). Pinned, the count checks the bucketing,
    # not the machine's load: with measured times this test saw 1 to 5 solves.
    measured = remat.dynamo_backend.measure_op_times

    def modelled_times(lowered, *args, **kwargs):
        costs = measured(lowered, *args, **kwargs)
        times = remat.costs.model_op_times(lowered)
        return costs._replace(times=times, rerun_times=times)

    monkeypatch.setattr(remat.dynamo_backend, "measure_op_times", modelled_times)
    overrides = ["trainer.max_steps=12", "model.n_layer=2", "model.n_embd=32", "model.block_size=64",
                 "data.min_length=16", "trainer.limit_val_batches=2", "optim.warmup_steps=2",
                 "remat.budget=65%", "remat.time_limit=10"]
    summary = run_recipe(load_recipe(recipe_path("gpt_remat_varlen.yaml"), overrides),
                         printer=lambda _: None)
    callback = next(c for c in built if type(c).__name__ == "HiRemateCallback")
    result = callback.results["net"]
    assert result.plan is not None
    # Twelve batches of different lengths in [16, 64]: one graph, every length priced on it,
    # and at most one solve per power-of-two bucket above the example's.
    assert len(result.plans) <= 3
    assert summary.final_train_loss < summary.first_train_loss
