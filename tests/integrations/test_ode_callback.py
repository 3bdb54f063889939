"""InterpolatedAdjointCallback: switches ODE blocks during fit, logs NFE, checks gradients."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

import ode  # noqa: E402
from integrations.lightning import InterpolatedAdjointCallback  # noqa: E402


class Dynamics(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, dim))

    def forward(self, t, y):
        return self.net(y)


class ODEClassifier(pl.LightningModule):
    def __init__(self, grad="adjoint"):
        super().__init__()
        self.encoder = nn.Linear(6, 4)
        self.ode = ode.ODEBlock(Dynamics(4), (0.0, 1.0), grad=grad, rtol=1e-5, atol=1e-7)
        self.head = nn.Linear(4, 3)
        self.seen_grads: list[str] = []

    def forward(self, x):
        return self.head(self.ode(self.encoder(x)))

    def training_step(self, batch, batch_idx):
        self.seen_grads.append(getattr(self.ode, "config", None) and self.ode.config.grad)
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 6, generator=gen)
    y = torch.randint(0, 3, (32,), generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _trainer(callback, steps=3):
    return pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, callbacks=[callback],
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)


def test_switches_blocks_during_fit_and_restores_them():
    model = ODEClassifier(grad="adjoint")
    before = model.ode.config
    callback = InterpolatedAdjointCallback(n_nodes=9, check_every_n_steps=0)
    trainer = _trainer(callback)
    trainer.fit(model, _loader())
    assert model.seen_grads == ["interpolated"] * 3
    assert model.ode.config is before and model.ode.name is None  # restored
    assert not model.ode._forward_hooks  # hook removed
    metrics = trainer.callback_metrics
    assert metrics["ode/forward_nfe"] > 0 and metrics["ode/backward_nfe"] > 0
    assert 0 <= metrics["ode/interp_error"] < 1e-2


def test_gradient_check_logs_a_small_error():
    model = ODEClassifier(grad="backprop")
    callback = InterpolatedAdjointCallback(n_nodes=17, rtol=1e-6, atol=1e-8,
                                           check_every_n_steps=2)
    trainer = _trainer(callback, steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "gradient check" warning expected
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers).*")
        trainer.fit(model, _loader())
    assert set(callback.last_check) == {"ode"}
    # float32 dynamics at rtol 1e-6 vs a backprop reference at 1e-7: measured ~1e-6
    assert callback.last_check["ode"] < 1e-4
    assert trainer.callback_metrics["ode/grad_rel_error"] == pytest.approx(
        callback.last_check["ode"])


def test_gradient_check_warns_above_threshold():
    model = ODEClassifier()
    callback = InterpolatedAdjointCallback(n_nodes=3, rtol=1e-3, atol=1e-4,
                                           check_every_n_steps=1, check_warn_above=1e-12)
    with pytest.warns(UserWarning, match="gradient check at step 0: ode's interpolated"):
        _trainer(callback, steps=1).fit(model, _loader())


def test_blocks_are_named_by_module_path_during_fit():
    class Probe(ODEClassifier):
        def training_step(self, batch, batch_idx):
            self.names = self.ode.name
            return super().training_step(batch, batch_idx)

    model = Probe()
    _trainer(InterpolatedAdjointCallback(), steps=1).fit(model, _loader())
    assert model.names == "ode" and model.ode.name is None


def test_no_blocks_warns():
    class Plain(ODEClassifier):
        def __init__(self):
            super().__init__()
            self.ode = nn.Identity()

    with pytest.warns(UserWarning, match="no ode.ODEBlock"):
        _trainer(InterpolatedAdjointCallback(), steps=1).fit(Plain(), _loader())


@pytest.mark.parametrize("kwargs,match", [
    (dict(n_nodes=4), "n_nodes=4"),
    (dict(on_interp_error="skip"), "on_interp_error='skip'"),
    (dict(check_every_n_steps=-1), "check_every_n_steps=-1"),
    (dict(check_rtol=0.0), "rtol=0.0"),
    (dict(check_warn_above=0), "check_warn_above=0"),
], ids=["n_nodes", "policy", "check-steps", "check-rtol", "check-warn"])
def test_bad_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        InterpolatedAdjointCallback(**kwargs)


def test_core_package_does_not_import_lightning():
    import subprocess
    import sys

    code = "import sys, ode; assert not any(m.split('.')[0] in ('lightning', " \
           "'pytorch_lightning', 'accelerate', 'omegaconf') for m in sys.modules), 'leak'"
    subprocess.run([sys.executable, "-c", code], check=True)
