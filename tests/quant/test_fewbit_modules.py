"""FewBit* modules and functional forms: exact forward, table backward, memory, capture, errors."""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from quant.fewbit import (
    ACTIVATIONS,
    FEWBIT_MODULES,
    FewBitELU,
    FewBitGELU,
    FewBitLeakyReLU,
    FewBitReLU,
    FewBitSiLU,
    FewBitTanh,
    SavedTensorsMeter,
    functional as FB,
    get_table,
    gradient_error,
    packed_bytes,
)

# (activation, constructor kwargs): every supported module, non-default parameters and in-place
CASES = [
    ("gelu", {}), ("gelu", {"approximate": "tanh"}), ("silu", {}), ("silu", {"inplace": True}),
    ("mish", {}), ("tanh", {}), ("sigmoid", {}), ("elu", {"alpha": 0.7}),
    ("elu", {"inplace": True}), ("celu", {"alpha": 1.5}), ("selu", {}),
    ("softplus", {"beta": 2.0, "threshold": 5.0}), ("softsign", {}), ("logsigmoid", {}),
    ("hardswish", {}), ("hardswish", {"inplace": True}), ("tanhshrink", {}), ("relu", {}),
    ("relu", {"inplace": True}), ("leaky_relu", {"negative_slope": 0.2}), ("relu6", {}),
    ("relu6", {"inplace": True}), ("hardtanh", {"min_val": -2.0, "max_val": 0.5}),
    ("hardsigmoid", {}), ("threshold", {"threshold": 0.1, "value": 20.0}),
    ("softshrink", {"lambd": 0.3}), ("hardshrink", {}),
]
EXACT = [c for c in CASES if ACTIVATIONS[c[0]].exact is not None]
FITTED = sorted({name for name, spec in ACTIVATIONS.items() if spec.exact is None})
DTYPES = [torch.float32, torch.float64]


def _case_id(case):
    name, kwargs = case
    return name + "".join(f"-{k}={v}" for k, v in kwargs.items())


def _pair(name, kwargs, bits=None):
    """(torch module, few-bit module) with the same arguments."""
    torch_module = ACTIVATIONS[name].module(**kwargs)
    extra = {} if bits is None else {"bits": bits}
    return torch_module, FEWBIT_MODULES[name](**kwargs, **extra)


def _inputs(dtype, n=4096):
    """Random inputs plus every kink / threshold used by the cases."""
    special = [0.0, -0.0, 6.0, -3.0, 3.0, 0.3, -0.3, 0.5, -0.5, 0.1, -2.0, 1.0, -1.0]
    return torch.cat([torch.randn(n, dtype=dtype) * 3, torch.tensor(special, dtype=dtype)])


def _run(module, x, grad_out):
    """Forward (through a non-leaf copy, so in-place modules are allowed) and input gradient."""
    leaf = x.clone().requires_grad_()
    y = module(leaf * 1.0)
    y.backward(grad_out)
    return y.detach(), leaf.grad


# ---- forward ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_is_bit_identical_to_torch(case, dtype):
    reference, module = _pair(*case)
    x = _inputs(dtype).reshape(-1, 1)  # 2-D; also check a non-contiguous view
    for inp in (x, x.expand(-1, 3).t()):
        g = torch.randn(inp.shape, dtype=dtype)
        y_ref, _ = _run(reference, inp, g)
        y, _ = _run(module, inp, g)
        assert y.dtype == dtype
        assert torch.equal(y, y_ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("name", ["gelu", "silu", "tanh", "relu"])
def test_half_precision_follows_dtype(name, dtype):
    reference, module = _pair(name, {})
    x = _inputs(torch.float32).to(dtype)
    g = torch.randn(x.shape).to(dtype)
    y_ref, _ = _run(reference, x, g)
    y, grad = _run(module, x, g)
    assert torch.equal(y, y_ref) and grad.dtype == dtype
    if ACTIVATIONS[name].exact is None:
        table = get_table(name, 2)
        expected = (g.double() * table.derivative(x.double())).to(dtype)
        close = torch.isclose(grad, expected, rtol=1e-2, atol=1e-3)  # half rounding of levels
        assert close.double().mean() > 0.998  # the rest: within half rounding of a border


# ---- backward: exact rules ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("case", EXACT, ids=_case_id)
def test_exact_gradients_are_bit_identical_to_torch(case, dtype):
    reference, module = _pair(*case)
    # No NaN *inputs*: torch's own hardtanh backward sends a NaN input's gradient one way in its
    # vectorised loop and the other way in the scalar tail, so there is no single answer to match.
    x = _inputs(dtype)
    g = torch.randn(x.shape, dtype=dtype)
    g[:4] = torch.tensor([math.inf, -math.inf, math.nan, -0.0], dtype=dtype)
    _, grad_ref = _run(reference, x, g)
    _, grad = _run(module, x, g)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(grad), torch.signbit(grad_ref))  # signed zeros too


