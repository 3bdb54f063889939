"""The Accelerate integration: the HIREMATE_* flag, HiRemateAccelerator, and the plain function."""
from __future__ import annotations

import math

import json
import logging
import os
import re
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

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

import remat  # noqa: E402
from integrations.accelerate import (  # noqa: E402
    HiRemateAccelerator,
    HiRematePlugin,
    rematerialize_for_accelerate,
)

REPO = Path(__file__).resolve().parents[2]

# Deep narrow MLP, batch 512: activations dominate, 50% is feasible (lowest ~29%).
IN, WIDTH, DEPTH, CLASSES, BATCH = 16, 64, 16, 4, 512
STEPS_PER_EPOCH = 4
# The hierarchical solver otherwise spends most of its 60 s default on this 253-op graph.
TIME_LIMIT = 4.0


@pytest.fixture(autouse=True)
def _isolated(one_thread):
    """One thread (shared 2-core machine) and a fresh Accelerate singleton state per test."""
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.bn(self.inp(x)))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(F.dropout(h, 0.1, self.training))


class Classifier(nn.Module):
    """A model whose forward takes keyword arguments and computes the loss (Hugging Face style)."""

    def __init__(self):
        super().__init__()
        self.body = Net()
        self.temperature = 1.0  # a plain attribute users read from their model

    def forward(self, x, labels):
        return F.cross_entropy(self.body(x) / self.temperature, labels)


