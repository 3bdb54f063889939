"""Task ``llama_lm``: a byte-level Llama-style decoder (Hugging Face ``transformers``, built from a
config) trained on CPython's stdlib sources, ready for FSDP2 (``trainer.strategy: fsdp2``).

The data, the metrics and the training step are ``gpt_lm``'s: ``train_loss`` every step and, on
validation, ``val_loss`` (mean next-byte cross-entropy in nats), ``val_ppl`` and ``val_bpb``.
Under ``trainer.strategy: fsdp2`` the network is sharded as users shard a decoder: each layer with
``fully_shard``, then the whole network (``configure_model``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from recipes.errors import InvalidValue, RecipeError
from recipes.optim import OptimConfig
from recipes.registry import Task
from recipes.tasks.gpt_lm import TASK as GPT_TASK
from recipes.tasks.gpt_lm import (VOCAB_SIZE, GPTDataConfig, check_decoder_sizes,
                                  stdlib_datamodule)
from recipes.tasks.gpt_lm import check as check_text

__all__ = ["LlamaModelConfig", "TASK"]


@dataclass
class LlamaModelConfig:
    """The ``model:`` section of ``llama_lm`` (see :class:`recipes.models.llama.HFLlama`).

    Attributes:
        block_size: Context length in bytes; also the length of every training sequence.
        n_layer: Decoder layers (each one an FSDP2 unit under ``trainer.strategy: fsdp2``).
        n_head: Attention heads (must divide ``n_embd``), as many key-value heads.
        n_embd: Hidden width.
        intermediate_size: Width of the SwiGLU MLP; ``null``: 8/3 of ``n_embd`` rounded down to
            a multiple of 8, as Llama sizes it.
        attention_dropout: Dropout on the attention weights, in [0, 1).
    """

    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    intermediate_size: Optional[int] = None
    attention_dropout: float = 0.0

    def __post_init__(self) -> None:
        check_decoder_sizes(self)
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise InvalidValue("intermediate_size", self.intermediate_size,
                               "expected an int >= 1 or null (8/3 of n_embd)")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise InvalidValue("attention_dropout", self.attention_dropout,
                               "expected a float in [0, 1)")

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size or max(8, int(8 * self.n_embd / 3) // 8 * 8)


def check(model: LlamaModelConfig, data: GPTDataConfig) -> None:
    """``gpt_lm``'s checks of the text against the context, and that ``transformers`` is there.

    Raises:
        InvalidValue: as ``gpt_lm``'s check.
        RecipeError: without Hugging Face ``transformers``, naming the install command.
    """
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise RecipeError('task llama_lm needs Hugging Face transformers: pip install '
                          '"hiremate[hf]" (or pip install transformers)')
    check_text(model, data)


def build(model: LlamaModelConfig, data: GPTDataConfig, optim: OptimConfig):
    """Build the ``llama_lm`` LightningModule and DataModule (the recipe passed :func:`check`)."""
    from recipes.models.llama import HFLlama
    from recipes.tasks._language_model import ShardedLanguageModel

    check(model, data)
    net = HFLlama(vocab_size=VOCAB_SIZE, block_size=model.block_size, n_layer=model.n_layer,
                  n_head=model.n_head, n_embd=model.n_embd, intermediate_size=model.mlp_width,
                  attention_dropout=model.attention_dropout)
    return ShardedLanguageModel(net, optim=optim), stdlib_datamodule(model.block_size, data)


TASK = Task(
    model=LlamaModelConfig,
    data=GPTDataConfig,
    build=build,
    check=check,
    description="byte-level Llama (HF transformers, RMSNorm, rotary, SwiGLU) on CPython stdlib "
                "sources, FSDP2-ready; val loss/ppl",
    metrics=dict(GPT_TASK.metrics),
)
