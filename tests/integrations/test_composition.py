"""HiRemateCallback composed with the replacing callbacks (few-bit, CP, interpolated adjoint).

Each plugin changes the network in ``setup``, before any ``on_fit_start``, so remat captures the
changed network whatever the order of the callbacks list (NOTE [ Composing with the other
callbacks ] in integrations/remat_callback.py). For each order: the captured graph holds the
replaced modules, the loss curve and the trained parameters are the plugin-only run's bit for bit,
and both callbacks' reports hold the numbers expected from the shapes.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

import ode  # noqa: E402
import remat  # noqa: E402
from integrations.fewbit_callback import FIRST_STEP, WARMUP_STEP  # noqa: E402
from integrations.lightning import (  # noqa: E402
    CPCompressionCallback,
    FewBitCallback,
    HiRemateCallback,
    InterpolatedAdjointCallback,
)
from quant.cp import CPLinear, rank_for_rate  # noqa: E402
from quant.fewbit import FewBitGELU, packed_bytes, replace_activations  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

# A deep narrow MLP on a batch large enough for activations to dominate: 70% of its eager step is
# feasible with few-bit GELUs (measured: the schedule peaks at ~67%) and with CP layers.
IN, WIDTH, DEPTH, CLASSES, BATCH = 32, 64, 6, 4, 256
BUDGET = "70%"
# The solver finds a feasible 70% plan of these MLPs in ~1-2 s; a cap keeps the tests short (the
# gradients are exact whatever schedule it returns).
TIME_LIMIT = 3.0
BITS = 2
STEPS = 2


class MLP(pl.LightningModule):
    """``net``: Linear -> (Linear, GELU) x DEPTH -> Linear; no ``example_input_array``."""

    def __init__(self) -> None:
        super().__init__()
        layers = [nn.Linear(IN, WIDTH)]
        for _ in range(DEPTH):
            layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = 4 * BATCH
    return TensorDataset(torch.randn(n, IN, generator=g),
                         torch.randint(0, CLASSES, (n,), generator=g))


class Recorder(pl.Callback):
    """Losses per step and the network the training loop runs."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.net = None

    def on_train_start(self, trainer, pl_module):
        self.net = getattr(pl_module, "net", None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(loss.detach().clone())


def _fit(model: pl.LightningModule, callbacks: list, tmp_path, *, steps: int = STEPS,
         data: TensorDataset | None = None, batch_size: int = BATCH) -> Recorder:
    recorder = Recorder()
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        default_root_dir=tmp_path, callbacks=[*callbacks, recorder],
    )
    trainer.fit(model, DataLoader(data if data is not None else _data(), batch_size=batch_size))
    return recorder


def _seeded(cls=MLP, **kwargs) -> pl.LightningModule:
    pl.seed_everything(0, verbose=False)
    return cls(**kwargs)


def _ordered(plugin, remat_callback, order: str) -> list:
    return [plugin, remat_callback] if order == "plugin-first" else [remat_callback, plugin]


def _eager_step_peak(model: pl.LightningModule) -> int:
    """Measured peak of one eager training step (forward + backward) on the first batch, as
    HiRemateCallback's warmup measures it."""
    model = copy.deepcopy(model)
    batch = next(iter(DataLoader(_data(), batch_size=BATCH)))
    with remat.track_memory(torch.device("cpu")) as tracker:
        model.training_step(batch, 0).backward()
    return tracker.peak_bytes


def _assert_same_training(composed: Recorder, reference: Recorder, model, reference_model):
    assert len(composed.losses) == STEPS
    assert torch.equal(torch.stack(composed.losses), torch.stack(reference.losses))
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
        assert torch.equal(p, q), name


