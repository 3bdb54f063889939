"""Train a recipe in a plain Accelerate loop with ``HiRemateAccelerator``.

Command line (same arguments as ``python -m recipes.run``)::

    python -m recipes.accelerate_run recipes/gpt_accelerate.yaml trainer.max_steps=20
    accelerate launch --num_processes 2 -m recipes.accelerate_run recipes/gpt_accelerate.yaml
    HIREMATE_BUDGET=50% accelerate launch -m recipes.accelerate_run recipes/gpt_plain.yaml

The task's ``build`` gives the LightningModule and DataModule as usual; the loop calls the
module's own ``training_step``/``validation_step`` and hooks, with ``self.log`` captured, builds
the optimizer from ``optim:`` (one scheduler step per optimizer step, gradient clipping over the
optimizer's parameters, as the Lightning runner does) and prints the same progress lines and
summary as ``recipes.run``. Only the network (``module.net``) is passed to
``accelerator.prepare``, so it is what DDP wraps and what remat rematerializes: the ``remat:``
section's ``module`` is relative to the LightningModule (``net``, ``net.blocks``) and is mapped
to the network. With ``remat.enabled: false`` the ``HIREMATE_*`` launcher variables apply.

NOTE [ Dispatch from recipes.run ]
    ``python -m recipes.run`` hands recipes with ``accelerate.enabled: true`` to
    :func:`run_recipe_accelerate` (``recipes.train.run_recipe``), so both commands train them
    here. The loop applies the ``remat:`` section only; other plugin sections enabled beside
    ``accelerate`` are refused when the recipe loads (``recipes/plugins/accelerate.py``).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch

from recipes.config import load_recipe, recipe_line, recipe_to_yaml
from recipes.errors import RecipeError
from recipes.optim import build_optimizer
from recipes.registry import get_task
from recipes.stats import Summary, format_summary

__all__ = ["run_recipe_accelerate", "main"]

EXIT_BAD_RECIPE = 2
# trainer.precision -> Accelerate's mixed_precision.
_PRECISION = {"32-true": "no", "16-mixed": "fp16", "bf16-mixed": "bf16"}
_STRATEGIES = ("auto", "ddp")


def _remat_plugin(recipe: Any) -> Any:
    """The ``remat:`` section as a ``HiRematePlugin`` (``None``: use the HIREMATE_* variables)."""
    from integrations.accelerate import HiRematePlugin

    section = recipe.remat
    if not section.enabled:
        return None
    names = [section.module] if isinstance(section.module, str) else section.module
    module = None
    if names is not None:
        mapped = []
        for name in names:
            if name != "net" and not name.startswith("net."):
                raise RecipeError(
                    f"remat.module={section.module!r}: the Accelerate runner rematerializes the "
                    "task's network, module.net; use null, net, or a path inside it (net.blocks)"
                )
            mapped.append(name[len("net."):] if name != "net" else None)
        module = None if None in mapped else mapped
    try:
        return HiRematePlugin(
            budget=section.budget, solver=section.solver, time_limit=section.time_limit,
            module=module, cache_dir=section.cache_dir, strict=section.strict,
            verbose=section.verbose,
        )
    except (ValueError, TypeError) as e:
        raise RecipeError(f"remat: HiRematePlugin rejected its arguments: {e}") from e


def _accelerator(recipe: Any) -> Any:
    try:
        from accelerate.utils import DataLoaderConfiguration

        from integrations.accelerate import HiRemateAccelerator
    except ImportError as e:
        raise RecipeError(f"the Accelerate runner needs Accelerate ({e}); install it with "
                          'pip install "hiremate[accelerate]"') from e

    cfg = recipe.trainer
    if cfg.precision not in _PRECISION:
        raise RecipeError(f"trainer.precision={cfg.precision!r}: the Accelerate runner supports "
                          f"{', '.join(_PRECISION)}")
    if cfg.strategy not in _STRATEGIES:
        raise RecipeError(f"trainer.strategy={cfg.strategy!r}: the Accelerate runner supports "
                          f"{', '.join(_STRATEGIES)}; processes come from accelerate launch")
    plugin = _remat_plugin(recipe)
    try:
        return HiRemateAccelerator(
            cpu=cfg.accelerator.value == "cpu", mixed_precision=_PRECISION[cfg.precision],
            dataloader_config=DataLoaderConfiguration(
                split_batches=recipe.accelerate.split_batches),
            hiremate_plugin=plugin,
        )
    except ValueError as e:
        raise RecipeError(f"accelerate: {e}") from e


@contextlib.contextmanager
def _captured_logs(module: torch.nn.Module, into: dict[str, Any]) -> Iterator[None]:
    """``self.log``/``self.log_dict`` store values in ``into`` (no Lightning Trainer here)."""
    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        into[name] = value

    def log_dict(values: dict, *args: Any, **kwargs: Any) -> None:
        into.update(values)

    module.__dict__["log"], module.__dict__["log_dict"] = log, log_dict
    try:
        yield
    finally:
        module.__dict__.pop("log", None)
        module.__dict__.pop("log_dict", None)


def _validate(module: Any, loader: Any, limit: int | None, accelerator: Any) -> dict[str, float]:
    logged: dict[str, Any] = {}
    module.eval()
    with torch.no_grad(), _captured_logs(module, logged):
        module.on_validation_epoch_start()
        for i, batch in enumerate(loader):
            if limit is not None and i >= limit:
                break
            module.validation_step(batch, i)
        module.on_validation_epoch_end()
    module.train()
    metrics = {}
    for name, value in logged.items():
        value = torch.as_tensor(value, dtype=torch.float32, device=accelerator.device)
        metrics[name] = float(accelerator.reduce(value, "mean")) if accelerator.num_processes > 1 \
            else float(value)
    return metrics


def run_recipe_accelerate(recipe: Any, *, printer: Callable[[str], None] = print) -> Summary:
    """Train and validate a loaded recipe with ``HiRemateAccelerator``; see the module docstring.

    Args:
        recipe: The loaded recipe (:func:`recipes.config.load_recipe`).
        printer: Receives progress lines and the summary (main process only).

    Returns:
        The :class:`~recipes.stats.Summary` (on every process).

    Raises:
        RecipeError: for settings the Accelerate runner or ``HiRematePlugin`` rejects.
    """
    import lightning as L

    from remat import track_memory

    cfg = recipe.trainer
    task = get_task(recipe.task)
    accelerator = _accelerator(recipe)  # bad settings fail before anything is built
    main = accelerator.is_main_process
    L.seed_everything(recipe.seed, workers=True, verbose=False)
    module, datamodule = task.build(recipe.model, recipe.data, recipe.optim)
    datamodule.setup("fit")
    train_loader, val_loader = datamodule.train_dataloader(), datamodule.val_dataloader()
    device = accelerator.device
    module.to(device)
    optimizer, scheduler = build_optimizer(module, recipe.optim, total_steps=max(1, cfg.max_steps))
    clip_params = [p for group in optimizer.param_groups for p in group["params"]]
    fit_t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # The network alone is prepared (wrapped by DDP, rematerialized); the scheduler is stepped
    # here once per optimizer step, as in the Lightning runner.
    net, optimizer, train_loader, val_loader = accelerator.prepare(
        module.net, optimizer, train_loader, val_loader)
    module.net = net

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: list[float] = []
    losses: list[float] = []
    peak_bytes, peak_index, peak_error = None, None, ""
    logged: dict[str, Any] = {}
    step = 0
    module.train()
    with _captured_logs(module, logged):
        while step < cfg.max_steps:
            for batch_idx, batch in enumerate(train_loader):
                memory = tracker = None
                if step == cfg.max_steps - 1:  # the last step: measure its memory
                    memory = track_memory(device) if device.type in ("cpu", "cuda") else None
                    try:
                        tracker = memory.__enter__() if memory is not None else None
                    except RuntimeError as e:
                        memory, peak_error = None, f"not measured: {e}".split(". ")[0]
                sync()
                t0 = time.perf_counter()
                loss = module.training_step(batch, batch_idx)
                accelerator.backward(loss)
                if cfg.gradient_clip_val is not None:
                    accelerator.clip_grad_norm_(clip_params, cfg.gradient_clip_val)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                sync()
                times.append(time.perf_counter() - t0)
                if memory is not None:
                    memory.__exit__(None, None, None)
                    peak_bytes, peak_index = tracker.peak_bytes, len(times) - 1
                elif step == cfg.max_steps - 1:
                    peak_index = len(times) - 1
                losses.append(float(loss.detach()))
                step += 1
                every = cfg.print_every_n_steps
                if main and every and (step % every == 0 or step == cfg.max_steps):
                    printer(f"step {step}/{cfg.max_steps}  train_loss {losses[-1]:.4f}  "
                            f"step_time {1e3 * times[-1]:.1f} ms")
                if cfg.val_every_n_steps and step % cfg.val_every_n_steps == 0 \
                        and step < cfg.max_steps:
                    _validate(module, val_loader, cfg.limit_val_batches, accelerator)
                if step >= cfg.max_steps:
                    break
    fit_time = time.perf_counter() - fit_t0
    fit_peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    val_metrics = _validate(module, val_loader, cfg.limit_val_batches, accelerator)
    timed = [i for i in range(len(times)) if i > 0 and i != peak_index] or list(range(len(times)))
    describe = getattr(datamodule, "describe", None)
    extra = dict(describe()) if callable(describe) else {}
    plugin = accelerator.hiremate_plugin
    extra["launcher"] = (f"accelerate, {accelerator.num_processes} process(es), "
                         f"{accelerator.mixed_precision} mixed precision; remat: "
                         + (f"budget {plugin.settings.budget}, solver {plugin.solver}"
                            if plugin is not None else "off"))
    summary = Summary(
        steps=step, step_times_s=times, timed_steps=timed, train_losses=losses,
        val_metrics=val_metrics, step_peak_bytes=peak_bytes,
        step_peak_step=None if peak_index is None else peak_index + 1,
        step_peak_error=peak_error, fit_peak_bytes=fit_peak, device=str(device),
        fit_time_s=fit_time,
        num_params=sum(p.numel() for p in module.parameters() if p.requires_grad), extra=extra,
        legend=dict(task.metrics),
    )
    if main:
        printer(format_summary(summary))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """Command line; returns the exit status (0 ok, 2 bad recipe)."""
    parser = argparse.ArgumentParser(
        prog="python -m recipes.accelerate_run",
        description="Train a hiremate recipe in an Accelerate loop (HiRemateAccelerator).",
        epilog="example: accelerate launch -m recipes.accelerate_run recipes/gpt_accelerate.yaml "
               "trainer.max_steps=20",
    )
    parser.add_argument("recipe", help="the recipe YAML, e.g. recipes/gpt_accelerate.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--check", action="store_true",
                        help="validate and print the resolved recipe, then exit")
    parser.add_argument("--print-config", action="store_true",
                        help="print the whole resolved recipe as YAML before training")
    args = parser.parse_intermixed_args(argv)  # flags anywhere, as in recipes.run
    main_process = int(os.environ.get("RANK", "0")) == 0
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        if main_process and (args.check or args.print_config):
            shown = " ".join(args.overrides)
            print(f"# resolved recipe: {args.recipe}" + (f" {shown}" if shown else ""))
            print(recipe_to_yaml(recipe), flush=True)
        elif main_process:
            print(recipe_line(args.recipe, args.overrides), flush=True)
        if args.check:
            return 0
        if main_process:  # HiRemateAccelerator's progress lines and table go through logging
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("%(message)s"))
            for name in ("integrations",):
                logger = logging.getLogger(name)
                logger.setLevel(logging.INFO)
                logger.addHandler(handler)
        warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
        run_recipe_accelerate(recipe)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    return 0


if __name__ == "__main__":
    sys.exit(main())
