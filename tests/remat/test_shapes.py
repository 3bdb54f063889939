"""Many input shapes, many models, one process: NOTE [ Shape-generic plans ] as users hit it.

No test here resets dynamo, nor does the suite between them (``dynamo_state_carries``): they run
the way a training script does, one process, many models and calls.
"""
from __future__ import annotations

import copy
import gc
import math
import random
import time
import weakref

import pytest
import torch
from torch import nn

import remat

transformers = pytest.importorskip("transformers")

# Allocations outside the schedule's model: the test's scalar, and allocator detail of small
# temporaries (measured: up to 180 B above the prediction on the unmodified step).
LOSS_SLACK_BYTES = 1024
TIME_LIMIT = 10.0
MIN_LEN, MAX_LEN, MAX_BATCH = 32, 512, 8


# One thread (see tests/conftest.py); dynamo's caches carry from test to test, as in a run.
# Tests of the machinery that serves many sizes from one graph capture with dynamic dimensions
# at once (dynamic=True, as the integrations do); rematerialize's default, the example's static
# shapes first (NOTE [ Static first ]), is what the 40-step run and the static-first test use.
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.dynamo_state_carries]


def tiny_gpt2(seed: int = 0) -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
                                  n_positions=MAX_LEN, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).train()


def shapes(count: int, seed: int = 0) -> list[tuple[int, int]]:
    """``count`` batches: 30 distinct lengths in [32, 512] (each used once or twice), random
    batch sizes 1-8, in a random order (dynamic padding of a real fine-tuning run)."""
    rng = random.Random(seed)
    lengths = rng.sample(range(MIN_LEN, MAX_LEN + 1), 30)
    lengths += rng.choices(lengths, k=count - len(lengths))
    rng.shuffle(lengths)
    return [(rng.randint(1, MAX_BATCH), n) for n in lengths]


def test_forty_steps_thirty_lengths_exact_within_budget_few_solves():
    ref = tiny_gpt2()
    model = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(0)
    example = torch.randint(96, (4, 128), generator=gen)

    # The setup this is compared with: the same model and example captured once for every
    # size (dynamic=True). The run below captures the example's static shapes first, then
    # once more with dynamic sizes at the first other shape (NOTE [ Static first ]).
    t0 = time.perf_counter()
    # 62% of the eager step as a user measures it (model(**batch).loss.backward(), the logits
    # dropped) is the 65% of the step measured with the logits held this test was sized at.
    remat.rematerialize(copy.deepcopy(ref), input_ids=example, labels=example, budget="62%",
                        time_limit=TIME_LIMIT, dynamic=True)
    single_setup = time.perf_counter() - t0

    t0 = time.perf_counter()
    rm = remat.rematerialize(model, input_ids=example, labels=example, budget="62%",
                             time_limit=TIME_LIMIT)
    setup = time.perf_counter() - t0
    steps = shapes(40)
    assert len({n for _, n in steps}) == 30
    checked = 0
    for k, (batch, length) in enumerate(steps):
        ids = torch.randint(96, (batch, length), generator=gen)
        for p in [*ref.parameters(), *model.parameters()]:
            p.grad = None
        torch.manual_seed(k)
        t0 = time.perf_counter()
        expected = ref(input_ids=ids, labels=ids)
        expected.loss.backward()
        eager = time.perf_counter() - t0
        torch.manual_seed(k)
        t0 = time.perf_counter()
        with remat.track_memory() as mem:
            out = rm(input_ids=ids, labels=ids)
            out.loss.backward()
        # Setup inside a step (a compile, a solve): its time beyond 3x the eager step (which
        # covers the recomputation and the memory profiler's own overhead).
        setup += max(0.0, time.perf_counter() - t0 - 3 * eager)
        assert torch.equal(out.loss, expected.loss), (batch, length)
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), (batch, length)
        if batch == 1:
            continue  # dynamo's own size-1 graph (its first call captures and profiles it)
        family = rm.shapes.serving
        choice = rm.shapes.choose(family.key, (batch, length))
        budget = rm.shapes.budget_at(family, (batch, length))
        # Predicted within 1% (the eager step's is an upper estimate: NOTE [ The unmodified
        # step runs eagerly ]).
        assert mem.peak_bytes <= choice.peak_bytes * 1.01 + LOSS_SLACK_BYTES, (batch, length)
        if choice.fits:
            assert mem.peak_bytes <= budget + LOSS_SLACK_BYTES, (batch, length)
            checked += 1
    solves = len(rm.plans)
    # What the run did, shown only when an assertion fails (tests print nothing themselves).
    report = (f"40 steps, 30 lengths: {solves} solves, setup {setup:.1f} s (one capture for "
              f"every size {single_setup:.1f} s); {checked} steps within the budget\n"
              f"{rm.shapes.summary()}")
    assert solves <= math.ceil(math.log2(MAX_LEN / MIN_LEN)) + 1, report
    assert checked >= 28, report
    assert setup <= 3 * single_setup, report


