"""The LightningModule of the ``gpt_lm`` task: next-byte cross-entropy, ``train_loss`` per step and
``val_loss`` / ``val_ppl`` / ``val_bpb`` on validation.

Kept out of ``recipes/tasks/gpt_lm.py``, which the registry imports to validate a recipe: that
module holds only the config dataclasses and imports this (and Lightning) inside ``build``.
"""
from __future__ import annotations

import math

import torch
from torch.nn import functional as F
from typing_extensions import override

from recipes.module import RecipeModule

__all__ = ["GPTLanguageModel"]


class GPTLanguageModel(RecipeModule):
    """Next-byte prediction with cross-entropy; ``self.net`` is a :class:`GPT`."""

    @override
    def training_step(self, batch, batch_idx):  # noqa: D102 - Lightning hook
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    @override
    def on_validation_epoch_start(self) -> None:  # noqa: D102 - Lightning hook
        self._val_nll = torch.zeros((), dtype=torch.float64, device=self.device)
        self._val_tokens = 0

    @override
    def validation_step(self, batch, batch_idx):  # noqa: D102 - Lightning hook
        x, y = batch
        logits = self.net(x)
        nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        self._val_nll += nll.double()
        self._val_tokens += y.numel()

    @override
    def on_validation_epoch_end(self) -> None:  # noqa: D102 - Lightning hook
        loss = (self._val_nll / max(1, self._val_tokens)).float()
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_ppl", torch.exp(loss), sync_dist=True)
        self.log("val_bpb", loss / math.log(2.0), sync_dist=True)


class ShardedLanguageModel(GPTLanguageModel):
    """:class:`GPTLanguageModel` whose network FSDP2 shards under ``trainer.strategy: fsdp2``:
    each of ``net.layers`` with ``fully_shard``, then ``net`` (the module ``training_step``
    calls, as ``HiRemateCallback`` needs: NOTE [ Remat inside an FSDP unit ] in
    ``integrations/_fsdp.py``). Without a device mesh (any other strategy) nothing is sharded."""

    @override
    def configure_model(self) -> None:  # noqa: D102 - Lightning hook
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = self.device_mesh
        if mesh is None or isinstance(self.net, FSDPModule):  # not FSDP2, or sharded already
            return
        mesh = mesh["data_parallel"]
        for layer in self.net.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)