def _loader(dicts: bool = False, seeded: bool = False) -> DataLoader:
    """Shuffled by the global RNG, or (``seeded``) by the loader's own generator."""
    g = torch.Generator().manual_seed(1)
    n = STEPS_PER_EPOCH * BATCH
    x, y = torch.randn(n, IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    data = [{"x": x[i], "labels": y[i]} for i in range(n)] if dicts else TensorDataset(x, y)
    shuffle = torch.Generator().manual_seed(2) if seeded else None
    return DataLoader(data, batch_size=BATCH, shuffle=True, generator=shuffle)


def train(accelerator, model, *, dicts=False, seeded=False, epochs=2, before_prepare=None):
    """A plain Accelerate loop; returns the losses and the prepared model."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = _loader(dicts, seeded)
    if before_prepare is not None:
        model = before_prepare(accelerator, model, loader)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _ in range(epochs):
        for batch in loader:
            loss = model(**batch) if dicts else F.cross_entropy(model(batch[0]), batch[1])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    return torch.stack(losses), model, optimizer


def _reference(model_cls=Net, dicts=False, seeded=False):
    torch.manual_seed(0)
    losses, model, _ = train(Accelerator(cpu=True), model_cls(), dicts=dicts, seeded=seeded)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    return losses, model


def _summary_lines(caplog) -> tuple[str, str]:
    """The table logged after prepare() and the first training step's line (exactly one)."""
    messages = [r.getMessage() for r in caplog.records if r.name == "integrations.accelerate"]
    tables = [m for m in messages if m.startswith("HiRemateAccelerator: memory under budget")]
    steps = [m for m in messages if "measured peak of the first training step" in m]
    assert len(tables) == 1 and len(steps) == 1, messages
    return tables[0], steps[0]


_FIRST_STEP = re.compile(r"HiRemateAccelerator: measured peak of the first training step: "
                         r"\d+\.\d\d [KM]iB \((\d+)% of the unmodified warmup step's (.+)\)")


def test_prepare_rematerializes_and_losses_are_bitwise_equal(caplog):
    caplog.set_level(logging.INFO, logger="integrations.accelerate")
    plain, plain_model = _reference()
    net = Net()
    ids = [id(p) for p in net.parameters()]
    plugin = HiRematePlugin(budget="50%", time_limit=TIME_LIMIT)  # the default solver
    accelerator = HiRemateAccelerator(cpu=True, hiremate_plugin=plugin)
    losses, model, optimizer = train(accelerator, net)
    assert torch.equal(losses, plain)
    assert isinstance(model, remat.RematModule) and model.original is net
    assert [id(p) for p in model.parameters()] == ids
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == set(ids)
    assert list(model.state_dict()) == list(plain_model.state_dict())
    assert accelerator.unwrap_model(model) is net
    plan = accelerator.hiremate_results[""].plan
    # Half of the eager step measured on the example, less what the step adds outside the module.
    step_bytes = plan.eager_bytes + plan.outside_bytes
    assert plan.budget_bytes == math.floor(0.5 * step_bytes - plan.outside_bytes)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert len(losses) == 2 * STEPS_PER_EPOCH  # the warmup did not take a batch away
    # The summary says what its percentages are of, then what the first step measured.
    table, first_step = _summary_lines(caplog)
    eager = remat.format_bytes(step_bytes)
    assert table.endswith(f"\n  measured peak of the unmodified warmup step: {eager} (forward + "
                          "backward of the model on the example batch)"), table
    match = _FIRST_STEP.fullmatch(first_step)
    assert match and match[2] == eager, first_step
    assert 25 <= int(match[1]) <= 50, first_step  # measured within the 50% budget


def test_submodule_target_is_swapped_in_place_with_dict_batches(caplog):
    caplog.set_level(logging.INFO, logger="integrations.accelerate")
    plain, _ = _reference(Classifier, dicts=True, seeded=True)
    model = Classifier()
    body = model.body
    plugin = HiRematePlugin(budget="50%", module="body", solver="dp")
    losses, prepared, _ = train(HiRemateAccelerator(cpu=True, hiremate_plugin=plugin), model,
                                dicts=True, seeded=True)  # the loader's generator is restored
    assert torch.equal(losses, plain)
    assert prepared is model and prepared.temperature == 1.0  # still the user's own object
    assert isinstance(model.body, remat.RematModule) and model.body.original is body
    # The whole model's unmodified step (its loss included) is measured for the summary.
    table, first_step = _summary_lines(caplog)
    eager = re.search(r"\n  measured peak of the unmodified warmup step: (\d+\.\d\d [KM]iB) "
                      r"\(forward \+ backward of the model on the example batch\)$", table)
    match = _FIRST_STEP.fullmatch(first_step)
    assert eager and match and match[2] == eager[1], (table, first_step)
    assert 25 <= int(match[1]) <= 50, first_step


def test_launcher_flag_is_read_from_the_environment(monkeypatch):
    plain, _ = _reference()
    monkeypatch.setenv("HIREMATE_BUDGET", "50%")
    monkeypatch.setenv("HIREMATE_SOLVER", "dp")
    accelerator = HiRemateAccelerator(cpu=True)
    assert accelerator.hiremate_plugin == HiRematePlugin(budget="50%", solver="dp")
    losses, model, _ = train(accelerator, Net())
    assert torch.equal(losses, plain) and isinstance(model, remat.RematModule)


def test_function_for_a_users_own_accelerator():
    plain, _ = _reference()

    def remat_first(accelerator, model, loader):
        state = torch.get_rng_state()  # iterating draws a shuffle seed: keep the run's stream
        batch = next(iter(loader))
        torch.set_rng_state(state)
        return rematerialize_for_accelerate(accelerator, model, batch,
                                            HiRematePlugin(budget="50%", solver="dp"))

    losses, model, _ = train(Accelerator(cpu=True), Net(), before_prepare=remat_first)
    assert torch.equal(losses, plain) and isinstance(model, remat.RematModule)


def test_function_without_plugin_or_flag_returns_the_model(monkeypatch):
    for name in [k for k in os.environ if k.startswith("HIREMATE_")]:
        monkeypatch.delenv(name)
    net = Net()
    assert rematerialize_for_accelerate(Accelerator(cpu=True), net, torch.zeros(2, IN)) is net
    assert HiRemateAccelerator(cpu=True).hiremate_plugin is None


@pytest.mark.parametrize(
    "env, match",
    [
        ({"HIREMATE_BUDGET": "150%"}, r"HIREMATE_BUDGET='150%': a percentage budget must be in"),
        ({"HIREMATE_BUDGET": "-1GB"}, r"HIREMATE_BUDGET='-1GB': a byte budget must be at least"),
        ({"HIREMATE_BUDGET": "abc"}, r"HIREMATE_BUDGET='abc': cannot read this"),
        ({"HIREMATE_BUDGET": "50%", "HIREMATE_SOLVER": "ilpp"},
         r"HIREMATE_SOLVER='ilpp': unknown solver; did you mean 'ilp'\?"),
        ({"HIREMATE_BUDGET": "50%", "HIREMATE_TIME_LIMIT": "soon"},
         r"HIREMATE_TIME_LIMIT='soon': expected a number of seconds"),
        ({"HIREMATE_BUDGET": "50"}, r'HIREMATE_BUDGET=\'50\': a bare number is a budget only as '
                                    r'a fraction in \(0, 1\]; for 50 write its unit: "50%"'),
        ({"HIREMATE_BUDGET": "50%", "HIREMATE_TIME_LIMIT": "-5"},
         r"HIREMATE_TIME_LIMIT='-5': expected a finite number of seconds > 0; pass e.g. "
         r"HIREMATE_TIME_LIMIT=60"),
        ({"HIREMATE_BUDGET": "50%", "HIREMATE_TIME_LIMIT": "nan"},
         r"HIREMATE_TIME_LIMIT='nan': expected a finite number of seconds > 0"),
        ({"HIREMATE_BUDGET": "50%", "HIREMATE_TIME_LIMIT": "inf"},
         r"HIREMATE_TIME_LIMIT='inf': expected a finite number of seconds > 0"),
        ({"HIREMATE_BUDGET": "50%", "HIREMATE_TIME_LIMIT": "0"},
         r"HIREMATE_TIME_LIMIT='0': expected a finite number of seconds > 0"),
        ({"HIREMATE_BUDGET": "50%", "HIREMATE_STRICT": "maybe"},
         r"HIREMATE_STRICT='maybe': expected one of 1, true, yes, on, 0, false, no, off"),
        ({"HIREMATE_BUDGET": "50%", "HIREMATE_MODULE": " , "},
         r"HIREMATE_MODULE=' , ': expected comma-separated module names"),
        ({"HIREMATE_BUDGT": "50%"}, r"HIREMATE_BUDGT='50%': unknown variable; did you mean "
                                    r"HIREMATE_BUDGET\?"),
        ({"HIREMATE_SOLVER": "dp"}, r"HIREMATE_SOLVER is set but HIREMATE_BUDGET is not"),
    ],
    ids=["150%", "-1GB", "abc", "solver", "time-limit-text", "bare-50", "time-limit-negative",
         "time-limit-nan", "time-limit-inf", "time-limit-0", "strict",
         "module-empty", "misspelt-variable", "no-budget"],
)
def test_bad_environment_is_a_clear_error(env, match):
    with pytest.raises(ValueError, match=match):
        HiRematePlugin.from_env(env)


def test_environment_is_parsed():
    plugin = HiRematePlugin.from_env({
        "HIREMATE_BUDGET": "0.5", "HIREMATE_SOLVER": "dp", "HIREMATE_TIME_LIMIT": "7.5",
        "HIREMATE_MODULE": "encoder, decoder", "HIREMATE_CACHE_DIR": "/tmp/plans",
        "HIREMATE_STRICT": "yes", "HIREMATE_VERBOSE": "0", "HIREMATE_UNRELATED_TOOL": "x",
        "PATH": "/bin",
    })
    assert plugin == HiRematePlugin(budget="0.5", solver="dp", time_limit=7.5,
                                    module=["encoder", "decoder"], cache_dir="/tmp/plans",
                                    strict=True, verbose=False)
    assert plugin.settings.budget.fraction == 0.5
    assert HiRematePlugin.from_env({"PATH": "/bin"}) is None


@pytest.mark.parametrize(
    "kwargs, error, match",
    [({"budget": "150%"}, ValueError, r"budget='150%'"),
     ({"solver": "x"}, ValueError, r"solver='x': unknown solver"),
     ({"module": ["a", 1]}, ValueError, r"1 is not an attribute path"),
     ({"strict": 1}, TypeError, r"strict=1: expected True or False")],
    ids=["budget", "solver", "module", "strict"],
)
def test_plugin_fields_are_validated(kwargs, error, match):
    with pytest.raises(error, match=match):
        HiRematePlugin(**kwargs)


def _fake(kind, version=1, checkpointing=False):
    plugin = SimpleNamespace(fsdp_version=version, activation_checkpointing=checkpointing)
    return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=plugin))


