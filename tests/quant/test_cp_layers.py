"""CPConv2d / CPLinear / QuantizedFactor: exact equivalence, errors, storage, training form."""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from quant.cp import CPConv2d, CPLinear, QuantizedFactor, qbounds

# float64: the CP sequence and conv2d with the reconstructed kernel differ by summation order only
TOL_F64 = 1e-12
# float32: same, at single precision (measured max relative difference ~3e-7)
TOL_F32 = 1e-5


def _random_codes(layer, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qmin, qmax = qbounds(layer.bits)
    for i, f in enumerate(layer.factors):
        codes = torch.randint(qmin, qmax + 1, tuple(f.shape), generator=gen, dtype=torch.int8)
        f.set_(codes, 0.05 * (i + 1))
    if layer.bias is not None:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
    return layer


def _max_rel(a, b):
    return float((a - b).abs().max().detach() / b.abs().max().detach())


CONV_CASES = {
    "3x3-s1-p1": dict(kernel_size=3, stride=1, padding=1),
    "3x3-s2-p1": dict(kernel_size=3, stride=2, padding=1),
    "3x3-s2-p2-d2": dict(kernel_size=3, stride=2, padding=2, dilation=2),
    "5x3-s(2,1)-p(2,0)": dict(kernel_size=(5, 3), stride=(2, 1), padding=(2, 0)),
    "3x3-same": dict(kernel_size=3, padding="same"),
    "3x3-valid-nobias": dict(kernel_size=3, padding="valid", bias=False),
    "3x3-reflect": dict(kernel_size=3, padding=1, padding_mode="reflect"),
    "3x3-circular-s2": dict(kernel_size=3, padding=1, stride=2, padding_mode="circular"),
    "3x3-replicate": dict(kernel_size=3, padding=2, padding_mode="replicate"),
    "1x1-s1": dict(kernel_size=1),
    "1x1-s2-p1": dict(kernel_size=1, stride=2, padding=1),
    "1x1-s2-reflect": dict(kernel_size=1, stride=2, padding=1, padding_mode="reflect"),
}


@pytest.mark.parametrize("case", list(CONV_CASES), ids=list(CONV_CASES))
@pytest.mark.parametrize("dtype, tol", [(torch.float64, TOL_F64), (torch.float32, TOL_F32)],
                         ids=["f64", "f32"])
def test_conv_equals_conv2d_with_reconstructed_kernel(case, dtype, tol):
    kw = CONV_CASES[case]
    conv = nn.Conv2d(6, 10, **kw, dtype=dtype)
    layer = _random_codes(CPConv2d.like(conv, rank=3, bits=5))
    ref = nn.Conv2d(6, 10, **kw, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(layer.dense_weight())
        if ref.bias is not None:
            ref.bias.copy_(layer.bias)
    x = torch.randn(2, 6, 11, 9, dtype=dtype)
    y, expected = layer(x), ref(x)
    assert y.shape == expected.shape and y.dtype == dtype
    assert _max_rel(y, expected) < tol
    assert len(layer.factors) == (2 if layer.kernel_size == (1, 1) else 3)


def test_conv_from_trained_conv_reconstructs_its_kernel():
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 12, 3, padding=1)
    layer = CPConv2d.from_conv(conv, rank=14, bits=8)
    w = conv.weight.detach()
    rel = float((layer.dense_weight() - w).norm() / w.norm())
    assert rel == pytest.approx(layer.result.error, abs=1e-5)
    x = torch.randn(3, 8, 7, 7)
    assert _max_rel(layer(x), F.conv2d(x, layer.dense_weight(), conv.bias, padding=1)) < TOL_F32


def test_linear_equals_linear_with_reconstructed_weight():
    layer = _random_codes(CPLinear(20, 30, rank=5, bits=4, dtype=torch.float64))
    x = torch.randn(4, 7, 20, dtype=torch.float64)
    expected = F.linear(x, layer.dense_weight(), layer.bias)
    assert _max_rel(layer(x), expected) < TOL_F64
    assert layer.dense_weight().shape == (30, 20)


def test_from_linear_and_rate():
    lin = nn.Linear(64, 32)
    layer = CPLinear.from_linear(lin, rate=2.0, bits=8)
    assert layer.rank == 64 * 32 // (64 + 32) // 2  # 10
    torch.testing.assert_close(layer.bias, lin.bias)
    assert layer.result.error <= layer.result.baseline_error


@pytest.mark.parametrize(
    "conv, error, match",
    [
        (nn.Conv2d(8, 8, 3, groups=2), ValueError, "conv.groups=2: grouped and depthwise"),
        (nn.Conv2d(8, 8, 3, groups=8), ValueError, "conv.groups=8"),
        (nn.ConvTranspose2d(8, 8, 3), TypeError, "ConvTranspose2d.*transposed convolutions"),
        (nn.Conv1d(8, 8, 3), TypeError, "Conv1d.*only 2-D"),
        (nn.Conv3d(8, 8, 3), TypeError, "Conv3d.*only 2-D"),
        (nn.Linear(8, 8), TypeError, "conv=Linear"),
        (nn.LazyConv2d(8, 3), ValueError, "lazy Conv2d has no weight"),
    ],
    ids=["grouped", "depthwise", "transposed", "conv1d", "conv3d", "linear", "lazy"],
)
def test_from_conv_rejects_unsupported_layers(conv, error, match):
    with pytest.raises(error, match=match):
        CPConv2d.from_conv(conv, rank=2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=0), "rank=0: the CP rank must be a positive int"),
        (dict(rank=-1), "rank=-1"),
        (dict(rank=57), r"rank=57: .* 2337 values, not fewer than the 2304 .* use rank <= 56"),
        (dict(rate=1.0), "rate=1.0: the compression rate must be > 1"),
        (dict(rate=100.0), r"rate=100.0: the conv weight \(16, 16, 3, 3\) is too small"),
        (dict(rank=4, bits=1), "bits=1"),
        (dict(rank=4, bits=9), "bits=9"),
    ],
    ids=["rank0", "rank-neg", "no-compression", "rate1", "rate-too-high", "bits1", "bits9"],
)
def test_from_conv_rejects_bad_arguments(kwargs, match):
    # 16x16x3x3: 2304 values, CP modes 16+16+9 = 41 per rank
    with pytest.raises(ValueError, match=match):
        CPConv2d.from_conv(nn.Conv2d(16, 16, 3), **kwargs)


