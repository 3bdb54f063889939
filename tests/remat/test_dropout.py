"""Every dropout flavour is bitwise eager's through ``remat.rematerialize``, recomputed or not.

Each model runs one training step under a seed, eagerly and rematerialized: outputs, every
gradient and the random stream's position afterwards must be identical. At "100%" nothing is
recomputed (the draws and products run in forward as eager runs them); at "50%" the schedule
recomputes, so the products of saved masks are remade in backward. NOTE [ Dropout draws in
memory order ] in :mod:`remat.passes` is why the transposed inputs of ``nn.MultiheadAttention``'s
``batch_first`` dropouts are here.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat

P = 0.1


class FunctionalDropout(nn.Module):
    """``F.dropout`` between linear layers, every other one on a transposed activation."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList(nn.Linear(64 if k == 0 else 256, 256) for k in range(4))
        self.out = nn.Linear(256, 64)

    def forward(self, x):
        for k, layer in enumerate(self.inner):
            h = torch.tanh(layer(x))
            x = (F.dropout(h, P, self.training) if k % 2 == 0 else
                 F.dropout(h.transpose(0, 1), P, self.training).transpose(0, 1))
        return self.out(x)


class ModuleDropout(nn.Sequential):
    def __init__(self) -> None:
        layers = [m for k in range(4) for m in (nn.Linear(64 if k == 0 else 256, 256), nn.GELU(),
                                                 nn.Dropout(P))]
        super().__init__(*layers, nn.Linear(256, 64))


class Attention(nn.Module):
    """``nn.MultiheadAttention`` (attention and output dropouts), twice."""

    def __init__(self, batch_first: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.MultiheadAttention(64, 4, dropout=P, batch_first=batch_first)
                                    for _ in range(2))
        self.ffn = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))

    def forward(self, x):
        for layer in self.layers:
            x = x + F.dropout(layer(x, x, x, need_weights=False)[0], P, self.training)
            x = x + self.ffn(x)
        return x


class SDPA(nn.Module):
    """``F.scaled_dot_product_attention(dropout_p=...)``, causal, two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(64, 3 * 64) for _ in range(2))
        self.proj = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))

    def forward(self, x):
        b, t, c = x.shape
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = qkv(x).view(b, t, 3, 4, c // 4).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=P if self.training else 0.0,
                                               is_causal=True)
            x = x + proj(y.transpose(1, 2).reshape(b, t, c))
        return x


def encoder(norm_first: bool, batch_first: bool = True) -> nn.Module:
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=P, batch_first=batch_first,
                                       norm_first=norm_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _batch(shape) -> tuple[torch.Tensor]:
    return (torch.randn(*shape, 64, generator=torch.Generator().manual_seed(1)),)


MODELS = {
    "nn.Dropout": (ModuleDropout, (512,)),
    "F.dropout": (FunctionalDropout, (512,)),
    "MultiheadAttention": (Attention, (8, 48)),
    "MultiheadAttention-seq-first": (lambda: Attention(batch_first=False), (48, 8)),
    "TransformerEncoderLayer": (lambda: encoder(norm_first=False), (8, 48)),
    "TransformerEncoderLayer-norm-first": (lambda: encoder(norm_first=True), (8, 48)),
    "TransformerEncoderLayer-seq-first": (lambda: encoder(False, batch_first=False), (48, 8)),
    "scaled_dot_product_attention": (SDPA, (8, 48)),
}


def _hf_gpt2(attention: str):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                  attn_pdrop=P, resid_pdrop=P, embd_pdrop=P,
                                  bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = attention
    return transformers.GPT2LMHeadModel(cfg)


def _step(model: nn.Module, args: tuple, kwargs: dict, seed: int):
    """One training step under ``seed``: (output, gradients, the stream's next numbers)."""
    torch.manual_seed(seed)
    out = model(*args, **kwargs)
    loss = out.loss if hasattr(out, "loss") else out.float().pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    logits = out.logits if hasattr(out, "logits") else out
    return logits.detach(), loss.detach(), grads, torch.rand(8)


def _assert_bitwise(model: nn.Module, args: tuple, kwargs: dict, budget: str) -> remat.Plan:
    model.train()
    rm = remat.rematerialize(model, *args, budget=budget, time_limit=30,
                             solver="none" if budget == "100%" else "hierarchical", **kwargs)
    for seed, call_args in ((5, args), (6, args)):
        want_out, want_loss, want_grads, want_next = _step(model, call_args, kwargs, seed)
        out, loss, grads, after = _step(rm, call_args, kwargs, seed)
        assert torch.equal(out, want_out) and torch.equal(loss, want_loss)
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, want_grads[name]), name
        assert torch.equal(after, want_next)  # the same draws, no more and no fewer
    return rm.plan


@pytest.mark.parametrize("budget", ["100%", "50%"])
@pytest.mark.parametrize("name", list(MODELS))
def test_dropout_is_bitwise_eager(name, budget):
    build, shape = MODELS[name]
    torch.manual_seed(0)
    plan = _assert_bitwise(build(), _batch(shape), {}, budget)
    if budget == "50%":
        assert plan.num_recomputed > 0  # something was recomputed, and still bitwise
        assert plan.predicted_peak_bytes <= plan.budget_bytes


@pytest.mark.parametrize("budget", ["100%", "50%"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_hugging_face_dropout_is_bitwise_eager(attention, budget):
    """GPT-2's attention, residual and embedding dropouts (``attn_pdrop``, ``resid_pdrop``,
    ``embd_pdrop``), with the loss inside the model."""
    torch.manual_seed(0)
    model = _hf_gpt2(attention)
    ids = torch.randint(128, (4, 64), generator=torch.Generator().manual_seed(0))
    plan = _assert_bitwise(model, (), {"input_ids": ids, "labels": ids}, budget)
    if budget == "50%":
        assert plan.num_recomputed > 0
