"""CPCompressionCallback: compress at fit start / a step / fit end; fine-tune, save, resume."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

pl = pytest.importorskip("lightning.pytorch")

import integrations.cp_callback as cp_callback_module  # noqa: E402
from integrations.lightning import CPCompressionCallback  # noqa: E402
from quant.cp import CPConv2d, load_compressed  # noqa: E402
from tests.quant.cp_fixtures import digits_cnn  # noqa: E402

# the digits CNN's two middle convs (the first conv and the 32->10 classifier are too small to
# gain from CP and lose accuracy at rate 2; see tests/quant/test_cp_compress.py)
INCLUDE = ["net.2", "net.5"]
LR = 1e-3


class DigitsModule(pl.LightningModule):
    def __init__(self, net: nn.Module, *, schedule: bool = False, lr: float = LR) -> None:
        super().__init__()
        self.net = net.train()
        self.schedule, self.lr = schedule, lr
        self.example_input_array = torch.zeros(1, 1, 8, 8)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_acc", (self.net(batch[0]).argmax(1) == batch[1]).float().mean())

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        if not self.schedule:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loaders():
    _, x_train, y_train, x_test, y_test = digits_cnn()
    ds = torch.utils.data.TensorDataset
    train = torch.utils.data.DataLoader(ds(x_train[:512], y_train[:512]), batch_size=64,
                                        shuffle=True, generator=torch.Generator().manual_seed(0))
    val = torch.utils.data.DataLoader(ds(x_test, y_test), batch_size=400)
    return train, val


def _trainer(tmp_path, callbacks, max_steps, **kw):
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=tmp_path, callbacks=callbacks, **kw)


class Probe(pl.Callback):
    """Records, at the first training batch after compression, the optimizer's parameters and
    the factors' values."""

    def __init__(self, after_step: int = 0) -> None:
        self.after_step = after_step
        self.optimizer_params: set[int] | None = None
        self.latents: dict[str, torch.Tensor] = {}
        self.lr: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.optimizer_params is None and trainer.global_step >= self.after_step:
            self.optimizer_params = {id(p) for g in trainer.optimizers[0].param_groups
                                     for p in g["params"]}
            self.latents = {n: p.detach().clone() for n, p in pl_module.named_parameters()
                            if n.endswith(".latent")}
            self.lr = trainer.optimizers[0].param_groups[0]["lr"]
            self.latent_ids = {id(p) for n, p in pl_module.named_parameters()
                               if n.endswith(".latent")}

    def on_train_end(self, trainer, pl_module):
        self.latents_end = {n: p.detach().clone() for n, p in pl_module.named_parameters()
                            if n.endswith(".latent")}


def test_fit_start_fine_tunes_the_compressed_factors(tmp_path):
    train, val = _loaders()
    module = DigitsModule(copy.deepcopy(digits_cnn()[0]), lr=1e-2)
    cb = CPCompressionCallback(bits=4, include=INCLUDE, max_iter=10)
    probe = Probe()
    trainer = _trainer(tmp_path, [cb, probe], max_steps=12)
    trainer.fit(module, train, val)
    # the optimizer holds the CP layers' parameters (they were created before it)
    assert len(probe.latents) == 6
    assert probe.latent_ids <= probe.optimizer_params
    # fine-tuning moved every factor, and some codes crossed to another grid point
    flipped = 0
    for name, start in probe.latents.items():
        end = probe.latents_end[name]
        assert (end - start).abs().max() > 0, name
        layer = module.get_submodule(name.rsplit(".", 1)[0])
        flipped += int((torch.round(start / layer.scale) != layer.codes).sum())
    assert flipped > 0
    # ...and were frozen to int8 codes at the end of fit
    assert isinstance(module.net[2], CPConv2d) and not module.net[2].trainable
    assert cb.report is not None and [r.name for r in cb.report.layers] == INCLUDE
    assert cb.report.flops_after < 0.51 * cb.report.flops_before


def test_compress_at_step_rebuilds_optimizer_and_continues_schedule(tmp_path):
    train, val = _loaders()
    module = DigitsModule(copy.deepcopy(digits_cnn()[0]), schedule=True)
    cb = CPCompressionCallback(bits=8, include=INCLUDE, when=5, max_iter=5)
    probe = Probe(after_step=5)
    trainer = _trainer(tmp_path, [cb, probe], max_steps=8, val_check_interval=5,
                       check_val_every_n_epoch=None)
    trainer.fit(module, train, val)
    assert probe.latent_ids and probe.latent_ids <= probe.optimizer_params
    assert probe.lr == pytest.approx(LR / (1 + 5))  # the schedule continued at step 5
    assert "val_acc" in cb.metrics_before and cb.metrics_before["val_acc"] > 0.8
    assert trainer.global_step == 8
    assert isinstance(module.net[5], CPConv2d)