@pytest.mark.parametrize("fake, match", [
    (_fake(DistributedType.DEEPSPEED), r"DeepSpeed is not supported: ZeRO-3 .* Use FSDP2 "
                                       r"\(fsdp_version: 2"),
    (_fake(DistributedType.FSDP), r"FSDP1 \(fsdp_version: 1\) is not supported.*Use FSDP2"),
    (_fake(DistributedType.FSDP, 2, True), r"fsdp_activation_checkpointing: true .* Turn one off"),
    (_fake(DistributedType.XLA), r"distributed_type=XLA is not supported yet; .*FSDP2"),
], ids=["deepspeed", "fsdp1", "fsdp2-with-fsdp-checkpointing", "xla"])
def test_sharded_setups_are_refused_with_the_supported_alternative(fake, match):
    """Issue 33 item 5: each refusal says why and what works instead."""
    with pytest.raises(ValueError, match=match):
        rematerialize_for_accelerate(fake, Net(), torch.zeros(2, IN), HiRematePlugin())


@pytest.mark.parametrize("strict", [False, True], ids=["warn", "strict"])
def test_prepare_without_a_dataloader(strict):
    net = Net()
    accelerator = HiRemateAccelerator(cpu=True, hiremate_plugin=HiRematePlugin(strict=strict))
    if strict:
        with pytest.raises(ValueError, match=r"prepare\(\) got no DataLoader"):
            accelerator.prepare(net)
    else:
        with pytest.warns(UserWarning, match=r"the model trains unmodified \(strict=False\)"):
            assert accelerator.prepare(net) is net


