"""Packing b-bit codes into bytes, encoding inputs into codes, decoding gradients."""
from __future__ import annotations

import pytest
import torch

from quant.fewbit import get_table, pack, packed_bytes, unpack
from quant.fewbit.packing import (
    PREDICATES,
    encode_lookup,
    encode_predicate,
    lookup_table,
    scale_by_levels,
)

BITS = [1, 2, 3, 4]
SIZES = [0, 1, 7, 8, 9, 24, 1000, 1001]


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"{b}bit")
def test_pack_roundtrip_and_size(bits, n):
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_bytes(n, bits)
    assert torch.equal(unpack(packed, bits, n), codes)


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"{b}bit")
def test_packed_size_is_bits_over_eight_per_element(bits):
    assert packed_bytes(8 * 1024, bits) == 1024 * bits


@pytest.mark.parametrize("n", [1, 9, 1000], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"{b}bit")
def test_scale_by_levels_matches_indexing(bits, n):
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8)
    levels = torch.randn(2**bits, dtype=torch.float64)
    grad = torch.randn(n, dtype=torch.float64)
    out = scale_by_levels(grad, pack(codes, bits), levels, bits)
    assert torch.equal(out, grad * levels[codes.long()])


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16],
    ids=["f32", "f64", "f16", "bf16"],
)
@pytest.mark.parametrize("bits", [2, 3, 4], ids=lambda b: f"{b}bit")
def test_lookup_encoding_matches_bucketize_up_to_float16_rounding(bits, dtype):
    table = get_table("gelu", bits)
    borders = torch.tensor(table.borders, dtype=torch.float64)
    x = (torch.randn(200_000, dtype=torch.float64) * 3).to(dtype)
    codes = unpack(encode_lookup(x, lookup_table(table.borders), bits), bits, x.numel()).long()
    expected = torch.bucketize(x.double(), borders)
    wrong = codes != expected
    # only inputs within half a float16 ulp of a border may differ (2**-11 relative)
    distance = (x.double()[wrong, None] - borders).abs().min(dim=1).values
    assert torch.all(distance <= borders.abs().max() * 2.0**-11 + 1e-7)
    assert wrong.double().mean() < 1e-3


def test_lookup_encoding_of_special_values():
    table = get_table("gelu", 2)
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0, -0.0])
    codes = unpack(encode_lookup(x, lookup_table(table.borders), 2), 2, x.numel()).tolist()
    # NaN -> 0; +-inf and out-of-float16-range values on their side; 0 is a border (right-closed)
    assert codes == [0, 3, 0, 3, 0, 1, 1]


@pytest.mark.parametrize(
    "predicate, lo, hi, reference",
    [
        ("le", 0.0, 0.0, lambda x: x <= 0),
        ("gt", 0.25, 0.0, lambda x: x > 0.25),
        ("outside", 0.0, 6.0, lambda x: (x <= 0) | (x >= 6)),
        ("inside_open", -3.0, 3.0, lambda x: (x > -3) & (x < 3)),
        ("inside_closed", -0.5, 0.5, lambda x: (x >= -0.5) & (x <= 0.5)),
    ],
    ids=list(PREDICATES),
)
def test_predicate_encoding(predicate, lo, hi, reference):
    x = torch.cat([torch.randn(1001) * 4, torch.tensor([0.0, 6.0, -3.0, 3.0, 0.5, -0.5, 0.25])])
    x[5] = float("nan")
    codes = unpack(encode_predicate(x, predicate, lo, hi), 1, x.numel())
    assert torch.equal(codes.bool(), reference(x))


def test_encoders_never_modify_their_input():
    x = torch.randn(1000)
    before = x.clone()
    encode_lookup(x, lookup_table(get_table("gelu", 2).borders), 2)
    encode_predicate(x, "outside", -1.0, 1.0)
    assert torch.equal(x, before)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"{b}bit")
def test_packing_follows_cuda_device(bits):
    codes = torch.randint(0, 2**bits, (1001,), dtype=torch.uint8, device="cuda")
    packed = pack(codes, bits)
    assert packed.device == codes.device
    assert torch.equal(unpack(packed, bits, 1001), codes)


@pytest.mark.parametrize("n", [1000, 1001, 4099], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("bits", [2, 3, 4], ids=lambda b: f"{b}bit")
def test_chunked_lookup_encoding_equals_one_piece(bits, n):
    table = lookup_table(get_table("silu", bits).borders)
    x = torch.randn(n) * 3
    whole = encode_lookup(x, table, bits)
    assert torch.equal(encode_lookup(x, table, bits, chunk=64), whole)
    assert torch.equal(encode_lookup(x, table, bits, chunk=7), whole)
