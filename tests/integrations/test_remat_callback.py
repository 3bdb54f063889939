"""HiRemateCallback in real Lightning fits: same loss curve bit for bit, resume, errors, DDP."""
from __future__ import annotations

import math

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

import remat  # noqa: E402
from integrations.lightning import HiRemateCallback  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# A deep, narrow MLP on a large batch: activations dominate the step's memory, so 50% of the
# baseline is feasible (lowest possible peak ~29% at batch 512). 8 full batches and one short one
# (64) per epoch: 20 steps cross an epoch boundary and capture the short batch's shape too.
IN, WIDTH, DEPTH, CLASSES = 16, 64, 16, 4
BATCH, SHORT = 512, 64
# The hierarchical solver finds a 50% plan of this MLP in ~3 s; a cap keeps the tests short.
TIME_LIMIT = 4.0
# Measured: the first step with remat peaks at 49% of the unmodified warmup step (CPU profiler,
# deterministic allocations); 70% leaves room for allocator detail while still proving a saving.
MEASURED_RATIO_MAX = 0.7


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


class Net(nn.Module):
    def __init__(self, data_dependent: bool = False):
        super().__init__()
        self.data_dependent = data_dependent
        self.inp = nn.Linear(IN, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.bn(self.inp(x)))
        if self.data_dependent and h.sum() > 0:  # cannot be captured as one graph
            h = -h
        for layer in self.layers:
            h = torch.tanh(layer(h))
        # The root reads self.training: catches a train/eval flag that does not reach the
        # original module after validation (NOTE [ Keeping the original's train/eval flag ... ]).
        return self.out(F.dropout(h, 0.1, self.training))


class LitMLP(pl.LightningModule):
    def __init__(self, net: nn.Module | None = None, aux: bool = True):
        super().__init__()
        self.net = net if net is not None else Net()
        if aux:  # holds parameters but is never called: not a default target
            self.aux = nn.Linear(3, 3)
        self.act = nn.ReLU()        # no parameters: not a target
        self.batches_started = 0    # training steps of the fit loop (the warmup is not one)

    def on_train_batch_start(self, batch, batch_idx):
        self.batches_started += 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class ManualMLP(LitMLP):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


class Recorder(pl.Callback):
    """Per-step losses, and what the training loop sees at its start."""

    def __init__(self):
        self.losses = []
        self.at_train_start = None

    def on_train_start(self, trainer, pl_module):
        optimizer_params = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
        self.at_train_start = SimpleNamespace(
            net=pl_module.net, param_ids=[id(p) for p in pl_module.parameters()],
            optimizer_param_ids=optimizer_params, keys=list(pl_module.state_dict()),
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(loss.detach().clone())


def _data(n: int = 8 * BATCH + SHORT) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, IN, generator=g),
                         torch.randint(0, CLASSES, (n,), generator=g))


def fit(model, callback=None, *, max_steps=20, ckpt_path=None, callbacks=(), seeded=False,
        **kwargs):
    """Fit with validation every 5 steps; returns (losses tensor, recorder). The training data is
    shuffled by the global RNG, or (``seeded``) by the loader's own generator."""
    recorder = Recorder()
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[recorder, *callbacks, *([callback] if callback is not None else [])],
        **{"enable_checkpointing": False, "val_check_interval": 5, "limit_val_batches": 2,
           **kwargs},
    )
    data = _data()
    shuffle = torch.Generator().manual_seed(2) if seeded else None
    trainer.fit(model, DataLoader(data, batch_size=BATCH, shuffle=True, generator=shuffle),
                DataLoader(data, batch_size=BATCH), ckpt_path=ckpt_path)
    return torch.stack(recorder.losses), recorder


def _seeded(cls=LitMLP, **kwargs):
    pl.seed_everything(0, verbose=False)
    return cls(**kwargs)


