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


def test_infeasible_budget_gives_the_lowest_possible_peak():
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 32))
    with pytest.raises(remat.InfeasibleBudgetError) as info:
        remat.rematerialize(model, torch.randn(64, 32), budget="1%")
    err = info.value
    assert err.budget_bytes < err.lower_bound_bytes < err.baseline_bytes
    assert "Raise the budget to at least" in str(err)


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"budget": "150%"}, ValueError, "budget='150%'"),
        ({"budget": "-1GB"}, ValueError, "budget='-1GB'"),
        ({"solver": "magic"}, ValueError, "solver='magic'"),
        ({"time_limit": -1}, ValueError, "time_limit=-1"),
        ({"cache": 3}, TypeError, "cache=3"),
    ],
    ids=["percent", "negative", "solver", "time_limit", "cache"],
)
def test_bad_arguments_fail_before_capture(kwargs, error, text):
    with pytest.raises(error, match=text.replace("(", r"\(")):
        remat.rematerialize(torch.nn.Linear(4, 4), torch.randn(2, 4), **kwargs)


def test_not_a_module():
    with pytest.raises(TypeError, match="expected an nn.Module"):
        remat.rematerialize(lambda x: x, torch.randn(2))


def test_nothing_requires_grad():
    model = torch.nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(remat.CaptureError, match="no parameter or input") as info:
        remat.rematerialize(model, torch.randn(2, 4))
    assert info.value.reason == "no_grad"
