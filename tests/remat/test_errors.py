"""What users see when remat cannot help: errors that name the cause and the fix."""
import warnings

import pytest
import torch
from torch import nn

import remat


class DataDependent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:  # control flow on a tensor value
            return h.relu()
        return h.tanh()


class Breaks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        torch._dynamo.graph_break()
        return h.relu()


@pytest.mark.parametrize("model, reason", [(DataDependent, "data_dependent"), (Breaks, "graph_break")],
                         ids=["data_dependent", "graph_break"])
def test_capture_error_names_reason_and_workaround(model, reason):
    with pytest.raises(remat.CaptureError) as info:
        remat.rematerialize(model(), torch.randn(4, 8), budget="90%")
    assert info.value.reason in (reason, "graph_break")  # dynamo reports both as graph breaks
    assert "remat.backend" in str(info.value)  # the workaround is named


def _deep_mlp():
    return torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(64, 64),
                                                                 torch.nn.Tanh())]), (256, 64)


def _wide_mlp():
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 32)), (64, 32)


@pytest.mark.parametrize("build", [_deep_mlp, _wide_mlp], ids=["deep", "wide"])
def test_infeasible_budget_advice_can_be_followed(build):
    torch.manual_seed(0)
    model, shape = build()
    x = torch.randn(*shape)
    with pytest.raises(remat.InfeasibleBudgetError) as info:
        remat.rematerialize(model, x, budget="1%", time_limit=5)
    err = info.value
    # Two numbers: the proven bound, and the lowest peak actually reached (advised).
    assert err.budget_bytes < err.lower_bound_bytes <= err.best_bytes < err.baseline_bytes
    assert f'raise the budget to "{err.advised_budget}"' in str(err)
    rm = remat.rematerialize(model, x, budget=err.advised_budget, time_limit=5)
    assert rm.plan.predicted_peak_bytes <= rm.plan.budget_bytes < rm.plan.baseline_bytes


def test_infeasible_budget_says_when_nothing_below_the_baseline_was_found():
    model = torch.nn.Linear(32, 32)  # nothing to recompute: every schedule is the baseline
    with pytest.raises(remat.InfeasibleBudgetError) as info:
        remat.rematerialize(model, torch.randn(64, 32), budget="1%")
    err = info.value
    assert err.advised_budget is None and "101%" not in str(err)
    assert 'use budget="100%"' in str(err)


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"budget": "150%"}, ValueError, "budget='150%'"),
        ({"budget": "-1GB"}, ValueError, "budget='-1GB'"),
        ({"solver": "magic"}, ValueError, "solver='magic'"),
        ({"budget": 50}, ValueError, 'budget=50: a bare number is a budget only as a fraction in '
                                     '(0, 1]; for 50 write its unit: "50%" (50% of the measured '
                                     'step) or a byte count such as "50MiB" ("50B" is 50 bytes)'),
        ({"budget": "2"}, ValueError, "budget='2': a bare number is a budget only as a fraction"),
        ({"time_limit": -1}, ValueError, "time_limit=-1: expected a finite number of seconds > 0; "
                                         "pass e.g. time_limit=60"),
        ({"time_limit": 0}, ValueError, "time_limit=0: expected a finite number of seconds > 0"),
        ({"time_limit": float("nan")}, ValueError,
         "time_limit=nan: expected a finite number of seconds > 0"),
        ({"time_limit": float("inf")}, ValueError,
         "time_limit=inf: expected a finite number of seconds > 0"),
        ({"time_limit": True}, TypeError,
         "time_limit=True: expected a number of seconds > 0, got a bool"),
        ({"time_limit": "60"}, TypeError, "time_limit='60': expected a number of seconds > 0, got "
                                          "a str"),
        ({"cache": 3}, TypeError, "cache=3"),
    ],
    ids=["percent", "negative", "solver", "bare-int", "bare-str", "time_limit-negative",
         "time_limit-0", "time_limit-nan", "time_limit-inf", "time_limit-bool", "time_limit-str",
         "cache"],
)
def test_bad_arguments_fail_before_capture(kwargs, error, text):
    with pytest.raises(error) as info:
        remat.rematerialize(torch.nn.Linear(4, 4), torch.randn(2, 4), **kwargs)
    assert str(info.value).startswith(text), str(info.value)


@pytest.mark.parametrize("time_limit", [float("nan"), float("inf"), 0, -1],
                         ids=["nan", "inf", "0", "-1"])
def test_backend_refuses_a_time_limit_that_is_not_finite_and_positive(time_limit):
    # time_limit=nan passed RematBackend's `time_limit <= 0` (NOTE [ One check per setting ]).
    with pytest.raises(ValueError, match=r"expected a finite number of seconds > 0"):
        remat.backend(budget="50%", time_limit=time_limit)