TORCHRUN_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from accelerate import Accelerator
    from integrations.accelerate import HiRemateAccelerator, HiRematePlugin
    from tests.integrations.test_accelerate import Net, train

    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain, _, _ = train(Accelerator(cpu=True), Net())
    torch.manual_seed(0)
    accelerator = HiRemateAccelerator(cpu=True, hiremate_plugin=HiRematePlugin(budget="50%",
                                                                               solver="dp"))
    losses, model, _ = train(accelerator, Net())
    plan = accelerator.hiremate_results[""].plan
    json.dump({"plain": plain.tolist(), "remat": losses.tolist(), "cache_hit": plan.cache_hit,
               "peak": plan.predicted_peak_bytes, "world": accelerator.num_processes},
              open(f"{sys.argv[1]}.{accelerator.process_index}.json", "w"))
    # Both ranks leave together: a rank that exits while the other still talks to it through
    # gloo aborted (SIGABRT, "terminate called without an active exception") once in five runs.
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()
""")


def test_torchrun_two_processes_same_losses_and_plan(tmp_path):
    """DDP on 2 CPU processes (gloo): rank 0 solves, rank 1 reuses its plan, losses unchanged."""
    script = tmp_path / "acc_ddp.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script), str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["world"] == 2 and rank["remat"] == rank["plain"]
    assert not ranks[0]["cache_hit"] and ranks[1]["cache_hit"]
    assert ranks[0]["peak"] == ranks[1]["peak"]
