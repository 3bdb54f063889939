"""The joint-graph rewrites of :mod:`remat.passes`, on graphs traced the way AOTAutograd traces."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from remat.passes import split_dropout

aten = torch.ops.aten


def _dropout_graph(dtype: torch.dtype, p: float):
    def step(x, grad):
        out, mask = aten.native_dropout(x, p, True)
        scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)  # autograd's own formula
        return out * 2.0, mask, aten.native_dropout_backward(grad, mask, scale)
    x = torch.linspace(-2.0, 2.0, 3 * 1031, dtype=dtype).reshape(3, 1031)
    grad = torch.linspace(5.0, -1.0, 3 * 1031, dtype=dtype).reshape(3, 1031)
    return make_fx(step, tracing_mode="fake")(x, grad), step, (x, grad)


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_dropout_becomes_its_draw_and_a_product_with_the_same_numbers():
    """NOTE [ Dropout: save the mask, recompute the product ]: after the split no
    ``native_dropout`` is left (its discarded product cost two passes), the forward's readers
    read a recomputable product of the bool mask, and under one seed the graph gives eager's
    output and mask bit for bit and leaves the random stream where eager leaves it."""
    gm, step, args = _dropout_graph(torch.float32, 0.1)
    assert split_dropout(gm) == 1
    targets = _targets(gm)
    assert aten.native_dropout.default not in targets
    # The gradient multiplies by the mask as numbers: no bool-to-float cast inside the multiply
    # (one more pass over the tensor, in every backward).
    assert aten.native_dropout_backward.default not in targets
    assert aten.bernoulli.p in targets and aten._to_copy.default in targets
    draw = next(n for n in gm.graph.nodes if n.target is aten.bernoulli.p)
    assert draw.meta["val"].dtype is torch.bool  # a "keep nothing" forward keeps 1 byte per element
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    keep = mul.args[1]  # the mask as numbers, made from the 1-byte mask: recomputable from it
    assert keep.target is aten._to_copy.default and keep.args[0].meta["val"].dtype is torch.bool
    torch.manual_seed(3)
    want, want_mask, want_grad = step(*args)
    want_next = torch.rand(5)
    torch.manual_seed(3)
    got, got_mask, got_grad = gm(*args)
    assert torch.equal(got_mask, want_mask) and torch.equal(got, want)
    assert torch.equal(got_grad, want_grad)
    assert torch.equal(torch.rand(5), want_next)
    assert 0 < int(got_mask.sum()) < got_mask.numel()  # something was dropped, something kept


def test_dropout_is_left_alone_where_the_split_is_not_exact():
    gm, _, _ = _dropout_graph(torch.float32, 1.0)
    assert split_dropout(gm) == 0
    assert aten.native_dropout.default in _targets(gm)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_dropout_is_split_into_eagers_own_arithmetic(dtype):
    """NOTE [ Eager dropout in half precision on CPU ]: eager ``dropout`` multiplies by its
    noise rounded to the dtype (``1 / 0.9`` is 1.109375 in bf16), which ``native_dropout_backward``
    does not: the traced graph's gradient differed from eager's. The split reproduces eager's
    output, gradient and random stream bit for bit, with a recomputable ``keep``."""
    gm, _, (x, grad) = _dropout_graph(dtype, 0.1)
    assert split_dropout(gm) == 1 and aten.native_dropout.default not in _targets(gm)
    leaf = x.clone().requires_grad_()
    torch.manual_seed(4)
    want = torch.nn.functional.dropout(leaf, 0.1, True)
    want_next = torch.rand(3)
    want.backward(grad)
    torch.manual_seed(4)
    got, mask, got_grad = gm(x, grad)
    assert torch.equal(got, want * 2.0) and torch.equal(got_grad, leaf.grad)
    assert torch.equal(torch.rand(3), want_next)
    assert 0 < int(mask.sum()) < mask.numel()  # something dropped, something kept
    # the old arithmetic (0/1 mask, then the fp32 scale) is not eager's in this dtype
    assert not torch.equal(aten.native_dropout_backward(grad, mask, 1 / 0.9), leaf.grad)


def test_checking_the_split_leaves_the_users_random_stream_alone():
    from remat import passes

    passes._dropout_split_form.cache_clear()
    torch.manual_seed(11)
    want = torch.rand(4)
    torch.manual_seed(11)
    gm, _, _ = _dropout_graph(torch.float64, 0.25)
    assert split_dropout(gm) == 1
    assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize("layout", ["transposed", "permuted-4d", "strided"])
def test_dropout_split_draws_in_eagers_memory_order(layout):
    """NOTE [ Dropout draws in memory order ]: ``native_dropout`` fills its mask in the input's
    memory order, the functional ``bernoulli.p`` in logical order; on a transposed input the
    split drew every element another element's number before the draw was permuted."""
    base = torch.linspace(-2.0, 2.0, 4 * 6 * 5 * 7).reshape(4, 6, 5, 7)
    x = {"transposed": base.reshape(24, 35).t(), "permuted-4d": base.permute(2, 0, 3, 1),
         "strided": base.reshape(24, 35)[:, ::2].t()}[layout]

    def step(x):
        out, mask = aten.native_dropout(x, 0.3, True)
        return out, mask

    gm = make_fx(step, tracing_mode="fake")(x)
    assert split_dropout(gm) == 1
    torch.manual_seed(2)
    want, want_mask = step(x)
    torch.manual_seed(2)
    got, got_mask = gm(x)
    assert torch.equal(got_mask, want_mask) and torch.equal(got, want)
    assert got.stride() == want.stride()


def test_a_module_held_in_a_global_is_placed_under_its_caller():
    """NOTE [ Modules held in globals ]: Hugging Face's kernel-hub functions are module
    instances held in globals, one for every layer; their ops belong to the layer that called
    them, not to one path shared by every layer."""
    from torch import fx

    from remat.lowering import _node_module

    node = fx.Graph().placeholder("x")
    node.meta["nn_module_stack"] = {
        "a": ("L['self']", object), "b": ("L['self'].backbone.layers[1]", object),
        "c": ("L['self'].backbone.layers[1].mixer", object),
        "d": ("G['__import_transformers_dot_models_dot_mamba'].mamba_selective_scan", object),
        "e": ("G['__import_transformers_dot_models_dot_mamba'].inner", object)}
    assert _node_module(node) == "backbone.layers.1.mixer.mamba_selective_scan.inner"
    node.meta["nn_module_stack"] = {"a": ("G['mod'].fn", object)}  # called at the top: as is
    assert _node_module(node) == "G.mod.fn"
    node.meta["nn_module_stack"] = {"a": ("L['self'].layers[0]", object)}
    assert _node_module(node) == "layers.0"