@pytest.mark.parametrize("case", EXACT, ids=_case_id)
def test_gradcheck_exact(case):
    _, module = _pair(*case)
    x = torch.randn(64, dtype=torch.float64) * 3
    kinks = torch.tensor([0.0, 6.0, -3.0, 3.0, 0.3, -0.3, 0.5, -0.5, 0.1, -2.0])
    x = x[(x[:, None] - kinks.double()).abs().min(dim=1).values > 1e-3]  # away from kinks
    x = x.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: module(t * 1.0), (x,))


# ---- backward: fitted tables ----------------------------------------------------------------------

#: Relative sampling error of the measured gradient error with 2**17 N(0, 1) samples is ~1%;
#: the table bound is computed by quadrature.
ERROR_BOUND_RTOL = 0.05


@pytest.mark.parametrize("bits", [1, 2, 3, 4], ids=lambda b: f"{b}bit")
@pytest.mark.parametrize("name", FITTED)
def test_gradient_error_within_table_bound(name, bits):
    reference, module = _pair(name, {}, bits=bits)
    x = torch.randn(2**17, dtype=torch.float64)
    g = torch.randn_like(x)
    _, grad_ref = _run(reference, x, g)
    _, grad = _run(module, x, g)
    measured = ((grad - grad_ref).norm() / grad_ref.norm()).item()
    spec = ACTIVATIONS[name]
    params = dict(spec.shipped[0])
    bound = gradient_error(lambda t: spec.call(t, params, False), get_table(name, bits))
    assert measured == pytest.approx(bound, rel=ERROR_BOUND_RTOL)


@pytest.mark.parametrize("name", FITTED)
def test_backward_is_the_table_step_function(name):
    _, module = _pair(name, {}, bits=3)
    x = torch.randn(50_000, dtype=torch.float64) * 2
    g = torch.randn_like(x)
    _, grad = _run(module, x, g)
    expected = g * get_table(name, 3).derivative(x)
    close = torch.isclose(grad, expected, rtol=1e-6, atol=0.0)  # levels are float32 buffers
    assert (~close).double().mean() < 1e-3  # inputs within float16 rounding of a border


# ---- memory ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4], ids=lambda b: f"{b}bit")
@pytest.mark.parametrize("name", ["gelu", "silu", "softsign"])
def test_saved_bytes_per_element(name, bits):
    module = FEWBIT_MODULES[name](bits=bits)
    x = torch.randn(64, 1024, requires_grad=True)
    with SavedTensorsMeter(exclude=module.buffers()) as codes_only:
        y = module(x)
    assert codes_only.bytes == packed_bytes(x.numel(), bits)
    assert codes_only.bytes / x.numel() == bits / 8
    with SavedTensorsMeter() as everything:
        y = module(x)
    levels_bytes = module.fewbit_levels.numel() * module.fewbit_levels.element_size()
    assert everything.bytes == codes_only.bytes + levels_bytes  # the levels: 2**bits floats
    del y


@pytest.mark.parametrize("case", EXACT, ids=_case_id)
def test_exact_modules_save_one_bit_per_element(case):
    _, module = _pair(*case)
    x = torch.randn(64, 1024, requires_grad=True)
    with SavedTensorsMeter() as meter:
        module(x * 1.0)
    assert meter.bytes / x.numel() == 0.125


