"""Task ``digits_cnn``: a small BatchNorm CNN on scikit-learn's bundled 8x8 digits.

Reports ``train_loss`` / ``train_acc`` every step and ``val_loss`` / ``val_acc`` on validation
(360 held-out images with the default split).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import torch
from torch.nn import functional as F

from recipes.data.digits import DigitsDataModule
from recipes.errors import InvalidValue
from recipes.models.cnn import DigitsCNN
from recipes.module import RecipeModule
from recipes.optim import OptimConfig
from recipes.registry import Task


@dataclass
class CNNModelConfig:
    """The ``model:`` section of ``digits_cnn`` (see :class:`recipes.models.cnn.DigitsCNN`).

    Attributes:
        channels: Output channels of each conv stage (1 to 4 stages).
        dropout: Dropout before the classifier, in [0, 1).
    """

    channels: List[int] = field(default_factory=lambda: [16, 32, 64])
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if not 1 <= len(self.channels) <= 4 or any(c < 1 for c in self.channels):
            raise InvalidValue(
                "channels", list(self.channels),
                "expected 1 to 4 positive ints (each stage after the first halves the 8x8 image)",
            )
        if not 0.0 <= self.dropout < 1.0:
            raise InvalidValue("dropout", self.dropout, "expected a float in [0, 1)")


@dataclass
class DigitsDataConfig:
    """The ``data:`` section of ``digits_cnn`` (see :class:`recipes.data.DigitsDataModule`).

    Attributes:
        batch_size: Images per step.
        val_fraction: Share held out (stratified) for validation, in (0, 1).
        split_seed: Seed of the train/validation split.
        shuffle_seed: Seed of the training order.
    """

    batch_size: int = 64
    val_fraction: float = 0.2
    split_seed: int = 0
    shuffle_seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise InvalidValue("batch_size", self.batch_size, "expected an int >= 1")
        if not 0.0 < self.val_fraction < 1.0:
            raise InvalidValue("val_fraction", self.val_fraction, "expected a float in (0, 1)")


class DigitsClassifier(RecipeModule):
    """Cross-entropy classification; ``self.net`` is a :class:`DigitsCNN`."""

    def training_step(self, batch, batch_idx):  # noqa: D102 - Lightning hook
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        self.log("train_acc", (logits.argmax(1) == y).float().mean(), on_step=True, on_epoch=False)
        return loss

    def on_validation_epoch_start(self) -> None:  # noqa: D102 - Lightning hook
        self._val_stats = torch.zeros(3, dtype=torch.float64, device=self.device)

    def validation_step(self, batch, batch_idx):  # noqa: D102 - Lightning hook
        x, y = batch
        logits = self.net(x)
        nll = F.cross_entropy(logits, y, reduction="sum")
        correct = (logits.argmax(1) == y).sum()
        count = torch.tensor(float(y.numel()), dtype=torch.float64, device=self.device)
        self._val_stats += torch.stack([nll.double(), correct.double(), count])

    def on_validation_epoch_end(self) -> None:  # noqa: D102 - Lightning hook
        nll, correct, count = self._val_stats.tolist()
        count = max(1.0, count)
        self.log("val_loss", nll / count, sync_dist=True)
        self.log("val_acc", correct / count, sync_dist=True)


def build(model: CNNModelConfig, data: DigitsDataConfig, optim: OptimConfig):
    """Build the ``digits_cnn`` LightningModule and DataModule."""
    net = DigitsCNN(channels=model.channels, num_classes=10, dropout=model.dropout)
    datamodule = DigitsDataModule(
        batch_size=data.batch_size, val_fraction=data.val_fraction, split_seed=data.split_seed,
        shuffle_seed=data.shuffle_seed,
    )
    return DigitsClassifier(net, optim=optim), datamodule


TASK = Task(
    model=CNNModelConfig,
    data=DigitsDataConfig,
    build=build,
    description="BatchNorm CNN on scikit-learn's bundled 8x8 digits; val accuracy",
)