def paired_step(ref, rm, ids, seed):
    """The same step on the eager model and the rematerialized one (the same dropout draws);
    returns the rematerialized step's measured peak."""
    for p in [*ref.parameters(), *rm.parameters()]:
        p.grad = None
    torch.manual_seed(seed)
    ref(input_ids=ids, labels=ids).loss.backward()
    torch.manual_seed(seed)
    with remat.track_memory() as mem:
        rm(input_ids=ids, labels=ids).loss.backward()
    return mem.peak_bytes


def test_a_later_larger_batch_is_rematerialized_not_run_unmodified():
    model = tiny_gpt2()
    small = torch.randint(96, (2, 64))
    rm = remat.rematerialize(model, input_ids=small, labels=small, budget="65%",
                             time_limit=TIME_LIMIT)
    big = torch.randint(96, (8, 256))
    with remat.track_memory() as mem:
        rm(input_ids=big, labels=big).loss.backward()
    family = rm.shapes.serving
    choice = rm.shapes.choose(family.key, (8, 256))
    baseline = rm.shapes.baseline_at(family, (8, 256))
    # "65%" follows the largest batch seen: 65% of the big batch's unmodified peak.
    assert choice.fits and rm.shapes.entries[choice.entry].plan is not None  # a solved schedule
    assert mem.peak_bytes <= 0.65 * baseline + LOSS_SLACK_BYTES


@pytest.fixture
def modelled_times(monkeypatch):
    """Op times from the FLOP/byte model instead of the clock (memory is still measured): which
    schedule a solver picks among near-equal ones follows measured times, so a test that needs
    one particular pick gets the same one in every run. Measured, the loosened solve below
    picked a schedule that missed the batch in most runs and fitted it in one (4,572,344 B
    against 4,662,677 B in a full-suite run), and that test then tested nothing."""
    import remat.dynamo_backend
    from remat.costs import model_op_times

    measure = remat.dynamo_backend.measure_op_times

    def modelled(lowered, joint, primals, **kw):
        costs = measure(lowered, joint, primals, **{**kw, "repeats": 0})
        times = model_op_times(lowered)
        return costs._replace(times=times, rerun_times=times)

    monkeypatch.setattr(remat.dynamo_backend, "measure_op_times", modelled)


def test_a_bucket_schedule_that_misses_its_batch_is_tightened_not_resolved_per_size(
        monkeypatch, modelled_times):
    """NOTE [ A bucket solved for its batch ]: the bucket's first schedule is made to miss the
    batch that asked (solved 40% looser, as a solver's pick among near-equal schedules can);
    the bucket is solved once more, tighter, and that schedule covers the longer batches."""
    import remat.planner

    model = tiny_gpt2()
    example = torch.randint(96, (2, 40))
    rm = remat.rematerialize(model, input_ids=example, labels=example, budget="65%",
                             time_limit=TIME_LIMIT, dynamic=True)
    solved = []
    real = remat.planner.plan_graph

    def loose_first(graph, budget, **kw):
        if not solved:
            budget = remat.Budget(bytes=int(budget.bytes * 1.4), text="loosened")
        solved.append(budget.bytes)
        return real(graph, budget, **kw)

    monkeypatch.setattr(remat.planner, "plan_graph", loose_first)
    family = rm.shapes.serving
    for length in (200, 230, 250):
        ids = torch.randint(96, (2, length))
        with remat.track_memory() as mem:
            rm(input_ids=ids, labels=ids).loss.backward()
        choice = rm.shapes.choose(family.key, (2, length))
        budget = rm.shapes.budget_at(family, (2, length))
        if length == 200:
            # The loosened schedule indeed misses the batch (else this test tests nothing).
            assert rm.shapes.price(family, len(rm.shapes.entries) - 2, (2, 200)).peak_bytes \
                * 1.01 > budget
        assert choice.fits and mem.peak_bytes <= budget + LOSS_SLACK_BYTES, length
    labels = [e.label for e in rm.shapes.entries if e.plan is not None]
    assert labels[1:] == ["solved at input_ids[0]=2, input_ids[1]=256"] * 2, labels
    assert len(solved) == 2 and solved[1] < solved[0] / 1.4, solved