def test_not_a_module():
    with pytest.raises(TypeError, match="expected an nn.Module"):
        remat.rematerialize(lambda x: x, torch.randn(2))


def test_nothing_requires_grad():
    model = torch.nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(remat.CaptureError, match="no parameter or input") as info:
        remat.rematerialize(model, torch.randn(2, 4))
    assert info.value.reason == "no_grad"


def test_a_solver_crash_is_a_solver_error_not_a_capture_error(monkeypatch):
    import remat.planner

    class Crashing:
        def solve(self, problem):
            raise KeyError("kSolutionLimit")

    monkeypatch.setattr(remat.planner, "get_solver", lambda name: Crashing())
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(64, 64),
                                                                  torch.nn.Tanh())])
    with pytest.raises(remat.SolverError) as info:
        remat.rematerialize(model, torch.randn(256, 64), budget="80%")
    assert not isinstance(info.value, remat.CaptureError)
    assert "KeyError" in str(info.value) and "solver='dp'" in str(info.value)
    assert "If the model runs eagerly" not in str(info.value)


def test_a_graph_too_large_for_the_whole_graph_ilp_is_a_limit_not_a_bug():
    """HF Mamba with ``solver="ilp"`` (112,071 binaries) was reported as a crash: "This is a
    bug in hiremate; please report it". It is a limit with two fixes, and says them."""
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(64, 64),
                                                                  torch.nn.Tanh())])
    with pytest.raises(remat.SolverError) as info:
        remat.rematerialize(model, torch.randn(256, 64), budget="95%", solver="ilp",
                            options={"max_variables": 10})
    text = str(info.value)
    assert info.value.status == "too_large" and "max_variables=10" in text
    assert "solver='hierarchical'" in text and "a bug in hiremate" not in text


def test_a_data_dependent_user_error_is_classed_data_dependent():
    # What dynamo raised on Mixtral's expert routing (a UserError, not an Unsupported).
    from torch._dynamo.exc import UserError, UserErrorType

    from remat.failures import capture_error

    exc = UserError(UserErrorType.CONSTRAINT_VIOLATION,
                    "Could not guard on data-dependent expression Eq(u0, 1) (unhinted: Eq(u0, 1))")
    error = capture_error(exc)
    assert isinstance(error, remat.CaptureError) and error.reason == "data_dependent"
    assert "remat.backend" in str(error) and "please report" not in str(error)


# ---- the user's own exceptions (NOTE [ The user's own exceptions ] in remat/failures.py) ----


class ChecksWidth(torch.nn.Module):
    """Raises the user's own ValueError for inputs that are not 8 wide."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.nn.functional.dropout(self.norm(x[:, :8]), 0.5)  # state a re-run could touch
        if x.shape[-1] != 8:
            raise ValueError(f"ChecksWidth expects 8 features, got {x.shape[-1]}")
        return self.lin(h)


class Projects(torch.nn.Module):
    """F.linear with a weight of fixed width: a RuntimeError from the op for other widths."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight).tanh()


class Embeds(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)

    def forward(self, ids):
        return self.emb(ids).tanh()


def _notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


def test_a_user_error_in_the_example_call_keeps_its_type_with_a_note():
    with pytest.raises(ValueError) as info:
        remat.rematerialize(ChecksWidth(), torch.randn(4, 9), budget="90%")
    assert str(info.value) == "ChecksWidth expects 8 features, got 9"
    assert not isinstance(info.value, remat.RematError)
    assert "hiremate: raised by ChecksWidth's own training step (forward and backward, run " \
           "eagerly without remat on the example inputs" in _notes(info.value)
    assert info.value.__traceback__ is not None
    last = info.value.__traceback__
    while last.tb_next is not None:
        last = last.tb_next
    assert last.tb_frame.f_code is ChecksWidth.forward.__code__  # raised where the user raised it


def test_a_user_error_met_by_the_capture_keeps_its_type_with_a_note():
    # With the eager peak given, nothing runs eagerly before the capture: dynamo meets the raise
    # (torch 2.13: an Unsupported "Observed exception") and the call is run again eagerly.
    with pytest.raises(ValueError) as info:
        remat.rematerialize(ChecksWidth(), torch.randn(4, 9), budget="90%",
                            eager_peak_bytes=10**6)
    assert str(info.value) == "ChecksWidth expects 8 features, got 9"
    notes = _notes(info.value)
    assert "hiremate: ChecksWidth's own forward raises this on these inputs without remat too" in notes
    assert "after the call with remat failed with Unsupported: Observed exception" in notes


