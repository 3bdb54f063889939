"""HiRemateCallback on variable-size batches and many fits in one process, as users run it.

No dynamo reset between fits: a script that calls ``trainer.fit`` ten times must keep
rematerializing (NOTE [ Owning the compiled frames ] in ``remat/frames.py``).
"""
from __future__ import annotations

import math
import random
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

pl = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

import remat  # noqa: E402
from integrations.lightning import HiRemateCallback  # noqa: E402

VOCAB, MIN_LEN, MAX_LEN, MAX_BATCH = 96, 32, 512, 8
# Allocations outside the schedule's model (the loop's scalars, allocator detail).
SLACK_BYTES = 4096


class LitGPT(pl.LightningModule):
    def __init__(self):
        super().__init__()
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                      n_positions=MAX_LEN, bos_token_id=0, eos_token_id=0)
        self.net = transformers.GPT2LMHeadModel(cfg)

    def training_step(self, batch, batch_idx):
        return self.net(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def padded_batches(steps: int = 40, seed: int = 0) -> list[torch.Tensor]:
    """Dynamic padding: 30 distinct lengths in [32, 512] (some used twice), batch sizes 1-8."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = rng.sample(range(MIN_LEN, MAX_LEN + 1), 30)
    lengths += rng.choices(lengths, k=steps - len(lengths))
    rng.shuffle(lengths)
    return [torch.randint(VOCAB, (rng.randint(1, MAX_BATCH), n), generator=gen) for n in lengths]


class StepMemory(pl.Callback):
    """Per-step losses and each training step's measured peak (``remat.track_memory``)."""

    def __init__(self):
        self.losses, self.peaks, self.net, self._mem = [], [], None, None
        self.compiled_here = []  # whether the step compiled (or solved) a schedule

    @staticmethod
    def _compiled(pl_module):
        net = pl_module.net
        if not isinstance(net, remat.RematModule):
            return None
        return len(net._remat_slots), len(net.shapes.entries), len(net.shapes.families)

    def on_train_start(self, trainer, pl_module):
        self.net = pl_module.net

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = self._compiled(pl_module)
        self._mem = remat.track_memory()
        self._tracker = self._mem.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._mem.__exit__(None, None, None)
        self.peaks.append(self._tracker.peak_bytes)
        self.compiled_here.append(self._compiled(pl_module) != self._before)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(loss.detach().clone())


def fit_gpt(batches, callback=None, module=None):
    pl.seed_everything(0, verbose=False)
    model = (module or LitGPT)()
    record = StepMemory()
    trainer = pl.Trainer(max_steps=len(batches), accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False,
                         callbacks=[record, *([callback] if callback else [])])
    trainer.fit(model, DataLoader(batches, batch_size=None, shuffle=False))
    return torch.stack(record.losses), record


def test_dynamic_padding_in_lightning_same_losses_within_budget_few_solves():
    batches = padded_batches()
    plain, _ = fit_gpt(batches)
    callback = HiRemateCallback(budget="65%", time_limit=10)
    losses, record = fit_gpt(batches, callback)
    net = record.net
    assert isinstance(net, remat.RematModule)
    # The same loss on every step, bit for bit: the same gradients and updates as eager.
    assert torch.equal(losses, plain), (losses - plain).abs().max()
    shapes = net.shapes
    family = shapes.serving  # the dynamic capture (NOTE [ Static first ])
    checked = 0
    worst = 0.0
    for k, batch in enumerate(batches):
        sizes = tuple(batch.shape)
        choice = shapes.choose(family.key, sizes)
        # A step that compiles a schedule (its first call; a batch of 1 is dynamo's own graph)
        # also traces it: the steady state is what the budget is about.
        if choice.fits and sizes[0] > 1 and not record.compiled_here[k]:
            budget = shapes.budget_at(family, sizes)
            # Every steady step within its budget. (Once up to 20% above in one run in three:
            # the warmup recorded `input_ids=batch, labels=batch` as two tensors, so the first
            # real call was a new specialisation captured inside a step; fixed in issue 12.
            # 8 runs since: every step within, the largest at 0.93 of its budget.)
            assert record.peaks[k] <= budget + SLACK_BYTES, (
                sizes, record.peaks[k], choice, budget, shapes.summary())
            checked += 1
            worst = max(worst, record.peaks[k] / budget)
    solves = len(net.plans)
    # Graphs dynamo specialises (a batch of 1, a length equal to n_positions) are solved once
    # each on their own; the bound is on the solves of the one captured graph.
    own = sum(e.plan is not None and e.family == family.key for e in shapes.entries)
    # What the run did, shown only when an assertion fails (tests print nothing themselves).
    report = (f"Lightning, 40 steps, 30 lengths: {solves} solves ({own} for the dynamic graph, "
              f"{len(shapes.families) - 2} specialised graphs), every one of {checked} steps "
              f"measured within the budget (largest: {worst:.3f} of it)\n{shapes.summary()}")
    assert own <= math.ceil(math.log2(MAX_LEN / MIN_LEN)) + 1, report
    assert checked >= 20, report


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(8))
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