def test_a_new_size_family_over_the_budget_is_measured_op_by_op_not_run_unmodified():
    """NOTE [ Measuring ops one at a time ]: a batch of size 1 is dynamo's own graph, captured
    in the step that meets it; measuring its ops ran its unmodified step inside that step
    (1.05x the eager step's peak under a budget of 0.7x). Measured one op at a time, the step
    keeps the budget, and its gradients are eager's."""
    ref = tiny_gpt2()
    model = copy.deepcopy(ref)
    one = torch.randint(96, (1, 512))
    with remat.track_memory() as eager:
        ref(input_ids=one, labels=one).loss.backward()
    budget = int(0.7 * eager.peak_bytes)
    example = torch.randint(96, (4, 256))
    rm = remat.rematerialize(model, input_ids=example, labels=example, budget=f"{budget}B",
                             time_limit=TIME_LIMIT)
    peak = paired_step(ref, rm, one, seed=1)
    assert peak <= budget + LOSS_SLACK_BYTES, (peak, budget)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert len(rm.shapes.families) == 2
    assert rm.plans[-1].detail.endswith("ops measured one at a time: the unmodified step would "
                                        "not fit the budget")
    assert rm.plans[-1].predicted_peak_bytes <= budget


def gpt2_at_bytes(fraction: float):
    """A tiny GPT-2, its copy rematerialized (dynamic sizes) on a 2 x 160 example at a byte
    budget of ``fraction`` of that example's measured eager step: ``(ref, model, rm, budget)``."""
    ref = tiny_gpt2()
    model = copy.deepcopy(ref)
    example = torch.randint(96, (2, 160))
    with remat.track_memory() as eager:
        copy.deepcopy(ref)(input_ids=example, labels=example).loss.backward()
    budget = int(fraction * eager.peak_bytes)
    rm = remat.rematerialize(model, input_ids=example, labels=example, budget=f"{budget}B",
                             time_limit=TIME_LIMIT, dynamic=True)
    return ref, model, rm, budget


