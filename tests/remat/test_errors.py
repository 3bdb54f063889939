"""What users see when remat cannot help: errors that name the cause and the fix."""
import pytest
import torch

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


def test_a_data_dependent_user_error_is_classed_data_dependent():
    # What dynamo raised on Mixtral's expert routing (a UserError, not an Unsupported).
    from torch._dynamo.exc import UserError, UserErrorType

    from remat.module import _capture_error

    exc = UserError(UserErrorType.CONSTRAINT_VIOLATION,
                    "Could not guard on data-dependent expression Eq(u0, 1) (unhinted: Eq(u0, 1))")
    error = _capture_error(exc)
    assert isinstance(error, remat.CaptureError) and error.reason == "data_dependent"
    assert "remat.backend" in str(error) and "please report" not in str(error)