def test_encoder_scratch_memory_is_bounded(monkeypatch):
    remat = pytest.importorskip("remat")
    from quant.fewbit import packing

    chunk = 2**16
    monkeypatch.setattr(packing, "ENCODE_CHUNK", chunk)
    module = FewBitGELU(bits=2)
    x = torch.randn(2**20, requires_grad=True)
    with remat.track_memory() as mem:
        y = module(x)
    scratch = mem.peak_bytes - mem.end_bytes
    # float16 copy + int32 index + codes of one chunk, plus the packed pieces before their cat;
    # without chunks it would be 6 bytes per element (6 MiB)
    assert scratch <= 7 * chunk + packed_bytes(x.numel(), 2) + 4096
    assert mem.end_bytes == 4 * x.numel() + packed_bytes(x.numel(), 2)  # output + codes
    del y


def test_eval_and_no_grad_are_the_torch_module():
    module = FewBitGELU(bits=2)
    x = torch.randn(64, 64, requires_grad=True)
    with torch.no_grad():
        assert module(x).grad_fn is None
    module.eval()
    with SavedTensorsMeter() as meter:
        y = module(x)
    assert type(y.grad_fn).__name__ == "GeluBackward0"  # torch's own node, no codes computed
    assert meter.bytes == x.numel() * 4
    module.train()
    assert type(module(x).grad_fn).__name__ == "FewBitFunctionBackward"


# ---- capture ---------------------------------------------------------------------------------------


def _capture_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), FewBitGELU(bits=2), nn.Linear(32, 32), FewBitSiLU(inplace=True, bits=3),
        nn.Linear(32, 32), FewBitReLU(inplace=True), nn.Linear(32, 32), FewBitTanh(bits=1),
        nn.Linear(32, 32), FewBitELU(alpha=0.5, bits=4), nn.Linear(32, 32),
        FewBitLeakyReLU(0.1), nn.Linear(32, 4),
    )


def test_compiled_aot_eager_fullgraph_gradients_equal_eager():
    model = _capture_model()
    x = torch.randn(8, 16)
    model(x).square().sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    assert torch.equal(out, model(x))
    for a, p in zip(eager, model.parameters()):
        assert torch.equal(a, p.grad)


