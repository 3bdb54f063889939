"""FewBitCallback in a real Lightning fit."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from integrations.lightning import FewBitCallback  # noqa: E402
from quant.fewbit import FewBitGELU, FewBitSiLU, packed_bytes  # noqa: E402

BATCH, IN, HIDDEN = 32, 16, 64


class Classifier(pl.LightningModule):
    def __init__(self, extra: nn.Module | None = None):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.SiLU(),
            *(extra,) if extra is not None else (), nn.Linear(HIDDEN, 4),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8 * BATCH, IN, generator=g), torch.randint(0, 4, (8 * BATCH,), generator=g))
    return DataLoader(data, batch_size=BATCH)


def _trainer(callback, tmp_path, **kwargs):
    return pl.Trainer(
        max_epochs=1, limit_train_batches=4, callbacks=[callback], logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        **kwargs,
    )


def test_fit_replaces_activations_and_measures_the_saving(tmp_path, caplog):
    torch.manual_seed(0)
    model = Classifier()
    keys = list(model.state_dict())
    before = model.net[0].weight.detach().clone()
    callback = FewBitCallback(bits=2)
    with caplog.at_level(logging.INFO):
        _trainer(callback, tmp_path, enable_checkpointing=False).fit(model, _loader())
    assert isinstance(model.net[1], FewBitGELU) and isinstance(model.net[3], FewBitSiLU)
    assert list(model.state_dict()) == keys
    assert not torch.equal(model.net[0].weight, before)  # it trained
    assert [r.name for r in callback.report.replaced] == ["net.1", "net.3"]
    report = callback.memory_report
    numel = BATCH * HIDDEN
    assert report.calls == 2
    assert report.codes_bytes == 2 * packed_bytes(numel, 2)
    # GELU and SiLU each saved their float32 input; now 2 bits per element
    assert report.exact_bytes - report.saved_bytes == 2 * (4 * numel - packed_bytes(numel, 2))
    assert "replaced 2 module(s)" in caplog.text and "less" in caplog.text


def test_checkpoint_keeps_keys_and_callback_state(tmp_path):
    torch.manual_seed(0)
    model = Classifier()
    callback = FewBitCallback(bits=3)
    trainer = _trainer(callback, tmp_path)
    trainer.fit(model, _loader())
    path = tmp_path / "fewbit.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    state = next(v for k, v in checkpoint["callbacks"].items() if "FewBitCallback" in k)
    assert state["bits"] == 3 and [r[0] for r in state["replaced"]] == ["net.1", "net.3"]
    plain = Classifier()
    plain.load_state_dict(checkpoint["state_dict"])  # an exact model loads it unchanged
    restored = FewBitCallback(bits=3)
    restored.load_state_dict(state)
    assert restored.memory_report == callback.memory_report


def test_strict_fails_the_fit_when_something_is_not_replaced(tmp_path):
    model = Classifier(extra=nn.PReLU())
    with pytest.raises(ValueError, match="PReLU"):
        _trainer(FewBitCallback(strict=True), tmp_path, enable_checkpointing=False).fit(
            model, _loader()
        )


def test_exclude_and_measure_off(tmp_path):
    model = Classifier()
    callback = FewBitCallback(bits=1, exclude=[nn.SiLU], measure=False)
    _trainer(callback, tmp_path, enable_checkpointing=False).fit(model, _loader())
    assert isinstance(model.net[1], FewBitGELU) and type(model.net[3]) is nn.SiLU
    assert callback.memory_report is None


@pytest.mark.parametrize(
    "kwargs, error, match",
    [({"bits": 5}, ValueError, "bits=5"), ({"bits": "2"}, TypeError, "bits='2'"),
     ({"include": [3]}, TypeError, "include=")],
    ids=["bits", "bits-type", "include"],
)
def test_bad_arguments_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        FewBitCallback(**kwargs)
