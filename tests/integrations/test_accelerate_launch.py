"""``python -m integrations.accelerate``: HIREMATE_* on a plain Accelerate script, unedited."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import remat  # noqa: E402
from integrations import _accelerate_launch as launch  # noqa: E402
from integrations.accelerate import HiRematePlugin  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ORIGINAL_PREPARE = Accelerator.__dict__["prepare"]
ORIGINAL_UNWRAP = Accelerator.__dict__["unwrap_model"]
# A deep narrow MLP, batch 256: activations dominate and 50% is feasible for 'dp' (measured
# 49% of the eager step; the proven lower bound is ~30%).
BUDGET = "50%"
SOLVE = {"HIREMATE_BUDGET": BUDGET, "HIREMATE_SOLVER": "dp", "HIREMATE_TIME_LIMIT": "10"}
# remat.track_memory counts every live storage of the step; the optimizer state and the scalars
# the loop keeps are not activations. The rematerialized step must stay this close to the plan.
MEASURED_OVER_PREDICTED = 1.10

NET = textwrap.dedent("""
    from torch import nn

    def make_net(width=64, depth=16):
        layers = [nn.Linear(16, width)]
        for _ in range(depth):
            layers += [nn.Tanh(), nn.Linear(width, width)]
        return nn.Sequential(*layers, nn.Tanh(), nn.Linear(width, 4))
""")

# A plain Accelerate script: it imports nothing of hiremate to train (remat only measures the
# step's peak, and hiremate_results is read only when the launcher put it there).
SCRIPT = textwrap.dedent("""
    import sys

    import torch
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from accelerate import Accelerator

    import remat
    from launch_net import make_net  # next to this script: sys.path[0] is its directory

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    n = 3 * 256 * int(sys.argv[2])  # 3 batches of 256 on each of the argv[2] processes
    data = TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
    loader = DataLoader(data, batch_size=256, shuffle=True)
    accelerator = Accelerator(cpu=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, peaks = [], []
    for x, y in loader:
        with remat.track_memory() as mem:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
        peaks.append(mem.peak_bytes)
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())

    # The module that ran (a RematModule under the launcher) against the user's own module,
    # eager, on the last batch: the same gradients.
    inner, net = getattr(model, "module", model), accelerator.unwrap_model(model)
    pairs = []
    for module in (inner, net):
        F.cross_entropy(module(x), y).backward()
        pairs.append([p.grad.clone() for p in net.parameters()])
        optimizer.zero_grad()
    results = getattr(accelerator, "hiremate_results", {})
    plan = results[""].plan if "" in results else None
    torch.save({
        "name": __name__, "argv": sys.argv, "path0": sys.path[0],
        "world": accelerator.num_processes, "kind": accelerator.distributed_type.value,
        "losses": torch.stack(losses), "peaks": peaks, "grads": grads, "pairs": pairs,
        "model": type(inner).__name__, "unwrapped": type(net).__name__,
        "plan": None if plan is None else {k: getattr(plan, k) for k in (
            "budget_bytes", "predicted_peak_bytes", "eager_bytes", "outside_bytes",
            "cache_hit")},
    }, f"{sys.argv[1]}.{accelerator.process_index}.pt")