class LitDeep(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Deep()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_ten_fits_in_one_process_are_all_rematerialized():
    gen = torch.Generator().manual_seed(0)
    for k in range(10):
        size = 64 + 8 * k  # a new batch size each fit, as a sweep would
        data = [(torch.randn(size, 32, generator=gen), torch.randint(4, (size,), generator=gen))
                for _ in range(3)]
        callback = HiRemateCallback(budget="80%", solver="dp", time_limit=5)
        losses = StepMemory()
        trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, callbacks=[losses, callback])
        trainer.fit(LitDeep(), DataLoader(data, batch_size=None))
        assert isinstance(losses.net, remat.RematModule), k
        plan = callback.plans["net"]
        assert plan.predicted_peak_bytes <= plan.budget_bytes < plan.baseline_bytes, k


def test_first_step_measured_within_budget_of_the_eager_step_on_hf_gpt2():
    """The callback's own report: the first training step's measured peak is > 0 (measured
    through the capture, never a silent 0) and within the budget of the eager warmup step,
    the loss included (NOTE [ A budget is what the user measures ])."""
    pl.seed_everything(0, verbose=False)
    model = LitGPT()
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(VOCAB, (8, 128), generator=gen) for _ in range(3)]
    callback = HiRemateCallback(budget="60%", time_limit=10)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[callback])
    trainer.fit(model, DataLoader(data, batch_size=None))
    eager, step = callback.eager_peak_bytes, callback.step_peak_bytes
    assert eager > 0 and step > 0
    assert step <= 0.6 * eager * 1.02, f"first step measured {step / eager:.3f} of eager"
    plan = callback.results["net"].plans[0]
    assert plan.eager_bytes + plan.outside_bytes == eager



class LitMixtral(pl.LightningModule):
    """Hugging Face Mixtral with its eager expert loop, loss inside the model."""

    def __init__(self):
        super().__init__()
        cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2, max_position_embeddings=128)
        self.net = transformers.MixtralForCausalLM(cfg)
        self.net.set_experts_implementation("eager")

    def training_step(self, batch, batch_idx):
        return self.net(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_eager_expert_loop_in_lightning_same_losses_within_budget():
    """NOTE [ An expert loop as one op ] as users meet it: the callback on a Mixtral whose
    experts run their eager loop (a ``CaptureError`` before), six SGD steps of new routings
    each: every loss bitwise the plain run's, every step within 50% of the warmup step."""
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(VOCAB, (8, 64), generator=gen) for _ in range(6)]
    plain, _ = fit_gpt(batches, module=LitMixtral)
    callback = HiRemateCallback(budget="50%", time_limit=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, record = fit_gpt(batches, callback, module=LitMixtral)
    # the callback's own plan cache is no option the user gave (Mixtral's forward takes cache=)
    assert not [w for w in caught if "sets remat's own option" in str(w.message)]
    assert isinstance(record.net, remat.RematModule)
    assert torch.equal(losses, plain), (losses - plain).abs().max()
    eager = callback.eager_peak_bytes
    assert max(record.peaks) <= 0.50 * eager + SLACK_BYTES, [p / eager for p in record.peaks]
    assert "experts layers ran as one op" in record.net.plan.summary()

class TwoOutputs(nn.Module):
    """Returns its logits and its stacked hidden states; the training step uses the logits."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                    for _ in range(4))
        self.head = nn.Linear(64, VOCAB)

    def forward(self, ids):
        h, hidden = self.emb(ids), []
        for layer in self.layers:
            h = h + layer(h)
            hidden.append(h)
        return self.head(h), torch.stack(hidden)


class LitDropsAnOutput(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = TwoOutputs()

    def training_step(self, batch, batch_idx):
        logits, _ = self.net(batch)  # the hidden states are dropped
        return F.cross_entropy(logits.flatten(0, 1), batch.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_small_first_batch_and_dropped_outputs_keep_a_byte_budget_on_every_step():
    """The issue's run: a byte budget, a training step that drops an output the module returns
    (the module's own step held it: a credit), batch sizes 1-8 and lengths 16-256, and a first
    batch so small it runs eagerly. Every later batch is captured, solved or re-priced inside
    training (NOTE [ Measuring ops one at a time ], NOTE [ A credit never grows ]): those steps
    measured up to 1.57x the budget, and steady ones up to 1.12x; now every step whose sizes
    a schedule fits keeps the budget, with eager's losses bit for bit."""
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(VOCAB, (2, 32), generator=gen)]
    batches += [torch.randint(VOCAB, (rng.randint(1, 8), rng.randint(16, 256)), generator=gen)
                for _ in range(23)]
    budget = remat.parse_budget("10MiB").bytes
    plain, eager = fit_gpt(batches, module=LitDropsAnOutput)
    assert max(eager.peaks) > 2 * budget and eager.peaks[0] < budget
    with pytest.warns(UserWarning, match="a batch larger than the example"):
        losses, record = fit_gpt(batches, HiRemateCallback(budget="10MiB", time_limit=10),
                                 module=LitDropsAnOutput)
    assert torch.equal(losses, plain), (losses - plain).abs().max()
    shapes = record.net.shapes
    family = shapes.serving  # the dynamic capture (NOTE [ Static first ])
    checked = 0
    for k, batch in enumerate(batches[1:], start=1):
        sizes = tuple(batch.shape)
        choice = shapes.choices.get((family.key, sizes))
        if choice is None or not choice.fits:  # a batch of 1 (its own graph) or warned about
            continue
        assert record.peaks[k] <= budget + SLACK_BYTES, (k, sizes, record.peaks[k] / budget)
        checked += 1
    assert checked >= 15, shapes.summary()
