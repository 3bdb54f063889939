"""Byte-level language-modelling data from CPython's own standard-library sources.

Nothing is downloaded: the text is a fixed list of ``.py`` files from the running interpreter's
stdlib directory (``sysconfig.get_paths()["stdlib"]``), concatenated in list order. The bytes are
therefore fixed for a given Python version; :func:`load_stdlib_bytes` returns their SHA-256 so a
run can say exactly which text it trained on.
"""
from __future__ import annotations

import hashlib
import sys
from typing import Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from recipes.data.stdlib_files import DEFAULT_STDLIB_FILES, missing_stdlib_files, stdlib_dir

__all__ = [
    "DEFAULT_STDLIB_FILES", "stdlib_dir", "missing_stdlib_files", "load_stdlib_bytes", "ByteWindows",
    "StdlibTextDataModule",
]


def load_stdlib_bytes(files: Sequence[str] = DEFAULT_STDLIB_FILES) -> tuple[torch.Tensor, str]:
    """Read stdlib files into one uint8 tensor.

    Args:
        files: Paths relative to the stdlib directory, read in this order.

    Returns:
        ``(data, sha256)``: the concatenated bytes as a 1-D ``torch.uint8`` tensor, and the
        hex SHA-256 of those bytes.

    Raises:
        ValueError: if ``files`` is empty or a file is missing (the message gives the directory).
    """
    if not files:
        raise ValueError("files=[]: expected at least one stdlib file name, e.g. ['argparse.py']")
    missing = missing_stdlib_files(files)
    if missing:
        raise ValueError(
            f"files: {missing[0]!r} is not a file under this Python's stdlib directory "
            f"{stdlib_dir()}; pick files that exist there (e.g. 'argparse.py')"
        )
    chunks = [(stdlib_dir() / name).read_bytes() for name in files]
    blob = b"".join(chunks)
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()
    return data, hashlib.sha256(blob).hexdigest()


class ByteWindows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes -> (input, next-byte target) pairs.

    Args:
        data: 1-D uint8 tensor.
        block_size: Sequence length of each example.

    Shapes:
        Each item is ``(x, y)``, both int64 ``(block_size,)``, with ``y[i] == x[i + 1]`` (the next
        byte).
    """

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        if data.numel() < block_size + 1:
            raise ValueError(
                f"block_size={block_size}: longer than the {data.numel()}-byte split; "
                "use a smaller block_size or more files"
            )
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.data.numel() - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class _RandomLength:
    """Collate, then cut the batch to a length drawn from ``[low, high]`` (seeded)."""

    def __init__(self, low: int, high: int, seed: int) -> None:
        self.low, self.high = low, high
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, items):
        from torch.utils.data import default_collate

        x, y = default_collate(items)
        n = int(torch.randint(self.low, self.high + 1, (), generator=self.generator))
        return x[:, :n].contiguous(), y[:, :n].contiguous()


class StdlibTextDataModule(L.LightningDataModule):
    """Train/validation split of :func:`load_stdlib_bytes`: the last ``val_fraction`` of the bytes
    is the validation text.

    Training windows are shuffled by a generator seeded with ``shuffle_seed`` (same order every
    run); the last incomplete training batch is dropped. With ``min_length`` set, each training
    batch is cut to its own length, drawn uniformly from ``[min_length, block_size]`` by a
    generator seeded with ``shuffle_seed`` (what dynamic padding gives a real fine-tuning run:
    every step has another shape); otherwise every step sees the same shape.
    """

    def __init__(
        self,
        *,
        block_size: int,
        batch_size: int,
        val_fraction: float = 0.1,
        files: Sequence[str] = DEFAULT_STDLIB_FILES,
        shuffle_seed: int = 0,
        num_workers: int = 0,
        min_length: int | None = None,
    ) -> None:
        super().__init__()
        if min_length is not None and not 1 <= min_length <= block_size:
            raise ValueError(f"min_length={min_length!r}: expected an int in [1, block_size="
                             f"{block_size}], or None for full-length batches")
        self.min_length = min_length
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.files = tuple(files)
        self.shuffle_seed = shuffle_seed
        self.num_workers = num_workers
        self.sha256 = ""

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "train_set"):
            return
        data, self.sha256 = load_stdlib_bytes(self.files)
        n_val = int(data.numel() * self.val_fraction)
        self.train_set = ByteWindows(data[: data.numel() - n_val], self.block_size)
        self.val_set = ByteWindows(data[data.numel() - n_val :], self.block_size)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.shuffle_seed)
        collate = None
        if self.min_length is not None:
            collate = _RandomLength(self.min_length, self.block_size, self.shuffle_seed)
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
            generator=generator, num_workers=self.num_workers, collate_fn=collate,
        )

    def describe(self) -> dict[str, str]:
        """One line about the text, for the run summary."""
        version = ".".join(map(str, sys.version_info[:2]))
        n = self.train_set.data.numel() + self.val_set.data.numel()
        return {"data": f"{n} bytes of CPython {version} stdlib sources ({len(self.files)} files), "
                        f"sha256 {self.sha256[:16]}"}

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