# ---- few-bit + remat -----------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["plugin-first", "remat-first"])
def test_fewbit_and_remat_compose_in_either_order(order, tmp_path):
    reference_model = _seeded()
    reference_fewbit = FewBitCallback(bits=BITS)
    reference = _fit(reference_model, [reference_fewbit], tmp_path)

    model = _seeded()
    exact_peak = _eager_step_peak(model)
    fewbit = FewBitCallback(bits=BITS)
    hiremate = HiRemateCallback(BUDGET, time_limit=TIME_LIMIT, strict=True)
    seen = _fit(model, _ordered(fewbit, hiremate, order), tmp_path)

    # remat captured the few-bit network: its forward packs 2-bit codes (uint8) in every
    # FewBitGELU, and no exact GELU backward is left in the joint graph
    rm = seen.net
    assert isinstance(rm, remat.RematModule)
    gelus = {name for name, m in rm.original.named_children() if isinstance(m, FewBitGELU)}
    assert len(gelus) == DEPTH
    graph = rm.graphs[0]
    packing = {op.module for op in graph.ops[:graph.num_forward]
               if op.signature.startswith("aten.bitwise_or") and "uint8" in op.signature}
    assert packing == gelus
    assert not any(op.signature.startswith("aten.gelu_backward") for op in graph.ops)
    # the same loss curve and parameters as few-bit alone, bit for bit
    _assert_same_training(seen, reference, model, reference_model)
    assert isinstance(model.net[2], FewBitGELU)  # the user's module, few-bit, after fit

    # few-bit's report: measured on remat's eager warmup step, the same numbers as few-bit alone
    # on its first step; one 2-bit code per GELU input element
    report = fewbit.memory_report
    assert fewbit.measured_on == WARMUP_STEP and reference_fewbit.measured_on == FIRST_STEP
    assert report == reference_fewbit.memory_report
    assert report.calls == DEPTH
    assert report.codes_bytes == DEPTH * packed_bytes(BATCH * WIDTH, BITS)
    # each GELU input (float32, kept by nothing else) is exact GELU's saving
    assert report.exact_bytes - report.saved_bytes == DEPTH * (
        4 * BATCH * WIDTH - packed_bytes(BATCH * WIDTH, BITS))

    # remat's report: its baseline is the few-bit model's eager step, measured exactly (the
    # meter running in that step allocates nothing), below the exact model's
    fewbit_model = copy.deepcopy(_seeded())
    replace_activations(fewbit_model, BITS)
    assert hiremate.eager_peak_bytes == _eager_step_peak(fewbit_model) < exact_peak
    plan = hiremate.plans["net"]
    assert plan.eager_bytes + plan.outside_bytes == hiremate.eager_peak_bytes
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert hiremate.step_peak_bytes < hiremate.eager_peak_bytes


def test_fewbit_refuses_a_network_rematerialized_before_the_swap(tmp_path):
    model = _seeded()
    batch = next(iter(DataLoader(_data(), batch_size=BATCH)))[0]
    model.net = remat.rematerialize(model.net, batch, budget="100%", solver="none")
    with pytest.raises(ValueError, match=r"'net' is already rematerialized .* net\.2, net\.4"):
        _fit(model, [FewBitCallback(bits=BITS)], tmp_path)


def _without_times(report):
    """A CP report without its solve times (wall clock)."""
    return dataclasses.replace(
        report, layers=tuple(dataclasses.replace(r, seconds=0.0) for r in report.layers))


# ---- CP + remat ----------------------------------------------------------------------------------

CP_LAYERS = ["net.1", "net.3", "net.5"]  # three of the WIDTH x WIDTH layers
# Random weights have no low-rank structure: the CP error warning is expected here.
cp_error_expected = pytest.mark.filterwarnings("ignore:quant.cp. relative reconstruction error")


@cp_error_expected
@pytest.mark.parametrize("order", ["plugin-first", "remat-first"])
def test_cp_and_remat_compose_in_either_order(order, tmp_path):
    def cp_callback():
        return CPCompressionCallback(bits=8, include=CP_LAYERS, max_iter=3, freeze_at_end=False)

    reference_model = _seeded()
    reference_cp = cp_callback()
    reference = _fit(reference_model, [reference_cp], tmp_path)

    model = _seeded()
    cp = cp_callback()
    hiremate = HiRemateCallback(BUDGET, time_limit=TIME_LIMIT, strict=True)
    seen = _fit(model, _ordered(cp, hiremate, order), tmp_path)

    # the captured graph runs the CP layers' factors (their structure is made in setup; the
    # solved values are written into the same tensors, NOTE [ CP layers under remat ])
    rm = seen.net
    assert isinstance(rm, remat.RematModule)
    graph = rm.graphs[0]
    for name in CP_LAYERS:
        index = name.split(".")[1]
        assert isinstance(rm.original.get_submodule(index), CPLinear)
        assert {f"{index}.factors.0", f"{index}.factors.1"} <= {op.module for op in graph.ops}
    # the same loss curve and factors as CP alone, bit for bit (ADMM is seeded and runs on the
    # same weights in both runs)
    _assert_same_training(seen, reference, model, reference_model)

    # CP's report, FLOPs included (measured on the layers' first eager forward, remat's warmup
    # when remat comes first): 2 * in * out before, 2 * rank * (in + out) after, per sample
    rank = rank_for_rate((WIDTH, WIDTH), 2.0)
    assert [r.rank for r in cp.report.layers] == [rank] * len(CP_LAYERS)
    assert cp.report.flops_before == len(CP_LAYERS) * 2 * WIDTH * WIDTH
    assert cp.report.flops_after == len(CP_LAYERS) * 2 * rank * 2 * WIDTH
    assert _without_times(cp.report) == _without_times(reference_cp.report)
    # remat's report: its baseline is the CP model's eager step (the CP layers' rank-16
    # intermediates and straight-through factors make it larger than the dense model's here)
    cp_model = _seeded()
    cp_model.net = copy.deepcopy(reference_model.net)  # the CP structure; values do not matter
    assert hiremate.eager_peak_bytes == _eager_step_peak(cp_model) != _eager_step_peak(_seeded())