def test_loss_curve_is_bitwise_equal_and_memory_is_halved(tmp_path):
    plain_model = _seeded()
    plain, _ = fit(plain_model, default_root_dir=tmp_path)

    model = _seeded()
    net, ids, keys = model.net, [id(p) for p in model.parameters()], list(model.state_dict())
    callback = HiRemateCallback(budget="50%", time_limit=TIME_LIMIT)
    losses, seen = fit(model, callback, default_root_dir=tmp_path)

    assert torch.equal(losses, plain), (losses - plain).abs().max()
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)
    # During training: the network was swapped, the same Parameter objects trained, keys kept.
    start = seen.at_train_start
    assert isinstance(start.net, remat.RematModule) and start.net.original is net
    assert start.param_ids == ids and start.optimizer_param_ids == set(ids)
    assert start.keys == keys
    # After fit the user's own module is back.
    assert model.net is net and list(model.state_dict()) == keys
    # Only `net` was a target (aux is never called, act has no parameters).
    assert list(callback.results) == ["net"]
    first, *others = callback.results["net"].plans
    # Half of the eager step measured on the example, less what the step adds outside the module.
    step_bytes = first.eager_bytes + first.outside_bytes
    assert first.budget_bytes == math.floor(0.5 * step_bytes - first.outside_bytes)
    assert first.predicted_peak_bytes <= first.budget_bytes
    # The short last batch is captured once more with dynamic sizes (NOTE [ Static first ]):
    # the same graph op for op, it runs the warmup's schedule re-priced at its size instead of
    # being solved again (NOTE [ The static schedule serves the dynamic graph ]).
    assert len(others) == 1 and others[0].detail.startswith("the static capture's plan")
    shapes = start.net.shapes
    assert {c.sizes for c in shapes.choices.values()} == {(), (BATCH,), (SHORT,)}
    assert all(c.fits for c in shapes.choices.values())
    # Measured on CPU with the profiler: the first step with remat vs the unmodified warmup.
    assert callback.step_peak_bytes < MEASURED_RATIO_MAX * callback.eager_peak_bytes
    # The whole step, loss included, within the budget of the eager warmup step.
    assert callback.step_peak_bytes <= 0.5 * callback.eager_peak_bytes * 1.02


def test_manual_optimization_and_a_seeded_loader_are_undisturbed(tmp_path):
    plain, _ = fit(_seeded(ManualMLP), max_steps=6, seeded=True, default_root_dir=tmp_path)
    model = _seeded(ManualMLP)
    callback = HiRemateCallback(budget="50%", solver="dp")
    losses, seen = fit(model, callback, max_steps=6, seeded=True, default_root_dir=tmp_path)
    assert isinstance(seen.at_train_start.net, remat.RematModule)
    assert torch.equal(losses, plain)


def test_resume_reuses_the_plan_and_checkpoint_loads_into_the_plain_model(tmp_path, monkeypatch,
                                                                          caplog):
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = _seeded()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1)
    fit(model, HiRemateCallback(budget="50%", time_limit=TIME_LIMIT), max_steps=10,
        callbacks=[checkpoint], enable_checkpointing=True, default_root_dir=tmp_path)
    path = tmp_path / "epoch=1-step=10.ckpt"
    assert path.exists(), sorted(os.listdir(tmp_path))

    # The checkpoint (saved while `net` was swapped) loads into the plain model, keys unchanged.
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    plain = LitMLP()
    plain.load_state_dict(state)  # strict
    for (name, p), q in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(p, q), name

    def no_solving(*args, **kwargs):
        raise AssertionError("the solver ran although the plan was in the checkpoint")

    monkeypatch.setattr(remat.dynamo_backend, "plan_graph", no_solving)
    resumed = LitMLP()
    callback = HiRemateCallback(budget="50%", time_limit=TIME_LIMIT)
    with caplog.at_level(logging.INFO):
        losses, seen = fit(resumed, callback, max_steps=14, ckpt_path=str(path),
                           enable_checkpointing=True, default_root_dir=tmp_path)
    assert callback.plans["net"].cache_hit
    said = caplog.text  # a cache hit is not announced as a solve
    assert "capturing 'net', then solving unless the plan cache has it" in said
    assert "'net' ready in" in said and "(plan from the cache)" in said
    assert isinstance(seen.at_train_start.net, remat.RematModule)
    assert len(losses) == 4 and torch.isfinite(losses).all()