def test_captured_graph_saves_packed_codes_not_the_input():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    saved = []

    def forward_compiler(gm, example_inputs):
        (outputs,) = [n for n in gm.graph.nodes if n.op == "output"]
        for value in outputs.args[0][1:]:  # [0] is the model output; the rest are saved
            val = value.meta.get("val") if hasattr(value, "meta") else None
            if isinstance(val, torch.Tensor):
                saved.append((val.dtype, tuple(val.shape)))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward)
    )
    model = nn.Sequential(nn.Linear(16, 64), FewBitGELU(bits=2))
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(8, 16)).sum().backward()
    assert (torch.uint8, (8 * 64 // 4,)) in saved
    assert (torch.float32, (8, 64)) not in saved  # the GELU input is not kept


# ---- module behaviour ------------------------------------------------------------------------------


def test_double_backward_raises():
    x = torch.randn(10, requires_grad=True)
    y = FewBitGELU(bits=2)(x).sum()
    with pytest.raises(RuntimeError, match="double backward.*not supported"):
        torch.autograd.grad(y, x, create_graph=True)


@pytest.mark.parametrize(
    "ctor, error, match",
    [
        (lambda: FewBitGELU(bits=0), ValueError, "bits=0"),
        (lambda: FewBitGELU(bits=5), ValueError, "bits=5"),
        (lambda: FewBitGELU(bits="2"), TypeError, "bits='2'"),
        (lambda: FewBitReLU(bits=2), ValueError, "exactly in 1 bit"),
        (lambda: FewBitGELU(approximate="fast"), ValueError, "approximate"),
        (lambda: FewBitTanh(2), TypeError, "positional"),
    ],
    ids=["bits0", "bits5", "bits-str", "exact-bits2", "bad-approximate", "bits-positional"],
)
def test_constructor_errors(ctor, error, match):
    with pytest.raises(error, match=match):
        ctor()


def test_changing_parameters_after_construction_raises():
    module = FewBitELU(alpha=1.0)
    module.alpha = 0.5
    with pytest.raises(RuntimeError, match="parameters changed"):
        module(torch.randn(4, requires_grad=True))


def test_device_mismatch_raises_clearly():
    module = FewBitGELU()
    with pytest.raises(RuntimeError, match="model.to"):
        module(torch.randn(4, device="meta", requires_grad=True))


def test_complex_input_is_rejected():
    from quant.fewbit.function import fewbit_activation

    module = FewBitTanh()
    x = torch.randn(4, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(TypeError, match="complex64"):
        fewbit_activation(x, module._fewbit_plan, module.fewbit_table, module.fewbit_levels)


def test_deepcopy_pickle_and_state_dict():
    model = _capture_model()
    reference = nn.Sequential(*[
        ACTIVATIONS[m._activation].module() if hasattr(m, "_activation") else m for m in model
    ])
    assert list(model.state_dict()) == list(reference.state_dict())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    clone = copy.deepcopy(model)
    x = torch.randn(4, 16)
    grads = []
    for m in (model, loaded, clone):
        m.zero_grad()
        m(x).sum().backward()
        grads.append(m[0].weight.grad)
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])


def test_isinstance_of_torch_class_and_repr():
    module = FewBitELU(alpha=0.5, bits=3)
    assert isinstance(module, nn.ELU) and module.bits == 3
    assert repr(module) == "FewBitELU(alpha=0.5, bits=3)"


# ---- functional ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn, module, kwargs",
    [
        (FB.gelu, FewBitGELU, {"approximate": "tanh", "bits": 3}),
        (FB.elu, FewBitELU, {"alpha": 0.5, "bits": 2}),
        (FB.leaky_relu, FewBitLeakyReLU, {"negative_slope": 0.3}),
        (FB.silu, FewBitSiLU, {"bits": 1}),
    ],
    ids=["gelu", "elu", "leaky_relu", "silu"],
)
def test_functional_matches_module(fn, module, kwargs):
    x = torch.randn(1000, dtype=torch.float64)
    g = torch.randn_like(x)
    y_mod, grad_mod = _run(module(**kwargs), x, g)
    leaf = x.clone().requires_grad_()
    y = fn(leaf, **kwargs)
    y.backward(g)
    assert torch.equal(y.detach(), y_mod)
    torch.testing.assert_close(leaf.grad, grad_mod, rtol=1e-6, atol=0)  # module levels: float32


def test_functional_without_grad_is_the_torch_function():
    x = torch.randn(100)
    y = FB.gelu(x, bits=2)
    assert y.grad_fn is None and torch.equal(y, torch.nn.functional.gelu(x))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [("gelu", {}), ("silu", {"inplace": True}), ("relu", {}),
                                  ("hardtanh", {"min_val": -2.0, "max_val": 0.5})], ids=_case_id)
@pytest.mark.parametrize("bits", [1, 2, 3, 4], ids=lambda b: f"{b}bit")
def test_cuda_follows_device(case, bits):
    name, kwargs = case
    exact = ACTIVATIONS[name].exact is not None
    reference, module = _pair(name, kwargs, bits=None if exact else bits)
    module = module.to("cuda")
    x = _inputs(torch.float32).cuda()
    g = torch.randn(x.shape, device="cuda")
    y_ref, grad_ref = _run(reference, x, g)
    y, grad = _run(module, x, g)
    assert torch.equal(y, y_ref) and grad.device == x.device
    if exact:
        assert torch.equal(grad, grad_ref)
    else:
        expected = g * get_table(name, bits).derivative(x.double()).float()
        close = torch.isclose(grad, expected, rtol=1e-6, atol=0.0)
        assert (~close).double().mean() < 2e-3
