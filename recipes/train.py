"""Build the callbacks, Trainer, model and data of a loaded recipe, train, validate, summarize.

Importing this module imports Lightning; :func:`recipes.config.load_recipe` does not (see
NOTE [ One validation phase ] in ``recipes/checks.py``).
"""
from __future__ import annotations

import dataclasses
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import CSVLogger

from integrations._lightning_warnings import quiet_leafspec
from recipes.errors import RecipeError
from recipes.registry import all_plugins, get_task
from recipes.schema import FSDP2, TrainerConfig
from recipes.stats import FitPhases, RunStats, Summary, format_summary

__all__ = [
    "PreparedRun", "build_callbacks", "build_trainer", "check_run", "plugin_callbacks",
    "prepare_run", "run_recipe",
]


def _uses_accelerate(recipe: Any) -> bool:
    return bool(getattr(getattr(recipe, "accelerate", None), "enabled", False))


def build_callbacks(recipe: Any) -> list[L.Callback]:
    """One callback per enabled plugin section, sorted by ``(Plugin.order, name)``.

    Raises:
        RecipeError: as :func:`plugin_callbacks`.
    """
    return list(plugin_callbacks(recipe).values())


def plugin_callbacks(recipe: Any) -> dict[str, L.Callback]:
    """Section name -> callback for every enabled plugin section, in ``(Plugin.order, name)``
    order (the order Lightning runs their hooks in).

    Raises:
        RecipeError: when a callback cannot be imported or rejects its arguments (callbacks check
            them in ``__init__``), naming the section.
    """
    plugins = sorted(all_plugins().values(), key=lambda p: (p.order, p.name))
    callbacks = {}
    for plugin in plugins:
        section = getattr(recipe, plugin.name)
        if not section.enabled:
            continue
        try:
            callbacks[plugin.name] = plugin.make_callback(section)
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
    strategy: Any = cfg.strategy
    if strategy == FSDP2:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=cfg.devices, tensor_parallel_size=1)
    try:
        return L.Trainer(
            max_steps=cfg.max_steps,
            max_epochs=-1,
            accelerator=cfg.accelerator.value,
            devices=cfg.devices,
            strategy=strategy,
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


@dataclass
class PreparedRun:
    """What :func:`prepare_run` built: everything but the model and the data.

    Attributes:
        trainer: The Lightning Trainer, its callbacks in the order below.
        plugins: Plugin section -> its callback (enabled sections only), in hook order.
        phases: Times setup and training (first callback), see NOTE [ Setup and training time ].
        stats: Step times, losses, memory and progress lines (last callback).
    """

    trainer: L.Trainer
    plugins: dict[str, L.Callback]
    phases: FitPhases
    stats: RunStats


def prepare_run(recipe: Any, *, printer: Callable[[str], None] = print,
                progress_bar: bool = False) -> PreparedRun:
    """Build the plugin callbacks and the Trainer of a loaded recipe: the checks that need
    Lightning (the callbacks' ``__init__``, Lightning's own checks of ``trainer:``).

    ``python -m recipes.run --check`` calls it as well as :func:`run_recipe`, so a recipe that
    passes ``--check`` gets past every check a run makes before it builds the model.

    Args:
        recipe: The loaded recipe.
        printer: Receives progress lines and the summary.
        progress_bar: Draw the runner's progress bar on stderr (NOTE [ A progress bar on a
            terminal, lines in a log ]); never beside Lightning's own
            (``trainer.enable_progress_bar``).

    Raises:
        RecipeError: a setting a callback or Lightning rejects.
    """
    plugins = plugin_callbacks(recipe)
    phases = FitPhases()
    stats = RunStats(print_every_n_steps=recipe.trainer.print_every_n_steps, printer=printer,
                     progress_bar=progress_bar and not recipe.trainer.enable_progress_bar)
    ordered: list[L.Callback] = [phases]
    for name, callback in plugins.items():
        ordered += [callback, phases.after(name)]
    trainer = build_trainer(recipe.trainer, ordered + [stats])
    return PreparedRun(trainer=trainer, plugins=plugins, phases=phases, stats=stats)


def check_run(recipe: Any) -> None:
    """What ``--check`` adds to loading: :func:`prepare_run` (Lightning recipes) or the plugin
    callbacks' own checks (``accelerate.enabled`` recipes, whose runner has no Trainer).

    Raises:
        RecipeError: as :func:`prepare_run`.
    """
    if _uses_accelerate(recipe):
        plugin_callbacks(_without_accelerate(recipe))
    else:
        prepare_run(recipe, printer=lambda line: None)


def _without_accelerate(recipe: Any) -> Any:
    section = dataclasses.replace(recipe.accelerate, enabled=False)
    return dataclasses.replace(recipe, accelerate=section)


def _setup_error(e: BaseException, plugins: dict[str, L.Callback]) -> RecipeError | None:
    """A ``ValueError``/``TypeError`` a plugin callback raised while ``fit`` set up (e.g. a
    ``remat.module`` name the model lacks), as the user error it is; ``None`` for anything else."""
    if not isinstance(e, (ValueError, TypeError)) or isinstance(e, RecipeError):
        return None
    owners = {id(callback): name for name, callback in plugins.items()}
    for frame, _ in traceback.walk_tb(e.__traceback__):
        name = owners.get(id(frame.f_locals.get("self")))
        if name is not None:
            return RecipeError(f"{name}: {e} (raised while fit was setting up, before the "
                               f"first step; fix the {name}: section)")
    return None


def run_recipe(recipe: Any, *, printer: Callable[[str], None] = print,
               progress_bar: bool = False) -> Summary:
    """Train and validate a loaded recipe (see :func:`recipes.config.load_recipe`).

    Order: :func:`prepare_run` (plugin callbacks, their argument checks, and the Trainer), so bad
    settings fail before the model and data exist; then ``seed_everything(recipe.seed)``, the
    task's model and data, ``trainer.fit``, one ``trainer.validate``, and the summary, printed on
    rank 0 through ``printer``.

    Args:
        recipe: The loaded recipe.
        printer: Receives progress lines and the summary.
        progress_bar: Draw a progress bar over ``trainer.max_steps`` on stderr during training
            (``python -m recipes.run`` does where stderr is a terminal; the Accelerate loop
            prints its progress lines only).

    Returns:
        The :class:`~recipes.stats.Summary` (on every rank).

    Raises:
        RecipeError: for settings rejected by a callback or by Lightning, including what a
            plugin callback rejects while ``fit`` sets up (before the first training step).
    """
    if _uses_accelerate(recipe):
        from recipes.accelerate_run import run_recipe_accelerate

        return run_recipe_accelerate(recipe, printer=printer)
    task = get_task(recipe.task)
    run = prepare_run(recipe, printer=printer, progress_bar=progress_bar)
    trainer, stats, phases = run.trainer, run.stats, run.phases
    L.seed_everything(recipe.seed, workers=True, verbose=False)
    module, datamodule = task.build(recipe.model, recipe.data, recipe.optim)
    phases.fit_called()
    fit_t0 = time.perf_counter()
    try:
        with quiet_leafspec():  # NOTE [ Lightning's LeafSpec warning ]
            trainer.fit(module, datamodule=datamodule)
    except Exception as e:
        error = _setup_error(e, run.plugins) if phases.setup_time_s is None else None
        if error is None:
            raise
        raise error from e
    fit_time_s = time.perf_counter() - fit_t0
    with quiet_leafspec():
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
        fit_time_s=fit_time_s,
        num_params=sum(p.numel() for p in module.parameters() if p.requires_grad),
        extra=describe() if callable(describe) else {},
        setup_time_s=phases.setup_time_s,
        training_time_s=phases.training_time_s,
        plugin_setup_s=dict(phases.plugin_setup_s),
        plugin_training_s=dict(phases.plugin_training_s),
        plugin_wrapup_s=dict(phases.plugin_wrapup_s),
        legend=dict(task.metrics),
    )
    if trainer.is_global_zero:
        printer(format_summary(summary))
    return summary
