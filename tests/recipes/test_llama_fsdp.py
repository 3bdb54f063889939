"""Issue 33: ``recipes/llama_fsdp_remat.yaml`` trains a byte-level Hugging Face Llama sharded with
FSDP2 over 2 CPU processes, HiRemate at 50% of each rank's step, as a user runs it:
``python -m recipes.run recipes/llama_fsdp_remat.yaml`` (Lightning launches the second process).
"""
from __future__ import annotations

import csv
import os
import re
import subprocess
import sys

import pytest

from recipes import RecipeError, load_recipe

from .conftest import REPO, RECIPES_DIR

pytest.importorskip("transformers")
LLAMA = RECIPES_DIR / "llama_fsdp_remat.yaml"
MIB = 2**20


def run_recipe(root, *overrides: str) -> tuple[str, dict[str, str]]:
    """The run's output and its final validation metrics (rank 0's CSV log, as written)."""
    cmd = [sys.executable, "-m", "recipes.run", str(LLAMA), "trainer.max_steps=4",
           "trainer.limit_val_batches=2", "trainer.logger=true",
           f"trainer.default_root_dir={root}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    (log,) = root.glob("logs/version_*/metrics.csv")
    rows = [row for row in csv.DictReader(log.open()) if row.get("val_loss")]
    return proc.stdout, rows[-1]


def mib(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in the output:\n{text[-3000:]}"
    return float(found.group(1))


def test_the_llama_fsdp2_recipe_keeps_half_of_each_ranks_step_with_plain_fsdp2s_weights(tmp_path):
    out, metrics = run_recipe(tmp_path / "remat")
    plain_out, plain_metrics = run_recipe(tmp_path / "plain", "remat.enabled=false")
    assert "FSDP2" not in plain_out
    # Every unit is planned (the callback's FSDP2 line), and the steps keep the budget: the first
    # (the callback measures it) and the last (the runner's summary), against the warmup step.
    assert re.search(r"HiRemateCallback: FSDP2: .*of 4 units", out), out[-3000:]
    warmup = mib(r"measured step [\d.]+ MiB = \d+% of the unmodified warmup step's ([\d.]+) MiB",
                 out)
    first = mib(r"measured peak of the first training step: ([\d.]+) MiB", out)
    last = mib(r"peak memory \(step \d+\): ([\d.]+) MiB allocated inside the step", out)
    plain_last = mib(r"peak memory \(step \d+\): ([\d.]+) MiB allocated inside the step", plain_out)
    assert first <= 0.50 * warmup * 1.02 and last <= 0.50 * warmup * 1.02, (first, last, warmup)
    assert last <= 0.5 * plain_last * 1.02, (last, plain_last)
    # Exact gradients: after the same four updates the weights validate to the same bits.
    assert metrics == plain_metrics, (metrics, plain_metrics)


def test_fsdp2_needs_a_number_of_processes():
    with pytest.raises(RecipeError, match=r"trainer.devices='auto' .*expected an int >= 1 with "
                                          r"strategy=fsdp2"):
        load_recipe(LLAMA, ["trainer.devices=auto"])


def test_the_llama_task_without_transformers_names_the_install(monkeypatch):
    import importlib.util

    from recipes.registry import get_task

    recipe = load_recipe(LLAMA)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(RecipeError, match=r'task llama_lm needs Hugging Face transformers: pip '
                                          r'install "hiremate\[hf\]"'):
        get_task("llama_lm").check(recipe.model, recipe.data)