def test_fit_end_compresses_trained_model_and_checkpoint_reloads(tmp_path):
    train, val = _loaders()
    module = DigitsModule(copy.deepcopy(digits_cnn()[0]))
    cb = CPCompressionCallback(bits=4, include=INCLUDE, when="fit_end", max_iter=10)
    trainer = _trainer(tmp_path, [cb], max_steps=3)
    trainer.fit(module, train, val)
    assert isinstance(module.net[2], CPConv2d) and not module.net[2].trainable
    acc = trainer.validate(module, val, verbose=False)[0]["val_acc"]
    assert acc > 0.85
    path = tmp_path / "compressed.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=False)
    assert ckpt["state_dict"]["net.2.factors.0.codes"].dtype == torch.int8
    assert ckpt["callbacks"][cb.state_key]["plan"]["layers"][0]["rank"] == 40
    fresh = DigitsModule(copy.deepcopy(digits_cnn()[0]))
    load_compressed(fresh, ckpt["state_dict"])
    x = digits_cnn()[3][:50]
    assert torch.equal(fresh(x), module(x))
    # Trainer.validate(ckpt_path=...) on a fresh dense module rebuilds the CP layers too
    other = DigitsModule(copy.deepcopy(digits_cnn()[0]))
    cb2 = CPCompressionCallback(bits=4, include=INCLUDE, when="fit_end")
    again = _trainer(tmp_path, [cb2], max_steps=1).validate(other, val, ckpt_path=path,
                                                            verbose=False)
    assert again[0]["val_acc"] == acc and isinstance(other.net[5], CPConv2d)


def test_resume_restores_factors_without_solving_again(tmp_path, monkeypatch):
    train, val = _loaders()
    module = DigitsModule(copy.deepcopy(digits_cnn()[0]))
    cb = CPCompressionCallback(bits=4, include=INCLUDE, max_iter=5, freeze_at_end=False)
    trainer = _trainer(tmp_path, [cb], max_steps=3)
    trainer.fit(module, train, val)
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["state_dict"]

    calls = []
    monkeypatch.setattr(cp_callback_module, "solve_compressed",
                        lambda *a, **k: calls.append(1) or pytest.fail("solved again"))
    resumed = DigitsModule(copy.deepcopy(digits_cnn()[0]))
    cb2 = CPCompressionCallback(bits=4, include=INCLUDE, max_iter=5, freeze_at_end=False)
    probe = Probe()
    trainer2 = _trainer(tmp_path, [cb2, probe], max_steps=5)
    trainer2.fit(resumed, train, val, ckpt_path=path)
    assert calls == []
    assert trainer2.global_step == 5
    for name, value in probe.latents.items():
        assert torch.equal(value, saved[name]), name
    assert probe.latent_ids <= probe.optimizer_params


def test_resume_after_step_compression_builds_structure_from_checkpoint(tmp_path):
    train, val = _loaders()
    module = DigitsModule(copy.deepcopy(digits_cnn()[0]))
    cb = CPCompressionCallback(bits=8, include=INCLUDE, when=2, max_iter=5, freeze_at_end=False)
    trainer = _trainer(tmp_path, [cb], max_steps=4)
    trainer.fit(module, train, val)
    path = tmp_path / "after.ckpt"
    trainer.save_checkpoint(path)
    resumed = DigitsModule(copy.deepcopy(digits_cnn()[0]))  # dense: structure comes from ckpt
    cb2 = CPCompressionCallback(bits=8, include=INCLUDE, when=2, max_iter=5)
    probe = Probe()
    trainer2 = _trainer(tmp_path, [cb2, probe], max_steps=6)
    trainer2.fit(resumed, train, val, ckpt_path=path)
    assert isinstance(resumed.net[2], CPConv2d)
    assert probe.latent_ids and probe.latent_ids <= probe.optimizer_params
    assert cb2.report is None  # restored, not compressed again


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bits=1), "bits=1"),
        (dict(rate=1.0), "rate=1.0: the compression rate must be > 1"),
        (dict(when="start"), "when='start': expected 'fit_start'"),
        (dict(when=-1), "when=-1"),
        (dict(when=True), "when=True"),
        (dict(rank=0), "rank=0"),
        (dict(max_iter=-1), "max_iter=-1"),
    ],
    ids=["bits", "rate", "when-str", "when-neg", "when-bool", "rank", "max-iter"],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CPCompressionCallback(**kwargs)


def test_step_mode_refuses_several_processes():
    cb = CPCompressionCallback(when=10)
    trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace())
    with pytest.raises(ValueError, match="when=10: compressing in the middle of fit"):
        cb.setup(trainer, DigitsModule(nn.Linear(2, 2)), stage="fit")