def test_a_solve_cut_by_its_time_limit_says_so(tmp_path, caplog):
    """Issue 14: a solve that time_limit stopped early gives a plan that may change with machine
    load; the user is told, with the fix."""
    callback = HiRemateCallback(budget="50%", time_limit=1e-3)
    with caplog.at_level(logging.INFO):
        fit(_seeded(), callback, max_steps=2, default_root_dir=tmp_path)
    plan = callback.plans["net"]
    assert plan.status == "time_limit" and "cut by the time limit" in plan.detail
    assert "time_limit cut the solve short" in caplog.text
    assert "raise time_limit (was 0.001 s)" in caplog.text


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"budget": "150%"}, ValueError,
         r"budget='150%': a percentage budget must be in \(0%, 100%\]"),
        ({"budget": "-1GB"}, ValueError, r"budget='-1GB': a byte budget must be at least 1 byte"),
        ({"budget": "abc"}, ValueError, r"budget='abc': cannot read this"),
        ({"solver": "hirarchical"}, ValueError,
         r"solver='hirarchical': unknown solver; did you mean 'hierarchical'\?"),
        ({"budget": 50}, ValueError, r'budget=50: a bare number is a budget only as a fraction in '
                                     r'\(0, 1\]; for 50 write its unit: "50%" .* "50MiB"'),
        ({"budget": 1_500_000_000}, ValueError, r'budget=1500000000: a bare number .* '
                                                r'"1500000000B" for 1500000000 bytes'),
        ({"time_limit": 0}, ValueError, r"time_limit=0: expected a finite number of seconds > 0"),
        ({"time_limit": float("nan")}, ValueError,
         r"time_limit=nan: expected a finite number of seconds > 0; pass e.g. time_limit=60"),
        ({"time_limit": float("inf")}, ValueError, r"time_limit=inf: expected a finite number"),
        ({"time_limit": -1}, ValueError, r"time_limit=-1: expected a finite number"),
        ({"time_limit": True}, TypeError, r"time_limit=True: expected a number of seconds > 0, "
                                          r"got a bool"),
        ({"time_limit": "60"}, TypeError, r"time_limit='60': expected a number of seconds"),
        ({"module": ""}, ValueError, r"'' is not an attribute path"),
        ({"module": 3}, TypeError, r"module=3: expected None \(automatic\)"),
        ({"module": ["net", "net.inp"]}, ValueError, r"'net.inp' is inside 'net'"),
        ({"strict": "yes"}, TypeError, r"strict='yes': expected True or False"),
        ({"cache_dir": 5}, TypeError, r"cache_dir=5: expected a directory path or None"),
    ],
    ids=["150%", "-1GB", "abc", "bare-50", "bare-bytes", "solver-typo", "time-limit-0",
         "time-limit-nan", "time-limit-inf", "time-limit-negative", "time-limit-bool",
         "time-limit-str", "module-empty",
         "module-int", "module-nested", "strict-str", "cache-dir-int"],
)
def test_bad_arguments_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        HiRemateCallback(**kwargs)


