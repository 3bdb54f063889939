"""HiRemateCallback on variable-size batches and many fits in one process, as users run it.

No dynamo reset between fits: a script that calls ``trainer.fit`` ten times must keep
rematerializing (NOTE [ Owning the compiled frames ] in ``remat/module.py``).
"""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

pl = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

import remat  # noqa: E402
from integrations.lightning import HiRemateCallback  # noqa: E402

VOCAB, MAX_LEN = 96, 256


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


class LitGPT(pl.LightningModule):
    def __init__(self):
        super().__init__()
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                      n_positions=MAX_LEN, bos_token_id=0, eos_token_id=0)
        self.net = transformers.GPT2LMHeadModel(cfg)

    def training_step(self, batch, batch_idx):
        return self.net(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def padded_batches(steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Dynamic padding: every batch has its own length (16-256) and size (1-6)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (rng.randint(1, 6), rng.randint(16, MAX_LEN)), generator=gen)
            for _ in range(steps)]


class Losses(pl.Callback):
    def __init__(self):
        self.losses, self.net = [], None

    def on_train_start(self, trainer, pl_module):
        self.net = pl_module.net

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(loss.detach().clone())


def fit_gpt(batches, callback=None):
    pl.seed_everything(0, verbose=False)
    model = LitGPT()
    losses = Losses()
    trainer = pl.Trainer(max_steps=len(batches), accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False,
                         callbacks=[losses, *([callback] if callback else [])])
    trainer.fit(model, DataLoader(batches, batch_size=None, shuffle=False))
    return torch.stack(losses.losses), losses.net


def test_dynamic_padding_in_lightning_same_losses_few_solves():
    batches = padded_batches(20)
    assert len({tuple(b.shape) for b in batches}) == 20
    plain, _ = fit_gpt(batches)
    callback = HiRemateCallback(budget="65%", time_limit=10)
    losses, net = fit_gpt(batches, callback)
    assert isinstance(net, remat.RematModule)
    assert torch.equal(losses, plain), (losses - plain).abs().max()
    family = next(iter(net.shapes.families))
    choices = [c for (key, _), c in net.shapes.choices.items() if key == family]
    assert len(choices) == 20  # every batch size was priced on the one captured graph
    assert len(net.plans) <= 5  # ceil(log2(256 / 16)) + 1


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(8))
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


class LitDeep(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Deep()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_ten_fits_in_one_process_are_all_rematerialized():
    gen = torch.Generator().manual_seed(0)
    for k in range(10):
        size = 64 + 8 * k  # a new batch size each fit, as a sweep would
        data = [(torch.randn(size, 32, generator=gen), torch.randint(4, (size,), generator=gen))
                for _ in range(3)]
        callback = HiRemateCallback(budget="80%", solver="dp", time_limit=5)
        losses = Losses()
        trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, callbacks=[losses, callback])
        trainer.fit(LitDeep(), DataLoader(data, batch_size=None))
        assert isinstance(losses.net, remat.RematModule), k
        plan = callback.plans["net"]
        assert plan.predicted_peak_bytes <= plan.budget_bytes < plan.baseline_bytes, k
