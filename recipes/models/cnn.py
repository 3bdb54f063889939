"""A small convolutional classifier with BatchNorm for 8x8 images (scikit-learn's digits)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["DigitsCNN"]


class DigitsCNN(nn.Module):
    """Conv-BN-ReLU stages, 2x2 max-pooling after every stage but the first, global average
    pooling and a linear classifier.

    Args:
        channels: Output channels of each 3x3 convolution stage (e.g. ``(16, 32, 64)``). With 8x8
            inputs at most 4 stages fit (8 -> 4 -> 2 -> 1).
        num_classes: Number of classes.
        in_channels: Input channels (1 for the digits).
        dropout: Dropout probability before the classifier.

    Shapes:
        ``forward(x)``: ``x`` is ``(batch, in_channels, 8, 8)``; returns logits
        ``(batch, num_classes)``.

    Raises:
        ValueError: if ``channels`` is empty, has a non-positive entry or more than 4 stages.

    Example:
        >>> DigitsCNN(channels=(8, 16))(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        *,
        channels: Sequence[int] = (16, 32, 64),
        num_classes: int = 10,
        in_channels: int = 1,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        channels = list(channels)
        if not 1 <= len(channels) <= 4 or any(c < 1 for c in channels):
            raise ValueError(
                f"channels={channels}: expected 1 to 4 positive ints (8x8 inputs halve per stage)"
            )
        layers: list[nn.Module] = []
        prev = in_channels
        for i, c in enumerate(channels):
            conv = nn.Conv2d(prev, c, kernel_size=3, padding=1, bias=False)
            layers += [conv, nn.BatchNorm2d(c), nn.ReLU()]
            if i > 0:
                layers.append(nn.MaxPool2d(2))
            prev = c
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x)).flatten(1)
        return self.classifier(self.drop(x))
