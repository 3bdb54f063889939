"""Build the callbacks, Trainer, model and data of a loaded recipe, train, validate, summarize."""
from __future__ import annotations

from typing import Any, Callable

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import CSVLogger

from recipes.errors import RecipeError
from recipes.registry import all_plugins, get_task
from recipes.schema import TrainerConfig
from recipes.stats import RunStats, Summary, format_summary

__all__ = ["build_callbacks", "build_trainer", "run_recipe"]


def build_callbacks(recipe: Any) -> list[L.Callback]:
    """One callback per enabled plugin section, sorted by ``(Plugin.order, name)``.

    Raises:
        RecipeError: when a callback cannot be imported or rejects its arguments (callbacks check
            them in ``__init__``), naming the section.
    """
    plugins = sorted(all_plugins().values(), key=lambda p: (p.order, p.name))
    callbacks = []
    for plugin in plugins:
        section = getattr(recipe, plugin.name)
        if not section.enabled:
            continue
        try:
            callbacks.append(plugin.make_callback(section))
        except (ValueError, TypeError) as e:
            if isinstance(e, RecipeError):
                raise
            raise RecipeError(f"{plugin.name}: the callback rejected its arguments: {e}") from e
    return callbacks


def build_trainer(cfg: TrainerConfig, callbacks: list[L.Callback]) -> L.Trainer:
    """The Lightning Trainer for the ``trainer:`` section.

    Validation during ``fit`` runs every ``cfg.val_every_n_steps`` global steps (never when 0); the
    runner always validates once after ``fit``.

    Raises:
        RecipeError: when Lightning rejects a setting (unknown strategy, unavailable accelerator).
    """
    # check_val_every_n_epoch=None makes val_check_interval count global steps across epochs; an
    # interval past max_steps means "no validation inside fit".
    interval = cfg.val_every_n_steps or cfg.max_steps + 1
    logger = CSVLogger(cfg.default_root_dir, name="logs") if cfg.logger else False
    try:
        return L.Trainer(
            max_steps=cfg.max_steps,
            max_epochs=-1,
            accelerator=cfg.accelerator.value,
            devices=cfg.devices,
            strategy=cfg.strategy,
            precision=cfg.precision,
            gradient_clip_val=cfg.gradient_clip_val,
            val_check_interval=interval,
            check_val_every_n_epoch=None,
            limit_val_batches=cfg.limit_val_batches,
            num_sanity_val_steps=0,
            deterministic=cfg.deterministic,
            default_root_dir=cfg.default_root_dir,
            logger=logger,
            enable_checkpointing=cfg.enable_checkpointing,
            enable_progress_bar=cfg.enable_progress_bar,
            enable_model_summary=cfg.enable_model_summary,
            callbacks=callbacks,
        )
    except (MisconfigurationException, ValueError, TypeError, RuntimeError) as e:
        raise RecipeError(f"trainer: Lightning rejected the settings: {e}") from e


def run_recipe(recipe: Any, *, printer: Callable[[str], None] = print) -> Summary:
    """Train and validate a loaded recipe (see :func:`recipes.config.load_recipe`).

    Order: plugin callbacks (their argument checks) and the Trainer are built first, so bad
    settings fail before the model and data exist; then ``seed_everything(recipe.seed)``, the
    task's model and data, ``trainer.fit``, one ``trainer.validate``, and the summary, printed on
    rank 0 through ``printer``.

    Args:
        recipe: The loaded recipe.
        printer: Receives progress lines and the summary.

    Returns:
        The :class:`~recipes.stats.Summary` (on every rank).

    Raises:
        RecipeError: for settings rejected by a callback or by Lightning.
    """
    if getattr(getattr(recipe, "accelerate", None), "enabled", False):
        from recipes.accelerate_run import run_recipe_accelerate

        return run_recipe_accelerate(recipe, printer=printer)
    task = get_task(recipe.task)
    stats = RunStats(print_every_n_steps=recipe.trainer.print_every_n_steps, printer=printer)
    trainer = build_trainer(recipe.trainer, build_callbacks(recipe) + [stats])
    L.seed_everything(recipe.seed, workers=True, verbose=False)
    module, datamodule = task.build(recipe.model, recipe.data, recipe.optim)
    trainer.fit(module, datamodule=datamodule)
    results = trainer.validate(module, datamodule=datamodule, verbose=False)
    val_metrics = {k: float(v) for r in results for k, v in r.items()}
    describe = getattr(datamodule, "describe", None)
    summary = Summary(
        steps=trainer.global_step,
        step_times_s=stats.step_times_s,
        timed_steps=stats.timed_steps(),
        train_losses=stats.train_losses,
        val_metrics=val_metrics,
        step_peak_bytes=stats.step_peak_bytes,
        step_peak_step=None if stats.step_peak_index is None else stats.step_peak_index + 1,
        step_peak_error=stats.step_peak_error,
        fit_peak_bytes=stats.fit_peak_bytes,
        device=str(trainer.strategy.root_device),
        fit_time_s=stats.fit_time_s,
        num_params=sum(p.numel() for p in module.parameters() if p.requires_grad),
        extra=describe() if callable(describe) else {},
    )
    if trainer.is_global_zero:
        printer(format_summary(summary))
    return summary
