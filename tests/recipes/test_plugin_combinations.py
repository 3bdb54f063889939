"""Recipes with several plugin sections enabled: the callbacks a recipe builds compose with remat.

The replacing plugins act in ``setup``, so remat captures what they produced whatever the order
(tests/integrations/test_composition.py checks both orders); here the recipes' own callbacks are
built from the YAML and trained for two steps on the recipe's task, with tiny overrides. The runs
use a plain ``Trainer`` rather than ``run_recipe`` so that what is checked is the callbacks.
"""
from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import remat  # noqa: E402
from integrations.fewbit_callback import WARMUP_STEP  # noqa: E402
from quant.fewbit import FewBitGELU, packed_bytes  # noqa: E402
from recipes import load_recipe  # noqa: E402
from recipes.errors import RecipeError  # noqa: E402
from recipes.registry import get_task  # noqa: E402
from recipes.train import build_callbacks  # noqa: E402

from .conftest import RECIPES_DIR  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

# A 2-block GPT small enough to capture in a few seconds; 70% of its step is feasible (1 block is
# not: its embedding and logits dominate).
N_LAYER, N_EMBD, BLOCK, BATCH = 2, 32, 32, 8
TINY_GPT = [f"model.n_layer={N_LAYER}", f"model.n_embd={N_EMBD}", f"model.block_size={BLOCK}",
            f"data.batch_size={BATCH}", "remat.time_limit=2"]


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.net = None

    def on_train_start(self, trainer, pl_module):
        self.net = pl_module.net

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(loss.detach().clone())


def _train(recipe, steps: int = 2):
    """The recipe's callbacks and task, trained ``steps`` steps: (callbacks, recorder, module)."""
    callbacks = build_callbacks(recipe)
    pl.seed_everything(recipe.seed, workers=True, verbose=False)
    module, datamodule = get_task(recipe.task).build(recipe.model, recipe.data, recipe.optim)
    recorder = Recorder()
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=[*callbacks, recorder],
    )
    trainer.fit(module, datamodule=datamodule)
    return callbacks, recorder, module


def test_replacing_plugins_come_before_remat():
    recipe = load_recipe(RECIPES_DIR / "gpt_fewbit.yaml",
                         ["cp.enabled=true", "interp_adjoint.enabled=true", "remat.enabled=true"])
    assert [type(c).__name__ for c in build_callbacks(recipe)] == [
        "FewBitCallback", "CPCompressionCallback", "InterpolatedAdjointCallback",
        "HiRemateCallback"]


def test_fewbit_and_remat_recipe_captures_the_fewbit_network():
    plain = load_recipe(RECIPES_DIR / "gpt_fewbit.yaml", TINY_GPT)
    (reference_fewbit,), reference, _ = _train(plain)
    recipe = load_recipe(RECIPES_DIR / "gpt_fewbit.yaml", TINY_GPT + ["remat.enabled=true"])
    (fewbit, hiremate), seen, module = _train(recipe)

    rm = seen.net
    assert isinstance(rm, remat.RematModule)
    gelus = {name for name, m in rm.original.named_modules() if isinstance(m, FewBitGELU)}
    assert len(gelus) == N_LAYER  # one MLP GELU per block
    graph = rm.graphs[0]
    packing = {op.module for op in graph.ops[:graph.num_forward]
               if op.signature.startswith("aten.bitwise_or") and "uint8" in op.signature}
    assert packing == gelus
    assert not any(op.signature.startswith("aten.gelu_backward") for op in graph.ops)
    # the few-bit-only recipe's loss curve, bit for bit (dropout included)
    assert torch.equal(torch.stack(seen.losses), torch.stack(reference.losses))
    # few-bit's report: on remat's eager warmup step, one 2-bit code per MLP hidden element
    assert fewbit.measured_on == WARMUP_STEP
    assert fewbit.memory_report == reference_fewbit.memory_report
    assert fewbit.memory_report.codes_bytes == N_LAYER * packed_bytes(
        BATCH * BLOCK * 4 * N_EMBD, recipe.fewbit.bits)
    plan = hiremate.plans["net"]
    assert plan.eager_bytes + plan.outside_bytes == hiremate.eager_peak_bytes
    assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_cp_at_a_step_with_remat_is_a_clear_error_when_the_recipe_loads():
    # --check and a run reject it alike, before Lightning is imported (the callback itself
    # refuses it in setup too: tests/integrations/test_composition.py).
    with pytest.raises(RecipeError, match=r"^cp\.when=200 \(in .*cnn_cp\.yaml\): with "
                                          r"remat\.enabled=true the CP layers must exist before "
                                          r"remat captures the network .* use when=fit_start or "
                                          r"when=fit_end, or disable remat"):
        load_recipe(RECIPES_DIR / "cnn_cp.yaml", ["remat.enabled=true"])


def test_interp_adjoint_with_remat_trains_and_says_remat_cannot_capture_the_ode():
    overrides = ["remat.enabled=true", "interp_adjoint.check_every_n_steps=0"]
    recipe = load_recipe(RECIPES_DIR / "digits_ode_interp.yaml", overrides)
    with pytest.warns(UserWarning, match=r"'net' trains unmodified \(strict=False\): it holds "
                                         r"the ode.ODEBlock 'ode'"):
        (adjoint, hiremate), seen, module = _train(recipe)
    assert len(seen.losses) == 2 and not isinstance(seen.net, remat.RematModule)
    assert "ode.ODEBlock" in hiremate.results["net"].skipped
    assert module.net.ode.config.grad == "adjoint"  # switched for fit, restored after

    strict = load_recipe(RECIPES_DIR / "digits_ode_interp.yaml", overrides + ["remat.strict=true"])
    with pytest.raises(remat.CaptureError, match="'net' cannot be rematerialized: it holds the "
                                                 "ode.ODEBlock 'ode'"):
        _train(strict)