@cp_error_expected
def test_cp_at_fit_end_compresses_the_users_modules_after_remat(tmp_path):
    model = _seeded()
    cp = CPCompressionCallback(bits=8, include=CP_LAYERS, when="fit_end", max_iter=2)
    hiremate = HiRemateCallback(BUDGET, time_limit=TIME_LIMIT, strict=True)
    seen = _fit(model, [hiremate, cp], tmp_path, steps=1)
    assert isinstance(seen.net, remat.RematModule)  # trained rematerialized ...
    # ... and compressed after remat put the user's network back (on_train_end)
    assert all(isinstance(model.get_submodule(n), CPLinear) for n in CP_LAYERS)
    assert [r.name for r in cp.report.layers] == CP_LAYERS


def test_cp_at_a_step_is_refused_with_remat(tmp_path):
    cp = CPCompressionCallback(bits=8, include=CP_LAYERS, when=1)
    with pytest.raises(ValueError, match=r"when=1\).*HiRemateCallback.*when='fit_start'"):
        _fit(_seeded(), [HiRemateCallback(BUDGET), cp], tmp_path)


# ---- interpolated adjoint + remat ----------------------------------------------------------------

ODE_DIM = 8


class Dynamics(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(ODE_DIM, 16), nn.Tanh(), nn.Linear(16, ODE_DIM))

    def forward(self, t, y):
        return self.net(y)


class ODEModel(pl.LightningModule):
    """encoder (an MLP remat can capture) -> ODE block (it cannot) -> head."""

    def __init__(self) -> None:
        super().__init__()
        layers = [nn.Linear(IN, WIDTH), nn.GELU()]
        for _ in range(DEPTH - 1):
            layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
        self.encoder = nn.Sequential(*layers, nn.Linear(WIDTH, ODE_DIM))
        self.ode = ode.ODEBlock(Dynamics(), (0.0, 1.0), grad="adjoint", rtol=1e-4, atol=1e-6)
        self.head = nn.Linear(ODE_DIM, CLASSES)
        self.seen_grads: list[str] = []

    def training_step(self, batch, batch_idx):
        self.seen_grads.append(self.ode.config.grad)  # the warmup step included
        x, y = batch
        return F.cross_entropy(self.head(self.ode(self.encoder(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("order", ["plugin-first", "remat-first"])
def test_interpolated_adjoint_and_remat_compose_in_either_order(order, tmp_path):
    reference_model = _seeded(ODEModel)
    reference = _fit(reference_model, [InterpolatedAdjointCallback(n_nodes=9)], tmp_path)

    model = _seeded(ODEModel)
    adjoint = InterpolatedAdjointCallback(n_nodes=9)
    hiremate = HiRemateCallback(BUDGET, module=["encoder", "ode"], time_limit=TIME_LIMIT)
    with pytest.warns(UserWarning, match=r"'ode' trains unmodified \(strict=False\): it is an "
                                         r"ode.ODEBlock, whose solve branches on tensor values"):
        seen = _fit(model, _ordered(adjoint, hiremate, order), tmp_path)
    # remat's warmup ran the block as it trains (switched in setup), then every step did
    assert model.seen_grads == ["interpolated"] * (STEPS + 1)
    assert isinstance(hiremate.results["encoder"].plan, remat.Plan)
    skipped = hiremate.results["ode"]
    assert skipped.plan is None and "ode.ODEBlock" in skipped.skipped
    # the same loss curve and parameters as the interpolated adjoint alone
    assert reference_model.seen_grads == ["interpolated"] * STEPS
    _assert_same_training(seen, reference, model, reference_model)
    assert model.ode.config.grad == "adjoint"  # restored after fit


def test_remat_strict_refuses_an_ode_target_before_reading_a_batch(tmp_path):
    model = _seeded(ODEModel)
    hiremate = HiRemateCallback(BUDGET, module=["ode"], strict=True)
    with pytest.raises(remat.CaptureError, match=r"'ode' cannot be rematerialized: it is an "
                                                  r"ode.ODEBlock"):
        _fit(model, [hiremate], tmp_path)
    assert model.seen_grads == []  # no warmup step ran
