"""The LightningModule of the digits tasks (``digits_cnn``, ``digits_ode``): cross-entropy
classification with ``train_loss`` / ``train_acc`` per step and ``val_loss`` / ``val_acc`` on
validation.

Kept out of the task modules, which the registry imports to validate a recipe: those hold only the
config dataclasses and import this (and Lightning) inside ``build``.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F
from typing_extensions import override

from recipes.module import RecipeModule

__all__ = ["DigitsClassifier"]


class DigitsClassifier(RecipeModule):
    """Cross-entropy classification; ``self.net`` is a :class:`DigitsCNN`."""

    @override
    def training_step(self, batch, batch_idx):  # noqa: D102 - Lightning hook
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        self.log("train_acc", (logits.argmax(1) == y).float().mean(), on_step=True, on_epoch=False)
        return loss

    @override
    def on_validation_epoch_start(self) -> None:  # noqa: D102 - Lightning hook
        self._val_stats = torch.zeros(3, dtype=torch.float64, device=self.device)

    @override
    def validation_step(self, batch, batch_idx):  # noqa: D102 - Lightning hook
        x, y = batch
        logits = self.net(x)
        nll = F.cross_entropy(logits, y, reduction="sum")
        correct = (logits.argmax(1) == y).sum()
        count = torch.tensor(float(y.numel()), dtype=torch.float64, device=self.device)
        self._val_stats += torch.stack([nll.double(), correct.double(), count])

    @override
    def on_validation_epoch_end(self) -> None:  # noqa: D102 - Lightning hook
        nll, correct, count = self._val_stats.tolist()
        count = max(1.0, count)
        self.log("val_loss", nll / count, sync_dist=True)
        self.log("val_acc", correct / count, sync_dist=True)
