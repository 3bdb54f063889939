"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) in a capture, run as eager runs them.

NOTE [ Recurrent layers as eager runs them ]
Dynamo refuses ``nn.RNNBase`` modules ("Attempted to wrap RNN, GRU, or LSTM") unless
``torch._dynamo.config.allow_rnn`` is set (:func:`remat.frames.capture_config` sets it). With it,
the layer becomes one ``aten.lstm``/``gru``/``rnn_tanh``/``rnn_relu`` call that AOTAutograd traces
through PyTorch's Python decompositions (``torch/_decomp/decompositions.py``), and those differ
from the eager step the user runs in two ways:

* Eager's CPU LSTM (float32, oneDNN enabled, no projections) runs oneDNN's fused kernel
  (``mkldnn_rnn_layer``, one call per layer and direction) and its backward
  (``mkldnn_rnn_layer_backward``); the decomposition is a cell loop of matmuls and pointwise ops
  whose sums run in another order: gradients 2-4e-9 away from eager's on a 2-layer LSTM LM.
* ``_rnn_helper`` applies dropout between layers only when ``num_layers < i - 1``, which never
  holds: a GRU, RNN or LSTM with ``dropout > 0`` trains without it, silently.

So while our backend traces, :func:`recurrent_kernels` puts kernels of our own in front of those
decompositions that run what eager runs: the LSTM through oneDNN as :func:`lstm_layer` (one
opaque op per layer and direction), everything else through PyTorch's cell loops, with dropout
between layers where eager applies it (``aten/src/ATen/native/RNN.cpp``, ``apply_layer_stack``;
``mkldnn/RNN.cpp``, ``mkldnn_rnn``). Gradients are then bitwise eager's (tests/remat/
test_recurrent.py). Elsewhere the decomposition stays: an LSTM on CUDA (eager runs cuDNN, whose
sums we cannot reproduce op by op) or with projections is captured as a cell loop whose gradients
are close to eager's, not bitwise (README, "What it captures").

NOTE [ The LSTM's workspace is recomputed in its backward ]
oneDNN's training forward returns a workspace (gates and states of every step: 7.6 MiB for 64
steps of a batch of 16 and 128 hidden units, 15x the layer's output) that eager keeps for the
backward. Its size is oneDNN's business (PyTorch's meta kernel says 0 bytes), so a graph holding
it would price memory it cannot see. :func:`lstm_layer` returns only the output and the final
states and drops the workspace at once, and :func:`lstm_layer_backward` runs the forward again
for it, inside the op, before oneDNN's backward: the workspace is scratch memory of those two
ops, which profiling measures (NOTE [ Measuring op times ] in :mod:`remat.costs`). The forward
is deterministic, so the workspace, and the gradients, are eager's; the price is one more forward
of the layer in backward, and the memory eager keeps between forward and backward is not kept.
Both run the training primitive: the inference one (grad mode off, no workspace) differs from it
in the last bits for some shapes (an input as wide as the hidden state: 2-layer LSTM gradients
5e-10 off).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch._decomp.decompositions as decomp
from torch import Tensor
from torch._C import DispatchKey

__all__ = ["lstm_layer", "lstm_layer_backward", "recurrent_kernels"]

aten = torch.ops.aten
_LSTM_MODE = 2  # ideep::rnn_kind::LSTM: the ``mode`` oneDNN's RNN ops take
_FLAGS = ("reverse", "hidden_size", "num_layers", "has_biases", "bidirectional", "batch_first",
          "train")


