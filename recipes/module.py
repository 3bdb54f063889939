"""Base LightningModule of the recipe tasks: the network is ``self.net``, a plain ``nn.Module``.

NOTE [ The network is self.net ]
    Callbacks that transform the model (``HiRemateCallback``, the quant/ode callbacks) target the
    network, not the LightningModule: by default every top-level child holding parameters, here
    exactly one, ``net``. Keep the loss and the metrics outside ``net`` so the captured graph is the
    network's alone. ``torch.compile``, if used, goes on ``self.net`` too, never on the
    LightningModule (Lightning #21836: ``self.log`` inside a compiled ``training_step`` crashes).
"""
from __future__ import annotations

import lightning as L
from torch import nn
from typing_extensions import override

from recipes.optim import OptimConfig, build_optimizer

__all__ = ["RecipeModule"]


class RecipeModule(L.LightningModule):
    """Holds ``net`` and builds the optimizer from the recipe's ``optim:`` section.

    Subclasses implement ``training_step`` and ``validation_step`` and log ``train_loss``
    (``on_step=True``) and ``val_*`` metrics (``on_epoch=True``); see NOTE [ The network is self.net ].

    Args:
        net: The network.
        optim: The ``optim:`` section.
    """

    def __init__(self, net: nn.Module, *, optim: OptimConfig) -> None:
        super().__init__()
        self.net = net
        self.optim_config = optim

    @override
    def configure_optimizers(self):  # noqa: D102 - Lightning hook
        optimizer, scheduler = build_optimizer(
            self, self.optim_config, total_steps=max(1, self.trainer.max_steps)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
