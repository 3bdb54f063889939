"""scikit-learn's bundled handwritten digits (1,797 8x8 grey images, 10 classes; UCI ML digits).

The data ships inside scikit-learn (``sklearn.datasets.load_digits``), so nothing is downloaded.
The train/validation split is stratified and fixed by ``split_seed``.
"""
from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["load_digits_split", "DigitsDataModule"]


def load_digits_split(
    *, val_fraction: float = 0.2, split_seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """Load the digits as tensors and split them.

    Args:
        val_fraction: Share of the images held out for validation, in (0, 1).
        split_seed: Seed of the stratified split (``train_test_split(random_state=...)``).

    Returns:
        ``(train, val)`` TensorDatasets of ``(x, y)``: ``x`` float32 ``(N, 1, 8, 8)`` scaled to
        [0, 1] (pixel values are 0..16), ``y`` int64 ``(N,)`` in 0..9.
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f'the digits task needs scikit-learn ({e}); pip install "hiremate[recipes]"'
        ) from e
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    idx_train, idx_val = train_test_split(
        torch.arange(len(y)).numpy(), test_size=val_fraction, random_state=split_seed,
        stratify=y.numpy(),
    )
    idx_train, idx_val = torch.as_tensor(idx_train), torch.as_tensor(idx_val)
    return TensorDataset(x[idx_train], y[idx_train]), TensorDataset(x[idx_val], y[idx_val])


class DigitsDataModule(L.LightningDataModule):
    """Loaders over :func:`load_digits_split`; training batches shuffled by a seeded generator,
    the last incomplete training batch dropped."""

    def __init__(
        self, *, batch_size: int, val_fraction: float = 0.2, split_seed: int = 0,
        shuffle_seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.shuffle_seed = shuffle_seed

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "train_set"):
            return
        self.train_set, self.val_set = load_digits_split(
            val_fraction=self.val_fraction, split_seed=self.split_seed
        )

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.shuffle_seed)
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
            generator=generator,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def describe(self) -> dict[str, str]:
        """One line about the split, for the run summary."""
        n_train, n_val = len(self.train_set), len(self.val_set)
        return {
            "data": f"scikit-learn digits, {n_train} train / {n_val} val images "
            f"(split_seed={self.split_seed})"
        }