def _caught_at_a_new_shape(model, example, bad):
    # solver "none": captured although the eager step fits "100%" (NOTE [ A budget the eager
    # step fits ]; a call run eagerly raises the model's error as it is, with no note)
    rm = remat.rematerialize(model, example, budget="100%", solver="none")
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    try:
        rm(bad)
    except remat.RematError as exc:  # what users saw before: the test fails on it
        pytest.fail(f"a {type(exc).__name__} instead of the model's own error: {exc}")
    except Exception as exc:  # noqa: BLE001 - the test looks at what arrived
        # The eager re-run changes no state: buffers and the RNG stream are as before the call.
        for before, after in zip(buffers, model.buffers()):
            assert torch.equal(before, after)
        assert torch.equal(rng, torch.get_rng_state())
        return exc
    pytest.fail("the bad call raised nothing")


@pytest.mark.parametrize(
    "build, example, bad, error, text",
    [
        (ChecksWidth, torch.randn(4, 8), torch.randn(6, 9), ValueError,
         "ChecksWidth expects 8 features, got 9"),
        # dynamo: TorchRuntimeError with the meta kernel's text; eager's own text arrives.
        (Projects, torch.randn(4, 8), torch.randn(6, 5), RuntimeError,
         "mat1 and mat2 shapes cannot be multiplied (6x5 and 8x8)"),
        # traced fine (fake tensors hold no ids); the compiled graph raises the op's IndexError.
        (Embeds, torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 3, 12]]), IndexError,
         "index out of range in self"),
    ],
    ids=["ValueError-raised", "RuntimeError-from-linear", "IndexError-from-embedding"],
)
def test_a_user_error_at_a_later_shape_keeps_its_type_with_a_note(build, example, bad, error,
                                                                   text):
    exc = _caught_at_a_new_shape(build(), example, bad)
    assert type(exc) is error and str(exc).strip("'") == text
    assert f"hiremate: {build.__name__}'s own forward raises this on these inputs without remat " \
           "too (run again eagerly, without gradients, after the call with remat failed" \
           in _notes(exc)
    assert exc.__suppress_context__  # dynamo's wrapper is summarised in the note, not chained


def test_a_graph_break_is_still_a_capture_error_after_the_eager_rerun():
    # The model runs eagerly, so the re-run raises nothing: the failure is remat's.
    with pytest.raises(remat.CaptureError) as info:
        remat.rematerialize(Breaks(), torch.randn(4, 8), budget="90%", eager_peak_bytes=10**6)
    assert info.value.reason == "graph_break" and "remove this graph break" in str(info.value)
    assert not _notes(info.value)