def test_a_least_memory_fallback_is_named_with_its_time_and_revisited(monkeypatch):
    """NOTE [ An over-budget choice is revisited ]: a batch only the least-memory schedule
    fits (its solves fail here by design) is warned about with its predicted slowdown, and runs
    the schedule solved later for a longer batch once there is one."""
    import remat.planner

    ref, model, rm, budget = gpt2_at_bytes(0.95)
    real = remat.planner.plan_graph

    def failing(graph, b, **kw):
        raise remat.InfeasibleBudgetError(budget_bytes=b.bytes, lower_bound_bytes=0,
                                          baseline_bytes=1, solver="test")

    family = rm.shapes.serving
    short, long = torch.randint(96, (2, 200)), torch.randint(96, (2, 260))
    monkeypatch.setattr(remat.planner, "plan_graph", failing)
    with pytest.warns(UserWarning, match=r"no solved schedule fits .* input_ids\[1\]=200; .*"
                                         r"predicted at \d+\.\dx the unmodified step's time"):
        rm(input_ids=short, labels=short).loss.backward()
    fallback = rm.shapes.choices[(family.key, (2, 200))]
    assert fallback.fallback and not fallback.settled
    assert rm.shapes.entries[fallback.entry].label == "least memory (recompute on demand)"

    monkeypatch.setattr(remat.planner, "plan_graph", real)
    rm(input_ids=long, labels=long).loss.backward()  # solved: a new schedule
    peak = paired_step(ref, rm, short, seed=3)
    again = rm.shapes.choices[(family.key, (2, 200))]  # as the module chose, not asked again
    assert again.settled and rm.shapes.entries[again.entry].plan is not None
    assert again.time < fallback.time
    assert peak <= budget + LOSS_SLACK_BYTES
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_sizes_nothing_fits_run_the_fastest_schedule_at_the_lowest_peak():
    """NOTE [ The fastest at the lowest peak ]: a batch whose lower bound is over a byte budget
    ran the least-memory schedule (5.5x the step's time here) as the lowest peak; the solver,
    asked for that peak, finds a schedule as low at a fraction of the time."""
    from remat.planner import least_memory_schedule

    ref, model, rm, budget = gpt2_at_bytes(0.5)
    long = torch.randint(96, (2, 320))
    with pytest.warns(UserWarning, match=r"no schedule fits the budget .* input_ids\[1\]=320 "
                                         r"\(no schedule can go below .*predicted at 1\.\dx"):
        peak = paired_step(ref, rm, long, seed=1)
    family = rm.shapes.serving
    graph = family.sized.at((2, 320))
    crawling = least_memory_schedule(graph)[1]
    assert crawling.time > 2 * graph.baseline_time  # what ran before
    choice = rm.shapes.choices[(family.key, (2, 320))]
    assert not choice.fallback and not choice.fits
    assert choice.peak_bytes <= crawling.peak_bytes and choice.time < 2 * graph.baseline_time
    assert peak <= choice.peak_bytes + LOSS_SLACK_BYTES
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_views_and_fresh_batches_share_one_capture():
    """NOTE [ Views reach the capture without their base ]: a batch cut from a longer one, then
    collated ones, then a cut again: one graph structure, no recompilation, eager's gradients."""
    from torch._dynamo.utils import counters

    ref = tiny_gpt2()
    model = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(0)
    long = torch.randint(96, (4, 300), generator=gen)
    batches = [long[:, :300], torch.randint(96, (4, 200), generator=gen), long[:, :150],
               torch.randint(96, (3, 260), generator=gen)]
    assert batches[0]._base is long and batches[1]._base is None
    rm = remat.rematerialize(model, input_ids=batches[0], labels=batches[0], budget="65%",
                             time_limit=TIME_LIMIT, dynamic=True)
    frames = counters["stats"]["unique_graphs"]
    for k, ids in enumerate(batches):
        for p in [*ref.parameters(), *model.parameters()]:
            p.grad = None
        torch.manual_seed(k)
        ref(input_ids=ids, labels=ids).loss.backward()
        torch.manual_seed(k)
        rm(input_ids=ids, labels=ids).loss.backward()
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), k
    assert len(rm.shapes.families) == 1, rm.shapes.summary()
    # Each further graph is a schedule's own compile (one per schedule in use), never a recompile.
    assert counters["stats"]["unique_graphs"] - frames <= len(rm.shapes.in_use)


def test_a_later_small_batch_runs_the_eager_step_within_the_budget():
    """NOTE [ The unmodified step runs eagerly ]: a batch whose unmodified step fits the budget
    runs the model's own step, with no capture of its own, and measures within the budget."""
    from torch._dynamo.utils import counters

    ref = tiny_gpt2()
    example = torch.randint(96, (4, 128))
    rm = remat.rematerialize(copy.deepcopy(ref), input_ids=example, labels=example,
                             budget="65%", time_limit=TIME_LIMIT, dynamic=True)
    captures = counters["aot_autograd"]["total"]
    for k, (batch, length) in enumerate([(2, 40), (1, 33), (3, 17)]):
        ids = torch.randint(96, (batch, length))
        peak = paired_step(ref, rm, ids, seed=k)
        for a, b in zip(ref.parameters(), rm.parameters()):
            assert torch.equal(a.grad, b.grad), (batch, length)
        family = rm.shapes.serving
        choice = rm.shapes.choose(family.key, (batch, length))
        entry = rm.shapes.entries[choice.entry]
        assert entry.eager and entry.label == "unmodified step, run eagerly", entry.label
        assert peak <= rm.shapes.budget_at(family, (batch, length)) + LOSS_SLACK_BYTES
    assert counters["aot_autograd"]["total"] == captures
    assert len(rm.plans) == 1
    # NOTE [ Naming sizes ]: named by keyword and axis, schedules numbered from 1.
    summary = rm.shapes.summary().splitlines()
    assert [line.split(": ")[0] for line in summary] == [
        "input_ids[0]=1, input_ids[1]=33   schedule 2 (unmodified step, run eagerly)",
        "input_ids[0]=2, input_ids[1]=40   schedule 2 (unmodified step, run eagerly)",
        "input_ids[0]=3, input_ids[1]=17   schedule 2 (unmodified step, run eagerly)",
        "input_ids[0]=4, input_ids[1]=128  schedule 1 (solved at input_ids[0]=4, "
        "input_ids[1]=128)",
    ], summary


