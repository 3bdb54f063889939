"""Task ``gpt_lm``: a byte-level GPT trained on CPython's stdlib sources.

Reports ``train_loss`` every step and, on validation, ``val_loss`` (mean next-byte cross-entropy in
nats), ``val_ppl`` (its exponential) and ``val_bpb`` (bits per byte). A uniform guess over 256 bytes
scores ``val_loss = ln 256 = 5.55``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from recipes.data.stdlib_files import (
    DEFAULT_STDLIB_FILES,
    missing_stdlib_files,
    stdlib_bytes,
    stdlib_dir,
)
from recipes.errors import InvalidValue
from recipes.optim import OptimConfig
from recipes.registry import Task

VOCAB_SIZE = 256  # byte-level


def check_decoder_sizes(model) -> None:
    """The sizes every decoder ``model:`` section has: ``block_size``, ``n_layer``, ``n_head``
    and ``n_embd`` at least 1, ``n_embd`` a multiple of ``n_head``.

    Raises:
        InvalidValue: naming the key.
    """
    for key in ("block_size", "n_layer", "n_head", "n_embd"):
        if getattr(model, key) < 1:
            raise InvalidValue(key, getattr(model, key), "expected an int >= 1")
    if model.n_embd % model.n_head:
        raise InvalidValue(
            "n_embd", model.n_embd, f"expected a multiple of model.n_head={model.n_head}"
        )


@dataclass
class GPTModelConfig:
    """The ``model:`` section of ``gpt_lm`` (see :class:`recipes.models.gpt.GPT`).

    Attributes:
        block_size: Context length in bytes; also the length of every training sequence.
        n_layer: Transformer blocks.
        n_head: Attention heads (must divide ``n_embd``).
        n_embd: Residual width.
        dropout: Dropout probability in [0, 1).
        bias: Biases in Linear and LayerNorm layers.
        tie_weights: Share the head's weight with the token embedding.
    """

    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.1
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self) -> None:
        check_decoder_sizes(self)
        if not 0.0 <= self.dropout < 1.0:
            raise InvalidValue("dropout", self.dropout, "expected a float in [0, 1)")


@dataclass
class GPTDataConfig:
    """The ``data:`` section of ``gpt_lm`` (see :class:`recipes.data.StdlibTextDataModule`).

    Attributes:
        batch_size: Sequences per step.
        val_fraction: Share of the text (its end) held out for validation, in (0, 1).
        files: Stdlib files (relative to ``sysconfig.get_paths()["stdlib"]``) read in order.
        shuffle_seed: Seed of the training-window order (and of the lengths).
        min_length: When set, every training batch gets its own length, drawn from
            ``[min_length, model.block_size]`` (variable-length batches, as dynamic padding
            gives); ``null`` (default) keeps every batch at ``block_size``.
    """

    batch_size: int = 16
    val_fraction: float = 0.1
    files: List[str] = field(default_factory=lambda: list(DEFAULT_STDLIB_FILES))
    shuffle_seed: int = 0
    min_length: Optional[int] = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise InvalidValue("batch_size", self.batch_size, "expected an int >= 1")
        if self.min_length is not None and self.min_length < 1:
            raise InvalidValue("min_length", self.min_length, "expected an int >= 1 or null")
        if not 0.0 < self.val_fraction < 1.0:
            raise InvalidValue("val_fraction", self.val_fraction, "expected a float in (0, 1)")
        if not self.files:
            raise InvalidValue("files", list(self.files), "expected at least one stdlib file name")
        missing = missing_stdlib_files(self.files)
        if missing:
            raise InvalidValue(
                "files", list(self.files),
                f"{', '.join(missing)} not found under {stdlib_dir()}; list files that exist there",
            )


def check(model: GPTModelConfig, data: GPTDataConfig) -> None:
    """What ``build`` and the DataModule would reject later: batch lengths longer than the context,
    and texts too short for one validation window or one training batch.

    Raises:
        InvalidValue: with the key from the recipe's top (``data.min_length``, ...).
    """
    block = model.block_size
    if data.min_length is not None and data.min_length > block:
        raise InvalidValue("data.min_length", data.min_length,
                           f"expected at most model.block_size={block}, or null")
    total = stdlib_bytes(data.files)
    n_val = int(total * data.val_fraction)  # as StdlibTextDataModule.setup splits the text
    if n_val < block + 1:
        raise InvalidValue(
            "data.val_fraction", data.val_fraction,
            f"the validation text would be {n_val} of the {total} bytes, shorter than one window "
            f"of model.block_size + 1 = {block + 1}; raise data.val_fraction or add data.files",
        )
    windows = (total - n_val - 1) // block
    if windows < data.batch_size:
        raise InvalidValue(
            "data.batch_size", data.batch_size,
            f"the training text holds {windows} windows of model.block_size={block} bytes, fewer "
            "than one batch (the last incomplete batch is dropped); lower data.batch_size or add "
            "data.files",
        )


def build(model: GPTModelConfig, data: GPTDataConfig, optim: OptimConfig):
    """Build the ``gpt_lm`` LightningModule and DataModule (the recipe passed :func:`check`)."""
    from recipes.models.gpt import GPT
    from recipes.tasks._language_model import GPTLanguageModel

    check(model, data)
    net = GPT(
        vocab_size=VOCAB_SIZE, block_size=model.block_size, n_layer=model.n_layer,
        n_head=model.n_head, n_embd=model.n_embd, dropout=model.dropout, bias=model.bias,
        tie_weights=model.tie_weights,
    )
    return GPTLanguageModel(net, optim=optim), stdlib_datamodule(model.block_size, data)


def stdlib_datamodule(block_size: int, data: GPTDataConfig):
    """The byte-level language-model tasks' DataModule: windows of ``block_size`` bytes of the
    stdlib text ``data`` names (imports Lightning: call it from ``build`` only)."""
    from recipes.data.stdlib_text import StdlibTextDataModule

    return StdlibTextDataModule(
        block_size=block_size, batch_size=data.batch_size, val_fraction=data.val_fraction,
        files=data.files, shuffle_seed=data.shuffle_seed, min_length=data.min_length,
    )


TASK = Task(
    model=GPTModelConfig,
    data=GPTDataConfig,
    build=build,
    check=check,
    description="byte-level GPT (pre-LN, causal attention) on CPython stdlib sources; val loss/ppl",
    metrics={
        "train_loss": "training cross-entropy per byte, in nats",
        "val_loss": "validation cross-entropy per byte, in nats (a uniform guess: ln 256 = 5.55)",
        "val_ppl": "validation perplexity, exp(val_loss)",
        "val_bpb": "validation bits per byte, val_loss / ln 2",
    },
)