def test_linear_rank_without_compression():
    with pytest.raises(ValueError, match=r"rank=8: .* \(8, 8\) has 128 values"):
        CPLinear.from_linear(nn.Linear(8, 8), rank=8)


# ----------------------------------------------------------------------------- storage
def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_holds_int8_codes_and_reloads_exactly():
    layer = _random_codes(CPConv2d(6, 10, 3, rank=4, bits=4, padding=1))
    state = layer.state_dict()
    assert state["factors.0.codes"].dtype == torch.int8
    assert state["factors.0._extra_state"] == {"bits": 4}
    assert not any(v.dtype.is_floating_point and v.numel() > 10
                   for k, v in state.items() if k != "bias" and torch.is_tensor(v))
    fresh = CPConv2d(6, 10, 3, rank=4, bits=8, padding=1)  # bits come from the state
    fresh.load_state_dict(_roundtrip(state))
    assert fresh.bits == 4
    x = torch.randn(2, 6, 8, 8)
    assert torch.equal(fresh(x), layer(x))


@pytest.mark.parametrize("src_trainable, dst_trainable", [(True, False), (False, True)],
                         ids=["latent-into-frozen", "codes-into-trainable"])
def test_state_dict_converts_between_forms(src_trainable, dst_trainable):
    src = _random_codes(CPLinear(12, 9, rank=3, bits=4, trainable=src_trainable))
    dst = CPLinear(12, 9, rank=3, bits=4, trainable=dst_trainable)
    dst.load_state_dict(_roundtrip(src.state_dict()))
    x = torch.randn(5, 12)
    assert torch.equal(dst(x), src(x))
    assert all(torch.equal(a.int_codes(), b.int_codes()) for a, b in zip(src.factors, dst.factors))


def test_trainable_factor_forward_on_grid_and_straight_through_gradient():
    f = QuantizedFactor(4, 3, bits=3, trainable=True, dtype=torch.float64)
    with torch.no_grad():
        f.scale.fill_(0.5)
        f.latent.copy_(torch.tensor([[0.1, 0.3, -0.74], [1.6, -3.0, 0.0], [0.24, 0.26, 9.0],
                                     [-1.9, -2.1, 1.5]], dtype=torch.float64))
    value = f()
    # grid of 3 bits at scale 0.5: {-2.0, ..., 1.5}; values clamp to its ends
    expected = torch.tensor([[0.0, 0.5, -0.5], [1.5, -2.0, 0.0], [0.0, 0.5, 1.5],
                             [-2.0, -2.0, 1.5]], dtype=torch.float64)
    assert torch.equal(value, expected)
    assert torch.equal(f.int_codes(), (expected / 0.5).to(torch.int8))
    upstream = torch.arange(12, dtype=torch.float64).reshape(4, 3) + 1
    value.backward(upstream)
    inside = (f.latent.detach() >= -2.0) & (f.latent.detach() <= 1.5)
    assert torch.equal(f.latent.grad, upstream * inside)


def test_freeze_unfreeze_keep_values():
    layer = _random_codes(CPConv2d(6, 10, 3, rank=4, bits=6, padding=1, trainable=True))
    x = torch.randn(2, 6, 8, 8)
    y = layer(x)
    assert {n for n, _ in layer.named_parameters()} == {
        "bias", "factors.0.latent", "factors.1.latent", "factors.2.latent"}
    layer.freeze()
    assert [n for n, _ in layer.named_parameters()] == ["bias"]
    assert torch.equal(layer(x), y)
    layer.unfreeze()
    assert layer.trainable and torch.equal(layer(x), y)


def test_dtype_conversion_keeps_int8_codes():
    layer = _random_codes(CPConv2d(6, 10, 3, rank=4, bits=8, padding=1)).to(torch.bfloat16)
    assert layer.factors[0].codes.dtype == torch.int8
    assert layer(torch.randn(1, 6, 5, 5, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["3x3-s2-p1", "1x1-s2-p1", "3x3-reflect"])
def test_conv_equivalence_on_cuda(case):
    kw = CONV_CASES[case]
    conv = nn.Conv2d(6, 10, **kw, dtype=torch.float64, device="cuda")
    layer = _random_codes(CPConv2d.like(conv, rank=3, bits=5))
    x = torch.randn(2, 6, 11, 9, dtype=torch.float64, device="cuda")
    expected = F.conv2d(F.pad(x, layer._reversed_padding, mode=layer.padding_mode)
                        if layer.padding_mode != "zeros" else x, layer.dense_weight(), layer.bias,
                        stride=layer.stride,
                        padding=0 if layer.padding_mode != "zeros" else layer.padding)
    assert _max_rel(layer(x), expected) < TOL_F64