def test_a_batch_of_one_that_dynamo_specialises_runs_as_eager_from_its_first_step():
    """NOTE [ A specialisation the eager step fits ]: dynamo traces a batch of 1 as a graph of
    its own, captured inside the step. Its unmodified step fits "50%" of the run, and it ran
    compiled: 1.21x its eager peak on the capturing step (which also measured its ops), 1.11x
    after. Now every step at those shapes measures what eager does, bitwise."""
    ref = tiny_gpt2()
    example = torch.randint(96, (4, 128))
    rm = remat.rematerialize(copy.deepcopy(ref), input_ids=example, labels=example,
                             budget="50%", time_limit=TIME_LIMIT)
    for k, length in enumerate([100, 100, 50]):
        ids = torch.randint(96, (1, length))
        for p in ref.parameters():
            p.grad = None
        torch.manual_seed(k)
        with remat.track_memory() as eager:
            ref(input_ids=ids, labels=ids).loss.backward()
        peak = paired_step(ref, rm, ids, seed=k)
        assert peak <= eager.peak_bytes + LOSS_SLACK_BYTES, (length, peak, eager.peak_bytes)
        for a, b in zip(ref.parameters(), rm.parameters()):
            assert torch.equal(a.grad, b.grad), length
    assert len(rm.shapes.families) == 2
    assert rm.plans[-1].detail == "the eager step fits the budget: ops not measured"
    # NOTE [ A graph serves the sizes it did not fix ]: that graph's batch is the constant 1; a
    # batch of 8 was priced on it and ran its eager step, at 1.36x the budget.
    ids = torch.randint(96, (8, 50))
    for p in ref.parameters():
        p.grad = None
    with remat.track_memory() as eager:
        ref(input_ids=ids, labels=ids).loss.backward()
    peak = paired_step(ref, rm, ids, seed=3)
    assert peak <= rm.plan.budget_bytes + LOSS_SLACK_BYTES, (peak, rm.plan.budget_bytes)
    for a, b in zip(ref.parameters(), rm.parameters()):
        assert torch.equal(a.grad, b.grad)
    rows = [row.split(": ")[0] for row in rm.shapes.summary().splitlines()]
    assert rows[-2:] == ["input_ids[1]=50                  schedule 4 (unmodified step, run "
                         "eagerly)",
                         "input_ids[1]=100                 schedule 4 (unmodified step, run "
                         "eagerly)"], rows
    assert rows[1].startswith("input_ids[0]=8, input_ids[1]=50  schedule 5 (solved at "), rows


def test_twenty_rematerialize_calls_in_one_process_all_rematerialized():
    # One model class (its forward's code is shared) and other classes, without a dynamo reset.
    models = [tiny_gpt2(seed) for seed in range(10)]
    models += [nn.Sequential(*[m for _ in range(2 + k % 3) for m in (nn.Linear(32, 32), nn.GELU())])
               for k in range(10)]
    for k, model in enumerate(models):
        if isinstance(model, nn.Sequential):
            args, kwargs = (torch.randn(64 + k, 32),), {}
        else:
            ids = torch.randint(96, (2, 40 + k))
            args, kwargs = (), {"input_ids": ids, "labels": ids}
        ref = copy.deepcopy(model)
        rm = remat.rematerialize(model, *args, budget="90%", solver="dp", time_limit=5,
                                 **kwargs)
        assert rm.plan.predicted_peak_bytes <= rm.plan.budget_bytes
        torch.manual_seed(k)  # dropout: the same random stream for both
        out = rm(*args, **kwargs)
        torch.manual_seed(k)
        expected = ref(*args, **kwargs)
        loss = out.loss if hasattr(out, "loss") else out.sum()
        (expected.loss if hasattr(expected, "loss") else expected.sum()).backward()
        loss.backward()
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), k


def test_a_dropped_module_frees_its_compiled_state():
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.Tanh())])
    x = torch.randn(256, 64)
    rm = remat.rematerialize(model, x, budget="90%", time_limit=5)
    rm(x).sum().backward()
    backend = weakref.ref(rm._remat_backend)
    del rm
    gc.collect()
    assert backend() is None


