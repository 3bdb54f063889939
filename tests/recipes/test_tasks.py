"""The recipe networks and datasets behave as documented."""
from __future__ import annotations

import math

import pytest
import torch

from recipes.data import ByteWindows, load_digits_split, load_stdlib_bytes
from recipes.models import GPT, DigitsCNN


def _gpt(**kw):
    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16, **kw)


def test_gpt_is_causal():
    net = _gpt(dropout=0.0).eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    a, b = net(idx), net(changed)
    assert torch.equal(a[:, :10], b[:, :10])  # the past does not see the future
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gpt_initial_loss_is_uniform_guess():
    net = _gpt().eval()
    idx, targets = torch.randint(0, 256, (2, 8, 16))
    loss = torch.nn.functional.cross_entropy(net(idx).flatten(0, 1), targets.flatten())
    assert abs(loss.item() - math.log(256)) < 0.05


@pytest.mark.parametrize("dropout, same", [(0.0, True), (0.5, False)], ids=["p0", "p0.5"])
def test_gpt_dropout_is_configurable(dropout, same):
    net = _gpt(dropout=dropout).train()
    idx = torch.randint(0, 256, (2, 16))
    assert torch.equal(net(idx), net(idx)) is same


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gpt_weight_tying(tie):
    net = _gpt(tie_weights=tie)
    assert (net.head.weight is net.tok_emb.weight) is tie


def test_gpt_rejects_heads_that_do_not_divide_width():
    with pytest.raises(ValueError, match=r"n_embd=16: must be a multiple of n_head=3"):
        GPT(vocab_size=256, block_size=8, n_head=3, n_embd=16)


def test_cnn_shapes_and_batchnorm():
    net = DigitsCNN(channels=(4, 8, 16))
    assert net(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules()) == 3
    with pytest.raises(ValueError, match=r"channels=\[1, 1, 1, 1, 1\]: expected 1 to 4"):
        DigitsCNN(channels=(1, 1, 1, 1, 1))


def test_stdlib_bytes_are_deterministic_and_windows_shift_by_one():
    data, sha = load_stdlib_bytes(("bisect.py", "heapq.py"))
    again, sha_again = load_stdlib_bytes(("bisect.py", "heapq.py"))
    assert sha == sha_again and torch.equal(data, again)
    windows = ByteWindows(data, 32)
    assert len(windows) == (data.numel() - 1) // 32
    x, y = windows[3]
    assert torch.equal(x[1:], y[:-1]) and torch.equal(x, data[96:128].long())


def test_stdlib_missing_file_is_a_clear_error():
    with pytest.raises(ValueError, match=r"files: 'no_such_module.py' is not a file under this Python's stdlib"):
        load_stdlib_bytes(("no_such_module.py",))


def test_digits_split_is_fixed_and_stratified():
    train, val = load_digits_split(val_fraction=0.2, split_seed=0)
    assert len(train) == 1437 and len(val) == 360
    again, _ = load_digits_split(val_fraction=0.2, split_seed=0)
    assert torch.equal(train.tensors[0], again.tensors[0])
    counts = torch.bincount(val.tensors[1], minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # ~36 of each digit
    assert 0.0 <= train.tensors[0].min() and train.tensors[0].max() <= 1.0
