"""The recipe schema: fixed sections plus the selected task's and every plugin's dataclass.

A recipe has these top-level keys::

    task: gpt_lm          # a module under recipes/tasks/
    seed: 0
    model: {...}          # TASK.model dataclass
    data: {...}           # TASK.data dataclass
    optim: {...}          # recipes.optim.OptimConfig
    trainer: {...}        # TrainerConfig below
    remat: {...}          # one section per module in recipes/plugins/ (off by default)

:func:`build_schema` assembles the dataclass type with ``dataclasses.make_dataclass`` so that a new
task or plugin adds its section without editing this file.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from omegaconf import MISSING

from recipes.errors import InvalidValue
from recipes.optim import OptimConfig
from recipes.registry import Plugin, Task

__all__ = ["Accelerator", "FSDP2", "TrainerConfig", "FIXED_SECTIONS", "build_schema"]

# Lightning precision strings the recipes accept (Trainer(precision=...)).
PRECISIONS = ("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")


class Accelerator(Enum):
    """Where the run executes (Lightning's ``accelerator=``). ``cpu`` is the default."""

    cpu = "cpu"
    cuda = "cuda"
    gpu = "gpu"
    mps = "mps"
    auto = "auto"


# trainer.strategy naming Lightning's ModelParallelStrategy used for FSDP2 (see TrainerConfig)
FSDP2 = "fsdp2"


@dataclass
class TrainerConfig:
    """The ``trainer:`` section: Lightning Trainer settings and the runner's own reporting.

    Attributes:
        max_steps: Optimizer steps to train (>= 1); epochs repeat as needed.
        accelerator: ``cpu`` (default), ``cuda``/``gpu``, ``mps`` or ``auto``.
        devices: Lightning's ``devices`` (an int >= 1, a list of ids, or ``"auto"``).
        strategy: Lightning's ``strategy`` (``auto``, ``ddp``, ...), or ``fsdp2``: Lightning's
            ``ModelParallelStrategy`` with ``data_parallel_size=devices`` and no tensor
            parallelism, the task's ``configure_model`` sharding the network with FSDP2's
            ``fully_shard`` (each decoder layer, then the network); ``devices`` must then be an
            int (the processes of this one node).
        precision: One of ``32-true`` (default), ``64-true``, ``16-mixed``, ``bf16-mixed``,
            ``16-true``, ``bf16-true``.
        gradient_clip_val: Clip the global gradient norm to this (> 0), or ``null`` for none.
        val_every_n_steps: Validate every N steps during training; 0 validates only once, after
            training (the final validation always runs and is what the summary reports).
        limit_val_batches: Use at most this many validation batches (``null``: all).
        print_every_n_steps: The runner prints one progress line every N steps (0: never).
        deterministic: Lightning's ``deterministic`` (deterministic algorithms only).
        default_root_dir: Where Lightning may write (logs, checkpoints); git-ignored ``outputs/``.
        logger: Write CSV logs under ``default_root_dir`` (off by default).
        enable_checkpointing: Save checkpoints under ``default_root_dir`` (off by default).
        enable_progress_bar: Lightning's own progress bar (per epoch, on stdout). Off: the runner
            prints progress lines and, where stderr is a terminal, draws its own bar over
            ``max_steps`` (NOTE [ A progress bar on a terminal, lines in a log ]).
        enable_model_summary: Lightning's table of submodules and parameter counts.
    """

    max_steps: int = 100
    accelerator: Accelerator = Accelerator.cpu
    devices: Any = 1
    strategy: str = "auto"
    precision: str = "32-true"
    gradient_clip_val: Optional[float] = 1.0
    val_every_n_steps: int = 0
    limit_val_batches: Optional[int] = None
    print_every_n_steps: int = 20
    deterministic: bool = False
    default_root_dir: str = "outputs/recipes"
    logger: bool = False
    enable_checkpointing: bool = False
    enable_progress_bar: bool = False
    enable_model_summary: bool = False

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise InvalidValue("max_steps", self.max_steps, "expected an int >= 1")
        if self.precision not in PRECISIONS:
            allowed = ", ".join(PRECISIONS)
            raise InvalidValue("precision", self.precision, f"expected one of {allowed}")
        if self.gradient_clip_val is not None and not self.gradient_clip_val > 0:
            raise InvalidValue(
                "gradient_clip_val", self.gradient_clip_val,
                "expected a float > 0 or null (no clipping)",
            )
        if self.val_every_n_steps < 0:
            raise InvalidValue("val_every_n_steps", self.val_every_n_steps, "expected an int >= 0")
        if self.limit_val_batches is not None and self.limit_val_batches < 1:
            raise InvalidValue(
                "limit_val_batches", self.limit_val_batches, "expected an int >= 1 or null (all)"
            )
        if self.print_every_n_steps < 0:
            raise InvalidValue(
                "print_every_n_steps", self.print_every_n_steps, "expected an int >= 0"
            )
        devices = self.devices
        ok = (
            devices == "auto"
            or (isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1)
            or (
                isinstance(devices, (list, tuple))
                and len(devices) > 0
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)
            )
        )
        if not ok:
            raise InvalidValue(
                "devices", devices, 'expected an int >= 1, a list of device ids or "auto"'
            )
        if self.strategy == FSDP2 and not isinstance(devices, int):
            raise InvalidValue(
                "devices", devices, "expected an int >= 1 with strategy=fsdp2 (the number of "
                "processes FSDP2 shards over, e.g. trainer.devices=2)"
            )


# Sections every recipe has, in print order, before the plugin sections.
FIXED_SECTIONS = ("task", "seed", "model", "data", "optim", "trainer")


def build_schema(task: Task, plugins: dict[str, Plugin]) -> type:
    """Return the dataclass type of a recipe for ``task`` with one section per plugin.

    Args:
        task: The selected task (its ``model``/``data`` dataclasses become those sections).
        plugins: Section name -> plugin, e.g. ``recipes.registry.all_plugins()``.

    Returns:
        A dataclass type named ``Recipe`` usable with ``OmegaConf.structured``.
    """
    fields: list[tuple] = [
        ("task", str, field(default=MISSING)),
        ("seed", int, field(default=0)),
        ("model", task.model, field(default_factory=task.model)),
        ("data", task.data, field(default_factory=task.data)),
        ("optim", OptimConfig, field(default_factory=OptimConfig)),
        ("trainer", TrainerConfig, field(default_factory=TrainerConfig)),
    ]
    clash = set(plugins) & set(FIXED_SECTIONS)
    if clash:
        raise TypeError(f"plugin section names {sorted(clash)} clash with the fixed sections")
    for name, plugin in plugins.items():
        fields.append((name, plugin.config, field(default_factory=plugin.config)))
    return dataclasses.make_dataclass("Recipe", fields)