def test_first_call_mutation_does_not_solve_again():
    # Hugging Face classifiers set config.problem_type on their first forward.
    cfg = transformers.RobertaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=96,
                                     max_position_embeddings=80, num_labels=3)
    torch.manual_seed(0)
    model = transformers.RobertaForSequenceClassification(cfg).train()
    ids = torch.randint(3, 96, (4, 24))
    labels = torch.randint(3, (4,))
    assert model.config.problem_type is None
    rm = remat.rematerialize(model, input_ids=ids, labels=labels, budget="70%", time_limit=5)
    for _ in range(2):
        ids = torch.randint(3, 96, (4, 24))
        rm(input_ids=ids, labels=labels).loss.backward()
    assert model.config.problem_type == "single_label_classification"
    assert len(rm.plans) == 1


class ScaledMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[
            nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 32),
                          nn.LayerNorm(32, eps=1e-5)) for _ in range(4)])

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return (self.body(x) * scale).square().mean()


def test_one_capture_per_schedule_and_float_arguments_stay_symbolic():
    """NOTE [ Floats are constants of the capture ]: the model's own floats (GPT-2's dropout
    probabilities and epsilons) do not make dynamo discard its first trace and capture again, and
    a float the call passes is an input of the capture, not recompiled per value."""
    from torch._dynamo.utils import counters

    before = counters["aot_autograd"]["total"]
    example = torch.randint(96, (2, 64))
    remat.rematerialize(tiny_gpt2(), input_ids=example, labels=example, budget="65%",
                        time_limit=TIME_LIMIT, dynamic=True)
    assert counters["aot_autograd"]["total"] - before == 1  # was 2: a restarted analysis

    ref = ScaledMLP().train()
    rm = remat.rematerialize(copy.deepcopy(ref), torch.randn(256, 32), 0.5, budget="70%",
                             time_limit=TIME_LIMIT, dynamic=True)
    captures = counters["aot_autograd"]["total"]
    x = torch.randn(256, 32)
    for k, scale in enumerate((0.5, 0.7, 1.3, 2.0)):
        torch.manual_seed(k)
        expected = torch.autograd.grad(ref(x, scale), list(ref.parameters()))
        torch.manual_seed(k)
        got = torch.autograd.grad(rm(x, scale), list(rm.parameters()))
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert counters["aot_autograd"]["total"] == captures  # one capture serves every scale


# ---- NOTE [ Naming sizes ] ---------------------------------------------------------------------


class _Positional(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None: ...


class _Nested(nn.Module):
    def forward(self, batch: dict) -> None: ...


class _VarArgs(nn.Module):
    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> None: ...


@pytest.mark.parametrize("module, args, kwargs, names", [
    pytest.param(_Positional(), (1, 2), {}, ["x", "mask"], id="positional-by-parameter-name"),
    pytest.param(_Positional(), (), {"mask": 2, "x": 1}, ["mask", "x"], id="keyword"),
    pytest.param(_Nested(), ({"x": 1, "y": [2, 3]},), {}, ["batch['x']", "batch['y'][0]",
                                                           "batch['y'][1]"], id="nested"),
    pytest.param(_VarArgs(), (1, 2, 3), {}, ["x", "arg1", "arg2"], id="varargs-by-position"),
])
def test_each_leaf_of_a_call_is_named_as_the_user_wrote_it(module, args, kwargs, names):
    from remat.calls import flatten_call, leaf_names

    assert leaf_names(module, args, kwargs) == names
    assert len(flatten_call(args, kwargs)[0]) == len(names)  # the leaves' order, one name each


class _DictMLP(nn.Module):
    """Takes its input the way a collate function hands it over: a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(32, 32), nn.Tanh())])

    def forward(self, batch: dict) -> torch.Tensor:
        return self.body(batch["x"]).sum(-1)


def test_summary_and_warnings_name_sizes_by_input_and_axis():
    torch.manual_seed(0)
    rm = remat.rematerialize(_DictMLP(), {"x": torch.randn(64, 16, 32)}, budget="800000B",
                             time_limit=5, dynamic=True)
    rm({"x": torch.randn(32, 16, 32)}).sum().backward()  # fits as it is: runs eagerly
    with pytest.warns(UserWarning) as record:  # cannot fit this budget
        rm({"x": torch.randn(128, 16, 32)}).sum().backward()
    (warning,) = [w for w in record if "no schedule fits" in str(w.message)]
    assert "for sizes batch['x'][0]=128, batch['x'][1]=16 (no schedule can go below" \
        in str(warning.message)
    lines = [line.split(": ")[0] for line in rm.shapes.summary().splitlines()]
    assert lines[0] == "batch['x'][0]=32, batch['x'][1]=16   schedule 2 (unmodified step, run eagerly)"
    assert lines[1] == ("batch['x'][0]=64, batch['x'][1]=16   schedule 1 (solved at "
                        "batch['x'][0]=64, batch['x'][1]=16)")
    # schedule 3 is the least-memory fallback; the solve at its peak polished a faster one (4)
    assert lines[2].startswith("batch['x'][0]=128, batch['x'][1]=16  schedule 4 (solved at "
                               "batch['x'][0]=128, batch['x'][1]=16)"), lines
    assert rm.shapes.summary().endswith("  [over budget]")


def test_graphs_compiled_by_dynamo_name_their_sizes_by_symbol():
    """``remat.backend`` is handed dynamo's graph, not the call: no input names to give."""
    import re

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(32, 32), nn.Tanh())])
    backend = remat.backend(budget="95%", time_limit=5)
    torch.compile(model, backend=backend, dynamic=True)(torch.randn(256, 32)).sum().backward()
    summary = backend.shapes.summary()
    assert re.fullmatch(r"size (s\d+)=256  schedule 1 \(solved at size \1=256\): .* KiB", summary), \
        summary