""")


@pytest.fixture(autouse=True)
def _isolated(one_thread, monkeypatch):
    """No HIREMATE_* from the caller, a fresh Accelerate state, the script's module forgotten."""
    for name in [k for k in os.environ if k.startswith("HIREMATE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HIREMATE_CACHE_DIR", "off")  # no plans from the user's cache directory
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    for name in ("launch_net", "nomodel_pkg", "nomodel_pkg.train"):
        sys.modules.pop(name, None)
    assert Accelerator.__dict__["prepare"] is ORIGINAL_PREPARE  # the launcher undid its patch
    assert Accelerator.__dict__["unwrap_model"] is ORIGINAL_UNWRAP


def _script(tmp_path: Path, text: str = SCRIPT) -> Path:
    (tmp_path / "launch_net.py").write_text(NET)
    script = tmp_path / "train.py"
    script.write_text(text)
    return script


def _run(script: Path, out: Path, *args: str) -> dict:
    argv = sys.argv[:]
    assert launch.main([str(script), str(out), "1", *args]) == 0
    assert sys.argv == argv
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return torch.load(f"{out}.0.pt", weights_only=True)


def test_plain_script_trains_rematerialized_in_one_process(tmp_path, monkeypatch):
    script = _script(tmp_path)
    plain = _run(script, tmp_path / "plain")  # no HIREMATE_BUDGET: plain Accelerate
    for name, value in SOLVE.items():
        monkeypatch.setenv(name, value)
    ran = _run(script, tmp_path / "remat", "--flag")

    assert ran["name"] == "__main__" and ran["argv"] == [str(script), str(tmp_path / "remat"),
                                                         "1", "--flag"]
    assert ran["path0"] == str(tmp_path)
    assert (plain["model"], ran["model"], ran["unwrapped"]) == ("Sequential", "RematModule",
                                                                "Sequential")
    assert plain["plan"] is None
    plan = ran["plan"]
    assert plan["predicted_peak_bytes"] <= plan["budget_bytes"]
    assert plan["budget_bytes"] == int(0.5 * (plan["eager_bytes"] + plan["outside_bytes"])
                                       - plan["outside_bytes"])
    # Training is unchanged, bit for bit: every loss, and the last step's gradients.
    assert torch.equal(ran["losses"], plain["losses"])
    assert all(torch.equal(a, b) for a, b in zip(ran["grads"], plain["grads"], strict=True))
    # Measured: every rematerialized step is below the unmodified step of the plain run and of
    # the launcher's own warmup, and close to the predicted peak.
    eager = plan["eager_bytes"] + plan["outside_bytes"]
    for peak, plain_peak in zip(ran["peaks"], plain["peaks"], strict=True):
        assert peak < 0.6 * plain_peak and peak < 0.6 * eager
        assert peak <= MEASURED_OVER_PREDICTED * plan["predicted_peak_bytes"]


@contextmanager
def _no_warnings():
    """Fail on any warning inside the block (``pytest.warns`` cannot say "none")."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield
    assert [str(w.message) for w in seen] == []


def test_hiremate_accelerator_keeps_its_own_prepare(tmp_path, monkeypatch):
    """Under the launcher a HiRemateAccelerator solves once, with its own plugin."""
    solves = []
    real = remat.rematerialize

    def counted(*args, **kwargs):
        solves.append(kwargs["budget"].text)
        return real(*args, **kwargs)

    monkeypatch.setattr(remat, "rematerialize", counted)
    text = SCRIPT.replace(
        "from accelerate import Accelerator",
        "from integrations.accelerate import HiRemateAccelerator, HiRematePlugin").replace(
        "Accelerator(cpu=True)",
        "HiRemateAccelerator(cpu=True, hiremate_plugin=HiRematePlugin(budget='60%', "
        "solver='dp'))")
    for name, value in SOLVE.items():
        monkeypatch.setenv(name, value)
    with _no_warnings():
        ran = _run(_script(tmp_path, text), tmp_path / "out")
    assert solves == ["60%"]
    assert (ran["model"], ran["unwrapped"]) == ("RematModule", "Sequential")
    assert ran["plan"]["predicted_peak_bytes"] <= ran["plan"]["budget_bytes"]


class MyAccelerator(Accelerator):
    """A user's subclass that overrides prepare and calls super()."""

    def prepare(self, *args, device_placement=None):
        return super().prepare(*args, device_placement=device_placement)


@pytest.mark.parametrize("make", [lambda: Accelerator(cpu=True), lambda: MyAccelerator(cpu=True)],
                         ids=["created-before-the-patch", "subclass"])
def test_every_accelerator_is_covered(make):
    """The class is patched: an instance built earlier and a subclass go through the launcher.

    ``prepare`` gets no DataLoader here, so the launcher's own warning shows that it ran (without
    solving anything).
    """
    accelerator = make()
    plugin = HiRematePlugin(budget="50%")
    net = torch.nn.Linear(2, 2)
    with launch.rematerialize_every_accelerator(plugin) as record:
        with pytest.warns(UserWarning, match=r"^integrations.accelerate: the model trains "
                                             r"unmodified \(strict=False\): prepare\(\) got no "
                                             r"DataLoader"):
            assert accelerator.prepare(net) is net
        assert accelerator.hiremate_plugin is plugin and accelerator.hiremate_results == {}
        with _no_warnings():  # prepared already: left alone
            accelerator.prepare(net)
    assert (record.prepare_calls, record.model_calls) == (2, 2)


def test_a_batch_the_model_cannot_take_warns_and_trains_unmodified():
    """An unedited script must keep training: a batch outside the convention is a warning."""
    loader = torch.utils.data.DataLoader(range(8), batch_size=4, collate_fn=lambda b: set(b))
    net = torch.nn.Linear(2, 2)
    with launch.rematerialize_every_accelerator(HiRematePlugin(budget="50%")):
        with pytest.warns(UserWarning, match=r"^integrations.accelerate: the model trains "
                                             r"unmodified \(strict=False\): its first batch does "
                                             r"not fit: cannot call the model on a batch of type "
                                             r"set"):
            prepared, _ = Accelerator(cpu=True).prepare(net, loader)
    assert prepared is net


NO_MODEL = textwrap.dedent("""
    import sys
    import torch
    from accelerate import Accelerator

    optimizer = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    accelerator = Accelerator(cpu=True)
    optimizer = accelerator.prepare(optimizer)
    print("ran", __name__, sys.argv[1:])
""")
NO_LOADER = NO_MODEL.replace("optimizer = accelerator.prepare(optimizer)",
                             "model = accelerator.prepare(torch.nn.Linear(2, 2))")
NEVER_PREPARED = (r"^HIREMATE_BUDGET=50% was set but {target} never passed a model to "
                  r"Accelerator.prepare; nothing was rematerialized. Pass the model with its "
                  r"DataLoader to accelerator.prepare\(model, optimizer, loader\)")


@pytest.mark.parametrize("case", ["no-model", "no-model-module-form", "no-model-rank-1",
                                  "model-without-loader"])
def test_flag_that_did_nothing_warns_once(case, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HIREMATE_BUDGET", BUDGET)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nomodel_pkg").mkdir()
    (tmp_path / "nomodel_pkg" / "__init__.py").write_text("")
    (tmp_path / "nomodel_pkg" / "train.py").write_text(NO_MODEL)
    script = tmp_path / "train.py"
    script.write_text(NO_LOADER if case == "model-without-loader" else NO_MODEL)
    if case == "no-model-rank-1":
        monkeypatch.setenv("RANK", "1")
    argv = (["-m", "nomodel_pkg.train"] if case == "no-model-module-form" else [str(script)])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert launch.main([*argv, "x", "--y"]) == 0
    assert capsys.readouterr().out == "ran __main__ ['x', '--y']\n"
    messages = [str(w.message) for w in seen]
    if case == "no-model-rank-1":  # the main process says it, once for the whole job
        assert messages == []
    elif case == "model-without-loader":
        assert len(messages) == 1
        assert messages[0].startswith(
            "integrations.accelerate: the model trains unmodified (strict=False): prepare() got "
            "no DataLoader to read an example batch from (and none was prepared before); pass "
            "the training DataLoader in the same prepare() call")
    else:
        target = "nomodel_pkg.train" if case == "no-model-module-form" else str(script)
        assert len(messages) == 1
        assert re.match(NEVER_PREPARED.format(target=re.escape(target)), messages[0])


@pytest.mark.parametrize("raise_, expected", [
    ("raise RuntimeError('boom')", RuntimeError),
    ("sys.exit(3)", SystemExit),
], ids=["exception", "exit-3"])
def test_script_failures_propagate_and_the_patch_is_undone(raise_, expected, tmp_path,
                                                           monkeypatch):
    monkeypatch.setenv("HIREMATE_BUDGET", BUDGET)
    script = tmp_path / "fail.py"
    script.write_text(f"import sys\n{raise_}\n")
    with _no_warnings(), pytest.raises(expected) as info:  # no "never prepared" on top of it
        launch.main([str(script)])
    if expected is SystemExit:
        assert info.value.code == 3
    # The autouse fixture checks that Accelerator.prepare and unwrap_model are the originals.


@pytest.mark.parametrize("argv, env, message", [
    ([], {}, "error: expected a script to run"),
    (["missing.py"], {}, "error: can't open file 'missing.py': no such file"),
    (["--lr", "1"], {}, "error: unknown option '--lr': options of the script go after it"),
    (["-m"], {}, "error: -m: expected a module name"),
    (["-m", "no_such_pkg.train"], {}, "error: -m no_such_pkg.train: no module named"),
    (["SCRIPT"], {"HIREMATE_BUDGET": "150%"},
     "error: HIREMATE_BUDGET='150%': a percentage budget must be in (0%, 100%]"),
    (["SCRIPT"], {"HIREMATE_BUDGT": "50%"},
     "error: HIREMATE_BUDGT='50%': unknown variable; did you mean HIREMATE_BUDGET?"),
    (["SCRIPT"], {"HIREMATE_SOLVER": "dp"},
     "error: HIREMATE_SOLVER is set but HIREMATE_BUDGET is not"),
], ids=["nothing", "missing-script", "unknown-option", "dash-m-alone", "missing-module",
        "bad-budget", "misspelt-variable", "no-budget"])
def test_bad_command_lines_exit_2_naming_the_problem(argv, env, message, tmp_path, monkeypatch,
                                                     capsys):
    script = tmp_path / "never_run.py"
    script.write_text("raise AssertionError('the script must not run')\n")
    monkeypatch.chdir(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launch.main([str(script) if a == "SCRIPT" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"python -m integrations.accelerate: {message}" in err and "Traceback" not in err


def _env(tmp_path: Path, **extra: str) -> dict:
    return {**os.environ, **extra, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf"),
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_python_dash_m_reports_a_bad_variable_without_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "integrations.accelerate", str(_script(tmp_path)), "out", "1"],
        cwd=tmp_path, env=_env(tmp_path, HIREMATE_BUDGET="abc"), capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("python -m integrations.accelerate: error: "
                                  "HIREMATE_BUDGET='abc': cannot read this"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_accelerate_launch_two_processes(tmp_path):
    """``accelerate launch -m integrations.accelerate``, 2 CPU processes (gloo), plain script."""
    script = _script(tmp_path)
    out = tmp_path / "ddp"
    # On CPUs `accelerate launch --cpu` starts several processes only through MPI; --multi_gpu
    # is its torchrun launcher, and Accelerator(cpu=True) makes the job gloo on CPUs.
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
         "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         "--main_process_port", "0", "-m", "integrations.accelerate", str(script), str(out),
         "2"],
        cwd=tmp_path, env=_env(tmp_path, **SOLVE), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(f"{out}.{r}.pt", weights_only=True) for r in (0, 1)]
    for rank in ranks:
        assert (rank["world"], rank["kind"]) == (2, "MULTI_CPU")
        assert rank["argv"] == [str(script), str(out), "2"] and rank["name"] == "__main__"
        assert (rank["model"], rank["unwrapped"]) == ("RematModule", "Sequential")
        plan = rank["plan"]
        assert plan["predicted_peak_bytes"] <= plan["budget_bytes"]
        # Every step is below the unmodified step the warmup measured. DDP rebuilds its
        # gradient buckets during the second step (one more gradient-sized buffer, measured
        # +265 KiB here), so the steady state is the last step.
        eager = plan["eager_bytes"] + plan["outside_bytes"]
        assert all(peak < eager for peak in rank["peaks"])
        assert rank["peaks"][-1] < 0.6 * eager
        assert rank["peaks"][-1] <= MEASURED_OVER_PREDICTED * plan["predicted_peak_bytes"]
        remat_grads, eager_grads = rank["pairs"]
        assert all(torch.equal(a, b) for a, b in zip(remat_grads, eager_grads, strict=True))
        assert torch.isfinite(rank["losses"]).all() and len(rank["losses"]) == 3
    # Rank 0 solved, rank 1 reused its plan: one schedule for the job.
    assert not ranks[0]["plan"]["cache_hit"] and ranks[1]["plan"]["cache_hit"]
    assert ranks[0]["plan"]["predicted_peak_bytes"] == ranks[1]["plan"]["predicted_peak_bytes"]
    # DDP averaged the gradients: both ranks hold the same ones.
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["grads"], ranks[1]["grads"]))
    assert proc.stderr.count("never passed a model") == 0