class _ChecksWidth(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, IN)

    def forward(self, x):
        if x.shape[-1] != IN:
            raise ValueError(f"expected {IN} features, got {x.shape[-1]}")
        return self.lin(x)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize(
    "module, batch, error, text",
    [
        (lambda: nn.Linear(IN, IN, device="meta"), torch.randn(8, IN), ValueError,
         "rematerialize: the module's parameter 'weight' is on the meta device (a shape without "
         "data); remat runs and measures the training step, so the model and the batch must "
         "hold real tensors on the CPU or a CUDA GPU. Materialize the model first, e.g. "
         "model.to_empty(device='cpu')"),
        (_ChecksWidth, torch.randn(8, IN + 1), ValueError, f"expected {IN} features, got {IN + 1}"),
    ],
    ids=["meta-device", "users-own-ValueError"],
)
def test_the_callbacks_solve_passes_user_errors_through(module, batch, error, text, strict):
    """``solve_targets`` (what HiRemateCallback and HiRemateAccelerator run in fit/prepare) calls
    ``rematerialize``: a meta model, or the model's own ValueError, reaches the user as such,
    with or without ``strict``, not as a RematError or a "trains unmodified" warning."""
    from integrations._remat_shared import Target, check_settings, solve_targets

    settings = check_settings(budget="90%", solver="dp", time_limit=TIME_LIMIT, module=None,
                              cache_dir=None, strict=strict, verbose=False)
    target = Target("net", None, "net", module(), explicit=True)
    with pytest.raises(error) as info:
        solve_targets([target], {"net": ((batch,), {})}, settings, remat.PlanCache(),
                      owner="HiRemateCallback")
    assert str(info.value).startswith(text) and not isinstance(info.value, remat.RematError)
    if isinstance(target.module, _ChecksWidth):
        assert "hiremate: raised by _ChecksWidth's own training step" in \
            "\n".join(info.value.__notes__)


def test_unknown_module_fails_before_any_training_step(tmp_path):
    model = LitMLP()
    with pytest.raises(ValueError, match=r"HiRemateCallback\(module='nett'\): LitMLP has no "
                       r"submodule 'nett'; did you mean 'net'\? Top-level modules holding "
                       r"parameters: net, aux"):
        fit(model, HiRemateCallback(module="nett"), default_root_dir=tmp_path)
    assert model.batches_started == 0


def test_named_module_that_is_not_called_fails_before_any_training_step(tmp_path):
    model = LitMLP()
    with pytest.raises(ValueError, match=r"'aux' was not called by training_step"):
        fit(model, HiRemateCallback(module=["net", "aux"], solver="dp"), default_root_dir=tmp_path)
    assert model.batches_started == 0


@pytest.mark.parametrize(
    "net_kwargs, budget, error",
    [({"data_dependent": True}, "50%", remat.CaptureError),
     ({}, "1KB", remat.InfeasibleBudgetError)],
    ids=["uncapturable", "infeasible"],
)
def test_strict_raises_before_any_step(tmp_path, net_kwargs, budget, error):
    model = LitMLP(net=Net(**net_kwargs))
    with pytest.raises(error):
        fit(model, HiRemateCallback(budget=budget, solver="dp", strict=True), max_steps=3,
            default_root_dir=tmp_path)
    assert model.batches_started == 0


@pytest.mark.parametrize(
    "net_kwargs, budget, match",
    [({"data_dependent": True}, "50%", r"'net' trains unmodified \(strict=False\): CaptureError"),
     ({}, "1KB", r"'net' trains unmodified \(strict=False\): InfeasibleBudgetError")],
    ids=["uncapturable", "infeasible"],
)
def test_not_strict_warns_and_trains_unmodified(tmp_path, net_kwargs, budget, match):
    pl.seed_everything(0, verbose=False)
    plain, _ = fit(LitMLP(net=Net(**net_kwargs)), max_steps=3, default_root_dir=tmp_path)
    pl.seed_everything(0, verbose=False)
    model = LitMLP(net=Net(**net_kwargs))
    callback = HiRemateCallback(budget=budget, solver="dp")
    with pytest.warns(UserWarning, match=match):
        losses, seen = fit(model, callback, max_steps=3, default_root_dir=tmp_path)
    assert type(seen.at_train_start.net) is Net
    assert callback.results["net"].plan is None and callback.results["net"].skipped
    assert torch.equal(losses, plain)