class RunsOutOfMemory(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_an_eager_step_out_of_memory_says_how_to_measure_it_otherwise():
    with pytest.raises(torch.OutOfMemoryError) as info:
        remat.rematerialize(RunsOutOfMemory(), torch.randn(2, 4))
    assert ("as a budget is a share of its peak), so it is not a remat failure: measure it on a "
            "smaller example batch, or pass eager_peak_bytes= measured another way"
            in _notes(info.value))


def test_out_of_memory_in_the_eager_rerun_leaves_the_remat_failure_standing():
    from remat.failures import own_failure

    failure = RuntimeError("what the call with remat raised")
    assert own_failure(RunsOutOfMemory(), (torch.randn(2, 4),), {}, failure) is None
    own = own_failure(ChecksWidth(), (torch.randn(2, 9),), {}, failure)
    assert type(own) is ValueError and "failed with RuntimeError: what the call with remat " \
        "raised), so it is not a remat failure: fix the model or its inputs" in _notes(own)


def test_the_note_falls_back_to_dunder_notes_without_add_note():
    """Python 3.10 has no BaseException.add_note: the note is kept where 3.11 reads it."""
    from remat.failures import add_note

    class NoAddNote(ValueError):  # what a 3.10 exception looks like to add_note
        def __getattribute__(self, name):
            if name == "add_note":
                raise AttributeError(name)
            return super().__getattribute__(name)

    exc = NoAddNote("bad shape")
    add_note(exc, "first")
    add_note(exc, "second")
    assert exc.__notes__ == ["first", "second"]


# ---- devices (NOTE [ Devices remat can run on ] in remat/devices.py) ----------------------------


def _no_measurement(monkeypatch):
    import remat.memory

    def refuse(*args, **kwargs):
        raise AssertionError("measured before the device was checked")

    monkeypatch.setattr(remat.memory, "track_memory", refuse)


META_FIX = ("so the model and the batch must hold real tensors on the CPU or a CUDA GPU. "
            "Materialize the model first, e.g. model.to_empty(device='cpu') (or device='cuda') "
            "and then load its weights with model.load_state_dict(...), and pass a real batch")


@pytest.mark.parametrize(
    "call, where",
    [
        (lambda: remat.rematerialize(torch.nn.Linear(4, 4, device="meta"), torch.randn(2, 4)),
         "rematerialize: the module's parameter 'weight'"),
        # eager_peak_bytes given: nothing was measured, and the capture went on before.
        (lambda: remat.rematerialize(torch.nn.Linear(4, 4, device="meta"),
                                     torch.randn(2, 4, device="meta"), eager_peak_bytes=100),
         "rematerialize: the module's parameter 'weight'"),
        (lambda: remat.rematerialize(torch.nn.BatchNorm1d(4, affine=False).to_empty(
            device="meta"), torch.randn(2, 4)),
         "rematerialize: the module's buffer 'running_mean'"),
        (lambda: remat.rematerialize(torch.nn.Linear(4, 4), torch.randn(2, 4),
                                     mask=(torch.ones(2), torch.ones(2, device="meta"))),
         "rematerialize: input kwargs['mask'][1]"),
        (lambda: remat.estimate(torch.nn.Linear(4, 4, device="meta"), torch.randn(2, 4)),
         "estimate: the module's parameter 'weight'"),
        (lambda: remat.measure_eager_step(torch.nn.Linear(4, 4),
                                          torch.randn(2, 4, device="meta")),
         "measure_eager_step: input args[0]"),
    ],
    ids=["parameter", "parameter-eager-bytes-given", "buffer", "nested-input", "estimate",
         "measure_eager_step"],
)
def test_a_meta_tensor_is_refused_in_the_users_terms_before_measuring(monkeypatch, call, where):
    _no_measurement(monkeypatch)
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert message == (f"{where} is on the meta device (a shape without data); remat runs and "
                       f"measures the training step, {META_FIX}")
    assert "track_memory" not in message


class _OnDevice(torch.Tensor):
    """Metadata of a tensor on a device this machine has no kernels for (``mps``, ``xpu``)."""

    @staticmethod
    def __new__(cls, size, device):
        return torch.Tensor._make_wrapper_subclass(cls, size, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"{func} ran on a tensor the device check should have refused")


@pytest.mark.parametrize("device", ["mps", "xpu"])
def test_another_device_type_is_refused_naming_the_supported_ones(monkeypatch, device):
    _no_measurement(monkeypatch)
    with pytest.raises(ValueError) as info:
        remat.rematerialize(torch.nn.Linear(4, 4), _OnDevice((2, 4), device))
    assert str(info.value) == (
        f"rematerialize: input args[0] is on {device!r}; remat measures the training step's "
        "memory on the CPU and CUDA devices only (remat.track_memory). Move the model and the "
        "batch to one of them, e.g. model.to('cuda') and batch.to('cuda'), or model.to('cpu')")


def test_a_device_mismatch_is_named_in_one_sentence():
    from remat.devices import device_mismatch

    module = torch.nn.Linear(2, 2)
    assert device_mismatch(module, (torch.randn(3, 2), torch.tensor(1.0)), {}) is None
    assert device_mismatch(module, (torch.randn(3, 2, device="meta"),), {}) == (
        "the module's parameter 'weight' is on cpu but input args[0] is on meta: move the model "
        "and the batch to one device, e.g. model.to('cpu') and batch.to('cpu')")


class _CachedLayer(nn.Module):
    """A layer whose forward takes ``cache=`` (as Hugging Face decoder layers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None) -> torch.Tensor:
        for lin in self.lins:
            x = torch.tanh(lin(x))
        return (x if cache is None else x + cache).square().sum()


def test_an_argument_named_like_an_option_reaches_the_module_through_example_kwargs():
    """NOTE [ Options that share a name with the model's ]: ``cache=`` given to rematerialize is
    remat's plan cache and the module's forward gets its default, which it says; in
    ``example_kwargs`` it reaches the module, whose gradients are then eager's."""
    torch.manual_seed(0)
    layer, x, cache = _CachedLayer(), torch.randn(256, 16), torch.randn(256, 16)
    with pytest.warns(UserWarning, match=r"rematerialize\(cache=False\).*_CachedLayer.forward "
                                         r"also takes 'cache'.*example_kwargs=\{'cache': \.\.\.\}"):
        remat.rematerialize(layer, x, budget="60%", cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to say: the module gets it
        rm = remat.rematerialize(layer, x, budget="60%", cache=False,
                                 example_kwargs={"cache": cache})
        report = remat.estimate(layer, x, example_kwargs={"cache": cache})
    layer(x, cache=cache).backward()
    expected = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    rm(x, cache=cache).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(layer.parameters(), expected))
    assert report.activation_peak_bytes > 0
    with pytest.raises(TypeError, match=r"'cache' given both as a keyword argument and in "
                                        r"example_kwargs"):
        remat.estimate(layer, x, cache=cache, example_kwargs={"cache": cache})
    with pytest.raises(TypeError, match=r"example_kwargs=\[1\]\): expected a dict"):
        remat.rematerialize(layer, x, example_kwargs=[1])
