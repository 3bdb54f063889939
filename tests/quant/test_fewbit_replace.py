"""replace_activations: what it swaps, what it keeps, what it reports."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quant.fewbit import (
    FewBitELU,
    FewBitGELU,
    FewBitReLU,
    FewBitSiLU,
    convert_activation,
    replace_activations,
)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(16, 8)
        self.gate = nn.SiLU()

    def forward(self, x):
        return self.gate(self.fc2(self.act(self.fc1(x))))


class MyGELU(nn.GELU):
    def forward(self, x):
        return super().forward(x) * 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.ELU(alpha=0.5), nn.PReLU(), MyGELU())
        self.relu = nn.ReLU()

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        x = self.relu(self.norm(x))
        return torch.tanh(F.softplus(self.head(x)))


def _grads(model, x):
    model.zero_grad()
    model(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_replaces_supported_modules_and_keeps_parameters():
    torch.manual_seed(0)
    model = Net()
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    x = torch.randn(4, 8)
    expected = model(x)
    report = replace_activations(model, bits=2)
    assert isinstance(model.blocks[0].act, FewBitGELU) and model.blocks[0].act.bits == 2
    assert isinstance(model.blocks[1].gate, FewBitSiLU)
    assert isinstance(model.head[1], FewBitELU) and model.head[1].alpha == 0.5
    assert isinstance(model.relu, FewBitReLU) and model.relu.bits == 1
    assert type(model.head[3]) is MyGELU  # subclass left alone
    assert dict(model.named_parameters()) == params  # same parameter objects
    assert list(model.state_dict()) == keys
    assert torch.equal(model(x), expected)
    assert [(r.name, r.original, r.bits) for r in report.replaced] == [
        ("blocks.0.act", "GELU", 2), ("blocks.0.gate", "SiLU", 2), ("blocks.1.act", "GELU", 2),
        ("blocks.1.gate", "SiLU", 2), ("head.1", "ELU", 2), ("relu", "ReLU", 1),
    ]
    assert report.replaced[-1].exact and not report.replaced[0].exact
    assert {(s.name, s.kind) for s in report.skipped} == {("head.2", "PReLU"), ("head.3", "MyGELU")}
    assert not report.complete and not report.functional_checked


def test_gradients_change_only_through_the_activations():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.LeakyReLU(), nn.Linear(16, 2))
    x = torch.randn(32, 8)
    before = _grads(model, x)
    replace_activations(model, bits=2)
    after = _grads(model, x)
    for name in before:
        assert torch.equal(before[name], after[name]), name  # exact 1-bit rules


def test_functional_calls_are_reported_with_example_inputs():
    model = Net()
    report = replace_activations(model, bits=2, example_inputs=torch.randn(2, 8))
    calls = {(f.module, f.function): f.count for f in report.functional}
    assert calls == {("", "softplus"): 1, ("", "tanh"): 1}
    assert "softplus() called 1 time(s)" in str(report)
    assert model.training  # the example forward restored the training flags


def test_include_exclude_by_type_pattern_and_class_name():
    model = Net()
    report = replace_activations(model, bits=3, include=["blocks.*"], exclude=[nn.SiLU])
    assert [r.name for r in report.replaced] == ["blocks.0.act", "blocks.1.act"]
    model = Net()
    report = replace_activations(model, include=["ELU", "nothing.here"])
    assert [r.name for r in report.replaced] == ["head.1"]
    assert report.unmatched == ("nothing.here",)


def test_shared_module_is_converted_once():
    act = nn.GELU()
    model = nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 4), act)
    report = replace_activations(model)
    assert model[1] is model[3] and isinstance(model[1], FewBitGELU)
    assert len(report.replaced) == 2


def test_already_fewbit_modules_are_left_alone():
    model = nn.Sequential(nn.Linear(4, 4), FewBitGELU(bits=4))
    module = model[1]
    report = replace_activations(model, bits=2)
    assert model[1] is module and module.bits == 4 and report.replaced == ()


def test_training_flag_is_kept():
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU()).eval()
    replace_activations(model)
    assert not model[1].training


def test_strict_raises_with_the_report():
    with pytest.raises(ValueError, match="(?s)strict=True.*PReLU"):
        replace_activations(Net(), strict=True)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    assert replace_activations(model, strict=True).complete


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: replace_activations(nn.Linear(2, 2), bits=9), ValueError, "bits=9"),
        (lambda: replace_activations(nn.GELU()), ValueError, "convert_activation"),
        (lambda: replace_activations("model"), TypeError, "nn.Module"),
        (lambda: replace_activations(Net(), include=[3]), TypeError, "include="),
        (lambda: replace_activations(Net(), exclude=[int]), TypeError, "exclude="),
        (lambda: convert_activation(nn.Linear(2, 2)), ValueError, "not a supported activation"),
    ],
    ids=["bits", "bare-activation", "not-module", "include-type", "exclude-type", "convert"],
)
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_tables_follow_the_model_device():
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU()).to(torch.float64)
    replace_activations(model)
    assert model[1].fewbit_levels.device == model[0].weight.device
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    model(x).sum().backward()
    assert x.grad.dtype == torch.float64