def test_size_expressions_with_pytorchs_integer_functions_evaluate():
    """A Llama layer's sizes hold ``FloorDiv``: evaluating its bytes at a new batch length raised
    ``NameError: name 'FloorDiv' is not defined`` inside a training step (an FSDP2 run with
    dynamic padding). Every integer function of PyTorch's size expressions evaluates as Python
    computes it."""
    import sympy
    from torch.utils._sympy.functions import CleanDiv, FloorDiv, ModularIndexing, PythonMod

    from remat.sized_graph import size_evaluator

    s0, s1 = sympy.Symbol("s0", integer=True, positive=True), sympy.Symbol("s1", integer=True,
                                                                           positive=True)
    exprs = [4 * FloorDiv(s0, 2) * s1, ModularIndexing(s0, 2, 4), CleanDiv(2 * s1, 2),
             PythonMod(s0 + s1, 3), sympy.Max(s0, s1)]
    evaluate = size_evaluator(["s0", "s1"], exprs)
    for a, b in ((7, 3), (93, 64), (1, 1)):
        assert [int(v) for v in evaluate(a, b)] == \
            [4 * (a // 2) * b, (a // 2) % 4, b, (a + b) % 3, max(a, b)]


def test_static_first_captures_the_example_as_it_is_then_once_with_dynamic_sizes(monkeypatch):
    """NOTE [ Static first ]: ``dynamic=None`` captures the example's static shapes; the first
    call of another shape captures once more with dynamic dimensions, takes the static graph's
    measured op costs (nothing is measured inside that step: NOTE [ Costs carried to the
    dynamic capture ]) and is solved at the example's sizes; later sizes use that family.
    Every step is bitwise eager's and within the budget."""
    import remat.dynamo_backend

    ref = tiny_gpt2()
    example = torch.randint(96, (4, 128), generator=torch.Generator().manual_seed(1))
    rm = remat.rematerialize(copy.deepcopy(ref), input_ids=example, labels=example,
                             budget="62%", time_limit=TIME_LIMIT, cache=False, dynamic=None)
    static = rm.shapes.serving
    assert static.sized.symbols == () and len(rm.shapes.families) == 1
    static_costs = [(op.time, op.workspace) for op in static.sized.graph.ops]

    def no_measuring(*args, **kwargs):
        raise AssertionError("op costs measured again inside a training step")

    monkeypatch.setattr(remat.dynamo_backend, "measure_op_times", no_measuring)
    for k, (batch, length) in enumerate([(4, 128), (2, 200), (4, 96), (3, 160), (4, 128)]):
        ids = torch.randint(96, (batch, length), generator=torch.Generator().manual_seed(k))
        peak = paired_step(ref, rm, ids, seed=k)
        for a, b in zip(ref.parameters(), rm.parameters()):
            assert torch.equal(a.grad, b.grad), (batch, length)
        family = rm.shapes.serving
        assert peak <= rm.shapes.budget_at(family, (batch, length)) + LOSS_SLACK_BYTES \
            if family.sized.symbols else peak <= rm.plan.budget_bytes + LOSS_SLACK_BYTES
    assert len(rm.shapes.families) == 2, rm.shapes.summary()
    dynamic = rm.shapes.serving
    assert len(dynamic.sized.symbols) == 2 and dynamic.sized.sizes == (4, 128)
    # Ops the two graphs share carry the static graph's measured costs, unchanged.
    carried = {(op.time, op.workspace) for op in dynamic.sized.graph.ops}
    assert sum(c in carried for c in static_costs) >= 0.9 * len(static_costs)

    # Graphs that are not the same step carry nothing.
    from dataclasses import replace
    from remat.carry import carry_costs

    graph = static.sized.graph
    shuffled = replace(graph, ops=tuple(reversed(graph.ops)))
    assert carry_costs(graph, shuffled, [0.0] * len(graph.ops)) is None


def test_the_dynamic_capture_reuses_the_static_schedule_and_compiles_what_later_batches_run(
        monkeypatch):
    """NOTE [ The static schedule serves the dynamic graph ]: an MLP's dynamic capture is its
    static graph op for op, so it runs the static schedule without a solve. NOTE [ A capture
    compiles a schedule that needs one ]: the dynamic capture is met by a small batch whose
    unmodified step fits (run eagerly once compiled); it compiles the solved schedule instead,
    which the next, larger batch runs without capturing again. Gradients bitwise, budget kept."""
    import remat.dynamo_backend
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    ref = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())])
    rm = remat.rematerialize(copy.deepcopy(ref), torch.randn(256, 64), budget="80%",
                             time_limit=TIME_LIMIT, cache=False)
    static = rm.shapes.serving
    assert static.sized.symbols == ()

    def no_solving(*args, **kwargs):
        raise AssertionError("the dynamic graph was solved again")

    monkeypatch.setattr(remat.dynamo_backend, "plan_graph", no_solving)
    captures = None
    for k, batch in enumerate((16, 200, 240)):
        x = torch.randn(batch, 64, generator=torch.Generator().manual_seed(k))
        for p in [*ref.parameters(), *rm.parameters()]:
            p.grad = None
        ref(x).square().sum().backward()
        with remat.track_memory() as mem:
            rm(x).square().sum().backward()
        for a, b in zip(ref.parameters(), rm.parameters()):
            assert torch.equal(a.grad, b.grad), batch
        family = rm.shapes.serving
        assert len(family.sized.symbols) == 1
        choice = rm.shapes.choose(family.key, (batch,))
        assert not rm.shapes.entries[choice.entry].eager, (batch, rm.shapes.summary())
        assert mem.peak_bytes <= rm.shapes.budget_at(family, (batch,)) + LOSS_SLACK_BYTES
        if captures is None:
            captures = counters["aot_autograd"]["total"]  # the dynamic capture, at batch 16
    assert counters["aot_autograd"]["total"] == captures, rm.shapes.summary()
    first = rm.shapes.entries[family.entries[0]]
    mine = rm.shapes.entries[static.entries[0]].schedule
    # the same ops in the same order; saved values renumbered (the dynamic graph's size scalar)
    assert (first.schedule.forward, first.schedule.backward) == (mine.forward, mine.backward)
    graph = family.sized.graph
    assert sorted(graph.values[v].name for v in first.schedule.saved) == \
        sorted(static.sized.graph.values[v].name for v in mine.saved)
    assert "the static capture's plan, op for op" in first.plan.detail


def test_dynamic_false_captures_each_new_shape_on_its_own_and_bad_values_are_refused():
    ref = tiny_gpt2()
    example = torch.randint(96, (2, 64), generator=torch.Generator().manual_seed(2))
    rm = remat.rematerialize(copy.deepcopy(ref), input_ids=example, labels=example,
                             budget="62%", time_limit=TIME_LIMIT, cache=False, dynamic=False)
    for k, length in enumerate((64, 80)):
        ids = torch.randint(96, (2, length), generator=torch.Generator().manual_seed(k))
        paired_step(ref, rm, ids, seed=k)
        for a, b in zip(ref.parameters(), rm.parameters()):
            assert torch.equal(a.grad, b.grad), length
    assert [f.sized.symbols for f in rm.shapes.families.values()] == [(), ()]
    with pytest.raises(TypeError, match=r"dynamic='yes'.*expected None .*, True or False"):
        remat.rematerialize(tiny_gpt2(), input_ids=example, labels=example, dynamic="yes")
