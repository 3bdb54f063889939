"""The ``optim:`` section of every recipe: optimizer and learning-rate schedule, by registry."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List

import torch
from torch import nn

from recipes.errors import InvalidValue

__all__ = ["OptimConfig", "OPTIMIZERS", "SCHEDULES", "build_optimizer"]


def _adamw(groups: list[dict], cfg: "OptimConfig") -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]))


def _sgd(groups: list[dict], cfg: "OptimConfig") -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def _constant(step: int, cfg: "OptimConfig", total: int) -> float:
    return min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0


def _cosine(step: int, cfg: "OptimConfig", total: int) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, total - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# name -> factory(param_groups, cfg); the valid names in error messages come from here.
OPTIMIZERS: dict[str, Callable[[list[dict], "OptimConfig"], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "sgd": _sgd,
}
# name -> multiplier of optim.lr at a step (linear warmup first, then the named shape).
SCHEDULES: dict[str, Callable[[int, "OptimConfig", int], float]] = {
    "constant": _constant,
    "cosine": _cosine,
}


@dataclass
class OptimConfig:
    """Optimizer settings shared by every task.

    Attributes:
        name: Optimizer, one of :data:`OPTIMIZERS` (``adamw``, ``sgd``).
        lr: Peak learning rate (> 0).
        weight_decay: Decoupled weight decay (>= 0), applied to weights with 2 or more dimensions
            only (not to biases, norm scales or BatchNorm parameters).
        betas: Adam's ``(beta1, beta2)``, each in [0, 1).
        momentum: SGD momentum in [0, 1).
        schedule: Learning-rate shape after warmup, one of :data:`SCHEDULES`.
        warmup_steps: Steps of linear warmup from ``lr / warmup_steps`` to ``lr`` (>= 0).
        min_lr_ratio: Final ``lr`` multiplier of the cosine schedule, in [0, 1].
    """

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    momentum: float = 0.9
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise InvalidValue("name", self.name, f"expected one of {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise InvalidValue("schedule", self.schedule, f"expected one of {', '.join(SCHEDULES)}")
        if not self.lr > 0:
            raise InvalidValue("lr", self.lr, "expected a float > 0")
        if not self.weight_decay >= 0:
            raise InvalidValue("weight_decay", self.weight_decay, "expected a float >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise InvalidValue("betas", list(self.betas), "expected two floats in [0, 1)")
        if not 0.0 <= self.momentum < 1.0:
            raise InvalidValue("momentum", self.momentum, "expected a float in [0, 1)")
        if self.warmup_steps < 0:
            raise InvalidValue("warmup_steps", self.warmup_steps, "expected an int >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise InvalidValue("min_lr_ratio", self.min_lr_ratio, "expected a float in [0, 1]")


def build_optimizer(
    module: nn.Module, cfg: OptimConfig, *, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """Build the optimizer (with weight-decay groups) and its per-step schedule.

    Args:
        module: The module whose parameters are trained.
        cfg: The ``optim:`` section.
        total_steps: Length of the run in optimizer steps (the cosine schedule ends there).

    Returns:
        ``(optimizer, scheduler)``; step the scheduler once per optimizer step.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer = OPTIMIZERS[cfg.name](groups, cfg)
    shape = SCHEDULES[cfg.schedule]
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: shape(step, cfg, max(1, total_steps))
    )
    return optimizer, scheduler