def test_sharded_strategies_are_refused():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    class DeepSpeedStrategy(DDPStrategy):  # the real one subclasses DDPStrategy too
        pass

    callback = HiRemateCallback()
    for strategy in (FSDPStrategy(), DeepSpeedStrategy()):
        name = type(strategy).__name__
        with pytest.raises(ValueError, match=f"does not support strategy={name}"):
            callback.setup(SimpleNamespace(strategy=strategy), None, "fit")
    with pytest.raises(ValueError, match=r"\(FSDP1\).*Use FSDP2: strategy=ModelParallelStrategy"):
        callback.setup(SimpleNamespace(strategy=FSDPStrategy()), None, "fit")


def test_fsdp2_is_taken_and_tensor_parallelism_refused():
    """Issue 33: FSDP2 (``ModelParallelStrategy``) passes the strategy check; a mesh with a
    tensor-parallel dimension over 1 is refused, naming the supported layout."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from integrations.remat_callback import _check_mesh

    HiRemateCallback().setup(SimpleNamespace(strategy=ModelParallelStrategy()), None, "fit")

    class Mesh:
        mesh_dim_names = ("data_parallel", "tensor_parallel")

        def __init__(self, tp):
            self.tp = tp

        def __getitem__(self, name):
            return SimpleNamespace(size=lambda: self.tp if name == "tensor_parallel" else 2)

    _check_mesh(SimpleNamespace(device_mesh=Mesh(1)))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2\): a rematerialized FSDP unit "
                                         r"needs its whole parameters.*tensor_parallel_size=1"):
        _check_mesh(SimpleNamespace(device_mesh=Mesh(2)))


DDP_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader
    from integrations.lightning import HiRemateCallback
    from tests.integrations.test_remat_callback import LitMLP, Recorder, _data

    torch.set_num_threads(1)

    def run(callback):
        pl.seed_everything(0, verbose=False)
        model, recorder = LitMLP(aux=False), Recorder()  # DDP: no unused parameters
        trainer = pl.Trainer(
            max_steps=20, accelerator="cpu", devices=2, strategy="ddp", logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[recorder] + ([callback] if callback else []))
        trainer.fit(model, DataLoader(_data(12 * 256), batch_size=256, shuffle=True))
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        return trainer, [l.item() for l in recorder.losses], params, recorder

    _, plain, plain_params, _ = run(None)
    callback = HiRemateCallback(budget="50%", time_limit=float(sys.argv[2]))
    trainer, losses, params, recorder = run(callback)
    plan = callback.plans["net"]
    json.dump({
        "plain": plain, "remat": losses, "same_params": torch.equal(params, plain_params),
        "swapped": type(recorder.at_train_start.net).__name__, "cache_hit": plan.cache_hit,
        "predicted_peak": plan.predicted_peak_bytes, "budget": plan.budget_bytes,
        "capture_s": callback.results["net"].capture_time_s, "solve_s": plan.solve_time_s,
    }, open(f"{sys.argv[1]}.{trainer.global_rank}.json", "w"))
""")


def test_ddp_two_processes_bitwise_equal_and_same_plan(tmp_path):
    """strategy="ddp" on 2 CPU processes (gloo), Lightning's own launcher."""
    script = tmp_path / "ddp_fit.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), str(TIME_LIMIT)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["remat"] == rank["plain"] and len(rank["remat"]) == 20
        assert rank["same_params"] and rank["swapped"] == "RematModule"
    assert ranks[0]["plain"] != ranks[1]["plain"]  # each rank trained on its own shard
    # Rank 0 solved; rank 1 captured the same graph and took rank 0's plan from the cache.
    assert not ranks[0]["cache_hit"] and ranks[1]["cache_hit"] and ranks[1]["solve_s"] == 0.0
    assert ranks[0]["predicted_peak"] == ranks[1]["predicted_peak"] <= ranks[0]["budget"]