def _onednn_lstm(input: Tensor, weights: tuple[Tensor, ...], hx: Tensor, cx: Tensor,
                 flags: tuple) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``aten.mkldnn_rnn_layer`` as eager's ``mkldnn_rnn`` calls it with grad mode on: on
    detached tensors (nothing is recorded), where it returns the workspace (NOTE [ The LSTM's
    workspace is recomputed in its backward ])."""
    reverse, hidden_size, num_layers, has_biases, bidirectional, batch_first, train = flags
    tensors = [t.detach() for t in (input, *weights, hx, cx)]
    with torch.enable_grad():
        return aten.mkldnn_rnn_layer(*tensors, reverse, [], _LSTM_MODE, hidden_size, num_layers,
                                     has_biases, bidirectional, batch_first, train)


@torch.library.custom_op("hiremate::lstm_layer", mutates_args=())
def lstm_layer(input: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor, b_hh: Tensor,
               hx: Tensor, cx: Tensor, reverse: bool, hidden_size: int, num_layers: int,
               has_biases: bool, bidirectional: bool, batch_first: bool, train: bool
               ) -> tuple[Tensor, Tensor, Tensor]:
    """One layer and direction of a CPU LSTM through oneDNN: output ``(T, N, H)`` of the
    time-major ``input``, and the final ``hx``, ``cx``; the workspace is dropped (NOTE [ The
    LSTM's workspace is recomputed in its backward ])."""
    out, hy, cy, _ = _onednn_lstm(input, (w_ih, w_hh, b_ih, b_hh), hx, cx,
                                  (reverse, hidden_size, num_layers, has_biases, bidirectional,
                                   batch_first, train))
    return out, hy, cy


@lstm_layer.register_fake
def _(input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, hidden_size, num_layers, has_biases,
      bidirectional, batch_first, train):
    # oneDNN reads ``input`` time-major whatever ``batch_first`` says (eager transposes first)
    return input.new_empty(input.shape[0], input.shape[1], hidden_size), \
        hx.new_empty(hx.shape), cx.new_empty(cx.shape)


@torch.library.custom_op("hiremate::lstm_layer_backward", mutates_args=())
def lstm_layer_backward(input: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor, b_hh: Tensor,
                        hx: Tensor, cx: Tensor, out: Tensor, hy: Tensor, cy: Tensor,
                        grad_out: Tensor | None, grad_hy: Tensor | None,
                        grad_cy: Tensor | None, reverse: bool, hidden_size: int,
                        num_layers: int, has_biases: bool, bidirectional: bool,
                        batch_first: bool, train: bool) -> tuple[Tensor, Tensor, Tensor, Tensor,
                                                                 Tensor, Tensor, Tensor]:
    """Gradients of :func:`lstm_layer` for ``input``, the four weights, ``hx`` and ``cx``: the
    forward again for its workspace, then oneDNN's backward, as eager's autograd calls it."""
    flags = (reverse, hidden_size, num_layers, has_biases, bidirectional, batch_first, train)
    workspace = _onednn_lstm(input, (w_ih, w_hh, b_ih, b_hh), hx, cx, flags)[3]
    return aten.mkldnn_rnn_layer_backward(
        input, w_ih, w_hh, b_ih, b_hh, hx, cx, out, hy, cy, grad_out, grad_hy, grad_cy, reverse,
        _LSTM_MODE, hidden_size, num_layers, has_biases, train, bidirectional, [], batch_first,
        workspace)


@lstm_layer_backward.register_fake
def _(input, w_ih, w_hh, b_ih, b_hh, hx, cx, *_):
    # oneDNN's backward computes in float32 (autograd casts each gradient to its input's
    # dtype), and both bias gradients have the gates' size (the biases are weight-sized zeros
    # when the layer has none)
    f32 = dict(dtype=torch.float32)
    bias = (w_ih.shape[0],)
    return (input.new_empty(input.shape, **f32), w_ih.new_empty(w_ih.shape, **f32),
            w_hh.new_empty(w_hh.shape, **f32), w_ih.new_empty(bias, **f32),
            w_ih.new_empty(bias, **f32), hx.new_empty(hx.shape, **f32),
            cx.new_empty(cx.shape, **f32))


def _save(ctx, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(*inputs[:7], *output)
    ctx.flags = inputs[7:]


def _backward(ctx, grad_out, grad_hy, grad_cy):
    grads = list(lstm_layer_backward(*ctx.saved_tensors, grad_out, grad_hy, grad_cy,
                                     *ctx.flags))
    if not ctx.flags[_FLAGS.index("has_biases")]:
        grads[3] = grads[4] = None  # the zeros eager passes in their place
    return (*grads, *([None] * len(_FLAGS)))


lstm_layer.register_autograd(_backward, setup_context=_save)


def _onednn_eligible(input: Tensor, hx: tuple[Tensor, ...], params: list[Tensor]) -> bool:
    """Whether eager's ``at::lstm`` runs oneDNN here (``use_mkldnn`` in ATen's RNN.cpp, as far
    as we reproduce it bitwise: float32 on the CPU, no projections)."""
    tensors = [input, *hx, *params]
    return (torch._C._get_mkldnn_enabled()
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and hx[0].size(2) == hx[1].size(2) and input.numel() != 0)


def _layers(input: Tensor, hidden: list, params: list, num_layers: int, dropout: float,
            train: bool, bidirectional: bool, batch_first: bool, layer_fn
            ) -> tuple[Tensor, list]:
    """Every layer and direction of a stacked RNN, time-major inside, with dropout between
    layers where eager applies it (NOTE [ Recurrent layers as eager runs them ])."""
    layer_input = input.transpose(0, 1) if batch_first else input
    directions = 2 if bidirectional else 1
    finals = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            out, final = layer_fn(layer_input, hidden[index], params[index], direction > 0)
            outputs.append(out)
            finals.append(final)
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout != 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout, True)
    return (layer_input.transpose(0, 1) if batch_first else layer_input), finals


def _lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    weights = decomp.gather_params(params, has_biases, hx[0].size(2) != hx[1].size(2))
    if _onednn_eligible(input, hx, params):
        h0, c0 = hx[0].contiguous(), hx[1].contiguous()

        def layer_fn(x, hidden, weights, reverse):
            w_ih, w_hh = weights[:2]
            b_ih, b_hh = (weights[2:] if has_biases else  # the zeros eager passes
                          (torch.zeros(w_ih.shape, dtype=w_ih.dtype, device=w_ih.device),
                           torch.zeros(w_hh.shape, dtype=w_hh.dtype, device=w_hh.device)))
            out, hy, cy = lstm_layer(x, w_ih, w_hh, b_ih, b_hh, hidden[0], hidden[1], reverse,
                                     h0.size(2), num_layers, has_biases, bidirectional,
                                     batch_first, train)
            return out, (hy, cy)

        # time-major and contiguous once, as eager's mkldnn_rnn makes it (every later layer's
        # input is a fresh output); ``batch_first`` still reaches oneDNN as eager passes it
        time_major = (input.transpose(0, 1) if batch_first else input).contiguous()
        out, finals = _layers(time_major, list(zip(h0, c0)), weights, num_layers, dropout,
                              train, bidirectional, False, layer_fn)
        out = out.transpose(0, 1) if batch_first else out
    else:
        def layer_fn(x, hidden, weights, reverse):
            return decomp.one_layer_lstm(x, hidden, weights, has_biases, reverse=reverse)

        out, finals = _layers(input, list(zip(hx[0], hx[1])), weights, num_layers, dropout,
                              train, bidirectional, batch_first, layer_fn)
    return out, torch.stack([h for h, _ in finals]), torch.stack([c for _, c in finals])


def _cell_rnn(cell):
    def kernel(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
               batch_first):
        grouped = decomp.gather_params(params, has_biases, False)

        def cell_loop(x, hidden, weights, reverse):
            return decomp.one_layer_rnn(x, hidden, weights, has_biases, cell, reverse=reverse)

        out, finals = _layers(input, list(hx.unbind(0)), grouped, num_layers, dropout, train,
                              bidirectional, batch_first, cell_loop)
        return out, torch.stack(finals, 0)
    return kernel


_KERNELS = {
    aten.lstm.input: _lstm,
    aten.gru.input: _cell_rnn(decomp.gru_cell),
    aten.rnn_tanh.input: _cell_rnn(decomp.rnn_cell(torch.tanh)),
    aten.rnn_relu.input: _cell_rnn(decomp.rnn_cell(torch.relu)),
}
_KEYS = (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd)


@contextlib.contextmanager
def recurrent_kernels() -> Iterator[None]:
    """While tracing, trace recurrent layers as eager runs them (NOTE [ Recurrent layers as
    eager runs them ]); PyTorch's own decompositions are back afterwards."""
    saved = {op: {key: op.py_kernels.get(key) for key in _KEYS} for op in _KERNELS}
    try:
        for op, kernel in _KERNELS.items():
            for key in _KEYS:
                op.py_kernels[key] = kernel
            op._dispatch_cache.clear()
        yield
    finally:
        for op, kernels in saved.items():
            for key, kernel in kernels.items():
                if kernel is None:
                    op.py_kernels.pop(key, None)
                else:
                    op.py_kernels[key] = kernel
            op._dispatch_cache.clear()
