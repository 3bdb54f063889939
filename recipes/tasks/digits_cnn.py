"""Task ``digits_cnn``: a small BatchNorm CNN on scikit-learn's bundled 8x8 digits.

Reports ``train_loss`` / ``train_acc`` every step and ``val_loss`` / ``val_acc`` on validation
(360 held-out images with the default split).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List

from recipes.errors import InvalidValue
from recipes.optim import OptimConfig
from recipes.registry import Task

# sklearn.datasets.load_digits: 1,797 images of 10 classes, shipped with scikit-learn.
DIGITS_IMAGES, DIGITS_CLASSES = 1797, 10

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
        n_val = math.ceil(self.val_fraction * DIGITS_IMAGES)  # as train_test_split rounds it
        n_train = DIGITS_IMAGES - n_val
        if min(n_val, n_train) < DIGITS_CLASSES:
            raise InvalidValue(
                "val_fraction", self.val_fraction,
                f"holds out {n_val} of the {DIGITS_IMAGES} images and trains on {n_train}; the "
                f"stratified split needs at least {DIGITS_CLASSES} (one per class) on each side",
            )
        if self.batch_size > n_train:
            raise InvalidValue(
                "batch_size", self.batch_size,
                f"expected at most the {n_train} training images (data.val_fraction="
                f"{self.val_fraction}); the last incomplete batch is dropped, so no step would run",
            )


def build(model: CNNModelConfig, data: DigitsDataConfig, optim: OptimConfig):
    """Build the ``digits_cnn`` LightningModule and DataModule."""
    from recipes.data.digits import DigitsDataModule  # Lightning: only when a run builds
    from recipes.models.cnn import DigitsCNN
    from recipes.tasks._classifier import DigitsClassifier

    net = DigitsCNN(channels=model.channels, num_classes=10, dropout=model.dropout)
    datamodule = DigitsDataModule(
        batch_size=data.batch_size, val_fraction=data.val_fraction, split_seed=data.split_seed,
        shuffle_seed=data.shuffle_seed,
    )
    return DigitsClassifier(net, optim=optim), datamodule


# What the digits classifiers log (recipes/tasks/_classifier.py), for the summary's legend.
CLASSIFIER_METRICS = {
    "train_loss": "training cross-entropy per image, in nats",
    "val_loss": "validation cross-entropy per image, in nats (a uniform guess: ln 10 = 2.30)",
    "val_acc": "validation accuracy, the fraction of images classified right",
}

TASK = Task(
    model=CNNModelConfig,
    data=DigitsDataConfig,
    build=build,
    description="BatchNorm CNN on scikit-learn's bundled 8x8 digits; val accuracy",
    metrics=CLASSIFIER_METRICS,
)
