"""rematerialize on real models: exact outputs and gradients, budgets respected, state shared.

Every model here saves several same-shape tensors for backward, so a mix-up in the order of
saved tensors (they are matched to backward inputs by position only) would show up as wrong
gradients.
"""
from __future__ import annotations

import pytest
import torch

import remat
import remat.liveness
from remat.schedule import save_all_schedule, simulate
from remat.solvers import Problem, get_solver

from .models import MODELS, leaves, make, scalar_of

# The simulator must predict the measured peak within this relative error (issue contract).
PREDICTION_TOLERANCE = 0.05
# The test's own scalar loss and its gradient, allocated outside the module's step.
LOSS_SLACK_BYTES = 64
# Seconds the solver may take per capture in tests (small graphs solve much faster).
TIME_LIMIT = 20.0
SEARCH_TIME_LIMIT = 5.0  # per solve while searching for the lowest feasible budget


def step(module, args, seed: int = 123):
    """One training step (forward, scalar, backward) under a fixed RNG seed."""
    torch.manual_seed(seed)
    out = module(*args)
    scalar_of(out).backward()
    return out


def grads(module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.parameters()]


def lowest_feasible_fraction(graph, solver: str = remat.DEFAULT_SOLVER) -> float:
    """Smallest budget fraction (within 3%) at which ``solver`` finds a schedule."""
    base = simulate(graph, save_all_schedule(graph)).peak_bytes
    lo, hi = remat.liveness.peak_lower_bound(graph) / base, 1.0
    while hi - lo > 0.03:
        mid = (lo + hi) / 2
        result = get_solver(solver).solve(
            Problem(graph, int(mid * base), time_limit=SEARCH_TIME_LIMIT, options={"progress": False}))
        if result.status == "infeasible":
            lo = mid
        else:
            hi = mid
    return hi


def check_exact_and_within_budget(name: str, budget) -> remat.Plan:
    ref, args = make(name)
    model, _ = make(name)
    rm = remat.rematerialize(model, *args, budget=budget, time_limit=TIME_LIMIT)
    for net in (ref, rm):  # warm-up step (scalar_of caches its weights outside the measurement)
        step(net, args, seed=7)
    for p in [*ref.parameters(), *model.parameters()]:
        p.grad = None
    ref_out = step(ref, args)
    with remat.track_memory() as mem:
        out = step(rm, args)
    for a, b in zip(leaves(ref_out), leaves(out)):
        assert torch.equal(a, b)
    for a, b in zip(grads(ref), grads(model)):
        assert torch.equal(a, b)
    for a, b in zip(ref.buffers(), model.buffers()):  # BatchNorm statistics updated exactly once
        assert torch.equal(a, b)
    plan = rm.plan
    assert mem.peak_bytes <= plan.budget_bytes + LOSS_SLACK_BYTES
    assert abs(mem.peak_bytes / plan.predicted_peak_bytes - 1) <= PREDICTION_TOLERANCE
    return plan


@pytest.mark.parametrize("name", MODELS)
def test_exact_at_full_half_and_lowest_budget(name):
    # Budgets in bytes of the captured graph's own unmodified peak, so that the lowest found on
    # the graph is the one asked for (a percentage is of the eager step: test_eager_budget.py).
    model, args = make(name)
    graph = remat.rematerialize(model, *args, budget="1TiB", solver="none").graphs[0]
    base = simulate(graph, save_all_schedule(graph)).peak_bytes
    torch._dynamo.reset()
    plan_full = check_exact_and_within_budget(name, f"{base}B")
    assert plan_full.predicted_overhead == 0.0
    lowest = lowest_feasible_fraction(graph)
    assert lowest < 0.9  # remat can save memory on every one of these models
    for fraction in sorted({max(0.5, lowest), lowest}):
        torch._dynamo.reset()
        plan = check_exact_and_within_budget(name, f"{int(fraction * base)}B")
        assert plan.predicted_peak_bytes < plan_full.predicted_peak_bytes


def test_a_step_runs_its_ops_without_a_python_frame_each():
    """NOTE [ Ops called without a Python frame ]: the generated graphs call each op's C++ entry
    point, not ``OpOverload.__call__``. A Python frame per op made CPython 3.11 map and unmap a
    16 KiB frame chunk per op call wherever the graph's frame ended near a chunk's end: a
    12-layer GPT's step took 32% longer, or not, depending on the caller's stack depth."""
    import copy
    import sys

    model, args = make("gpt_manual")
    ref = copy.deepcopy(model)
    rm = remat.rematerialize(model, *args, budget="50%", time_limit=TIME_LIMIT)
    assert rm.plan.predicted_overhead > 0  # a schedule that recomputes
    step(rm, args, seed=7)  # warm-up: compiles
    for p in [*ref.parameters(), *model.parameters()]:
        p.grad = None
    step(ref, args)
    op_call = torch._ops.OpOverload.__call__.__code__
    calls = []

    def count(frame, event, arg):
        if event == "call" and frame.f_code is op_call:
            calls.append(frame.f_back.f_code.co_name)

    sys.setprofile(count)
    try:
        step(rm, args)
    finally:
        sys.setprofile(None)
    assert calls == []
    for a, b in zip(grads(ref), grads(model)):
        assert torch.equal(a, b)


def test_state_dict_keys_and_parameters_are_shared():
    model, args = make("gpt_manual")
    keys = list(model.state_dict().keys())
    rm = remat.rematerialize(model, *args, budget="60%", time_limit=TIME_LIMIT)
    assert list(rm.state_dict().keys()) == keys
    assert all(a is b for a, b in zip(rm.parameters(), model.parameters()))
    assert all(a is b for a, b in zip(rm.buffers(), model.buffers()))
    # A checkpoint of either loads into the other.
    fresh, _ = make("gpt_manual")
    fresh.load_state_dict(rm.state_dict())
    rm.load_state_dict(fresh.state_dict())


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_optimizer_created_before_swap_keeps_training(opt):
    def optimizer(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9) if opt == "sgd" else \
            torch.optim.Adam(params, lr=1e-2)

    ref, args = make("gpt_manual")
    model, _ = make("gpt_manual")
    opt_ref, opt_model = optimizer(ref.parameters()), optimizer(model.parameters())
    rm = remat.rematerialize(model, *args, budget="60%", time_limit=TIME_LIMIT)
    losses_ref, losses = [], []
    for k in range(4):
        for net, o, record in ((ref, opt_ref, losses_ref), (rm, opt_model, losses)):
            o.zero_grad()
            torch.manual_seed(k)
            loss = net(*args)
            loss.backward()
            o.step()
            record.append(loss.item())
    assert losses == losses_ref  # bitwise equal curves
    assert losses[-1] < losses[0]


def test_eval_and_no_grad_calls_run_the_original():
    model, args = make("cnn_bn")
    rm = remat.rematerialize(model, *args, budget="70%", time_limit=TIME_LIMIT)
    rm.eval()
    assert not model.training and not any(m.training for m in model.modules())
    with torch.no_grad():
        assert torch.equal(rm(*args), model(*args))
    assert len(rm.plans) == 1  # no new capture for a call without backward


def test_a_smaller_batch_reuses_the_plan_within_budget(monkeypatch):
    import remat.dynamo_backend

    ref, _ = make("mlp")
    model, _ = make("mlp")
    batch = torch.randn(512, 32)
    rm = remat.rematerialize(model, batch, budget="70%", time_limit=TIME_LIMIT)

    def no_solving(*args, **kwargs):
        raise AssertionError("solved again")

    monkeypatch.setattr(remat.dynamo_backend, "plan_graph", no_solving)
    short = (batch[:300],)
    step(ref, short)
    with remat.track_memory() as mem:
        step(rm, short)
    # Another size: captured once more with dynamic sizes (NOTE [ Static first ]), which runs
    # the example's schedule op for op, re-priced at this size, with no solve.
    assert len(rm.plans) == 2 and "the static capture's plan" in rm.plans[1].detail
    assert mem.peak_bytes <= rm.plan.budget_bytes + LOSS_SLACK_BYTES
    for a, b in zip(grads(ref), grads(model)):
        assert torch.equal(a, b)


def test_backend_with_a_graph_break():
    class TwoGraphs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 96),
                                         torch.nn.SiLU(), torch.nn.Linear(96, 96))
            self.b = torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(96, 96), torch.nn.Tanh(),
                                         torch.nn.Linear(96, 96), torch.nn.GELU(), torch.nn.Linear(96, 8))

        def forward(self, x):
            h = self.a(x)
            torch._dynamo.graph_break()
            return self.b(h)

    torch.manual_seed(0)
    ref = TwoGraphs()
    model = TwoGraphs()
    model.load_state_dict(ref.state_dict())
    backend = remat.backend(budget="80%", time_limit=TIME_LIMIT)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(512, 32)
    step(ref, (x,))
    step(compiled, (x,))
    assert len(backend.plans) == 2
    assert all(p.predicted_peak_bytes <= p.budget_bytes for p in backend.plans)
    for a, b in zip(grads(ref), grads(model)):
        assert torch.equal(a, b)


def test_estimate_reports_memory_without_changing_state():
    model, args = make("cnn_bn")
    before = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    report = remat.estimate(model, *args)
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))
    assert torch.equal(rng, torch.get_rng_state())
    params = sum(p.numel() * 4 for p in model.parameters())
    assert report.gradient_bytes == params
    assert 0 < report.lowest_peak_bytes < report.activation_peak_bytes
    assert 0 < report.eager_peak_bytes and "eager step peak (measured)" in report.summary()


def test_plan_cache_skips_solving_and_survives_a_restart(tmp_path):
    model, args = make("gpt_manual")
    first = remat.rematerialize(model, *args, budget="60%", cache=str(tmp_path), time_limit=TIME_LIMIT)
    assert not first.plan.cache_hit and len(list(tmp_path.glob("*.json"))) == 1
    first_peak = first.plan.predicted_peak_bytes
    # The same example tensors again: NOTE [ The user's tensors leave as they came ].
    assert not any(hasattr(a, "_dynamo_propagated_dynamic_indices") for a in args)
    torch._dynamo.reset()
    ref, _ = make("gpt_manual")
    again, _ = make("gpt_manual")
    cache = remat.PlanCache(tmp_path)  # a new process would start like this
    second = remat.rematerialize(again, *args, budget="60%", cache=cache, time_limit=TIME_LIMIT)
    assert second.plan.cache_hit and second.plan.solve_time_s == 0.0
    assert second.plan.predicted_peak_bytes == first_peak
    step(ref, args)
    step(second, args)
    for a, b in zip(grads(ref), grads(again)):
        assert torch.equal(a, b)
    # Another budget is another key: solved, not served from the cache.
    torch._dynamo.reset()
    third, _ = make("gpt_manual")
    other = remat.rematerialize(third, *args, budget="80%", cache=cache, time_limit=TIME_LIMIT)
    assert not other.plan.cache_hit
    state = cache.state_dict()
    restored = remat.PlanCache()
    restored.load_state_dict(state)
    assert len(restored) == 2


def test_few_bit_activations_are_saved_as_codes_and_stay_exact():
    """Composition with quant.fewbit: the graph saves the packed codes (not the float input),
    so the solver sees the smaller size, and remat stays exact relative to the few-bit model."""
    from quant.fewbit import FewBitGELU

    def build(act):
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), act(),
                                                         torch.nn.Linear(256, 64)) for _ in range(6)])

    x = torch.randn(256, 64)
    saved = {}
    for name, act in (("exact", torch.nn.GELU), ("fewbit", lambda: FewBitGELU(bits=2))):
        torch._dynamo.reset()
        graph = remat.rematerialize(build(act), x, budget="1TiB", solver="none").graphs[0]
        saved[name] = simulate(graph, save_all_schedule(graph)).saved_bytes
    # Each GELU input (256 x 256 fp32) is replaced by 2-bit codes: 16 KiB instead of 256 KiB.
    assert saved["exact"] - saved["fewbit"] == 6 * (256 * 256 * 4 - 256 * 256 // 4)
    torch._dynamo.reset()
    ref = build(lambda: FewBitGELU(bits=2))
    model = build(lambda: FewBitGELU(bits=2))
    graph = remat.rematerialize(build(lambda: FewBitGELU(bits=2)), x, budget="1TiB",
                                solver="none").graphs[0]
    base = simulate(graph, save_all_schedule(graph)).peak_bytes
    torch._dynamo.reset()
    # below the eager step too (a budget the eager step fits would run it as it is)
    eager = remat.measure_eager_step(build(lambda: FewBitGELU(bits=2)), x)
    rm = remat.rematerialize(model, x, budget=f"{int(0.92 * min(base, eager))}B",
                             time_limit=TIME_LIMIT)
    assert rm.plan.num_recomputed > 0
    step(ref, (x,))
    step(rm, (x,))
    for a, b in zip(grads(ref), grads(model)):
        assert torch.equal(a, b)


def test_training_flag_set_directly_reaches_the_original():
    """Lightning assigns ``.training`` on registered submodules after validation."""
    model, args = make("dropout")
    rm = remat.rematerialize(model, *args, budget="80%", time_limit=TIME_LIMIT)
    for m in rm.modules():
        m.training = False
    with torch.no_grad():
        out = rm(*args)
    assert not model.training
    assert torch.equal(out, model(*args))  # dropout off in both


def test_attributes_of_the_original_read_through():
    model, args = make("gpt_manual")
    rm = remat.rematerialize(model, *args, budget="80%", time_limit=TIME_LIMIT)
    assert rm.cfg is model.cfg


def test_later_shapes_keep_the_byte_budget_and_never_fail():
    ref, _ = make("mlp")
    model, _ = make("mlp")
    batch = torch.randn(512, 32)
    probe = remat.rematerialize(make("mlp")[0], batch, budget="75%", time_limit=TIME_LIMIT)
    budget = f"{probe.plan.budget_bytes}B"
    rm = remat.rematerialize(model, batch, budget=budget, time_limit=TIME_LIMIT)
    step(rm, (batch[:64],))  # a short last batch fits the same bytes
    family = rm.shapes.serving.key  # captured with dynamic sizes by that call
    assert rm.shapes.choose(family, (64,)).fits
    big = torch.randn(4096, 32)  # eight times the activations cannot fit: warn, run, stay exact
    for p in model.parameters():
        p.grad = None
    with pytest.warns(UserWarning, match=r"no schedule fits .* for sizes x\[0\]=4096 "):
        step(rm, (big,))
    assert not rm.shapes.choose(family, (4096,)).fits
    step(ref, (big,))
    for a, b in zip(grads(ref), grads(model)):
        assert torch.equal(a, b)


def test_a_schedule_in_use_is_kept_unless_another_is_clearly_faster(monkeypatch):
    """NOTE [ A schedule in use is worth a little time ]: each schedule a run uses is one more
    compile of the step, so a batch stays on one in use unless another fits and is predicted
    more than 1% faster."""
    from dataclasses import replace

    model, (batch,) = make("mlp")
    # one family for every size from the start: the schedules of that family are compared
    rm = remat.rematerialize(model, batch, budget="75%", time_limit=TIME_LIMIT, dynamic=True)
    shapes = rm.shapes
    family = next(iter(shapes.families.values()))
    solved = family.entries[0]
    assert (family.key, tuple(batch.shape[:1])) in shapes.choices  # the example runs `solved`
    schedule, plan = shapes.entries[solved].schedule, shapes.entries[solved].plan
    # Two more schedules that fit wherever `solved` does (the same one), predicted faster.
    near = shapes._add(family, schedule, plan, "0.5% faster")
    far = shapes._add(family, schedule, plan, "5% faster")
    speed = {near: 0.995, far: 0.95}
    price = shapes.run_price

    def priced(fam, entry, sizes):
        sim = price(fam, entry, sizes)
        if entry == family.entries[1]:  # the unmodified step, kept out of the way
            return replace(sim, peak_bytes=10 * sim.peak_bytes)
        return replace(sim, time=sim.time * speed.get(entry, 1.0))

    monkeypatch.setattr(shapes, "run_price", priced)
    small = batch.shape[0] // 2
    assert shapes.choose(family.key, (small,)).entry == far
    speed[far] = 0.999  # `near` is faster still, by less than the margin
    assert shapes.choose(family.key, (small - 1,)).entry == far  # in use since (small,)
    speed[far] = 1.02
    assert shapes.choose(family.key, (small - 2,)).entry == solved
    speed[near] = 0.9
    assert shapes.choose(family.key, (small - 3,)).entry == near


@pytest.fixture(scope="module")
def traced_mlp_graph():
    model, batch = make("mlp")
    return remat.rematerialize(model, *batch, budget="1TiB", solver="none").graphs[0]


@pytest.mark.parametrize("fraction", [0.7, 0.5, 0.3])
def test_hierarchical_within_3_percent_of_the_ilp_on_a_traced_model(traced_mlp_graph, fraction):
    """On measured op times, at budgets 70/50/30% of the way from the lowest possible peak to
    the baseline. The hierarchy's own schedule (without the exact top-level ILP it also tries
    on small graphs) is held to the same gap where it finds one: at 30% it does not on this
    MLP (its block options are too coarse there; issue 3's note has the figures)."""
    graph = traced_mlp_graph
    low = remat.liveness.peak_lower_bound(graph)
    budget = int(low + fraction * (simulate(graph, save_all_schedule(graph)).peak_bytes - low))
    ilp = get_solver("ilp").solve(Problem(graph, budget, time_limit=60))
    assert ilp.status == "optimal"
    variants = [{}] if fraction < 0.5 else [{}, {"exact_top": False}]
    times = []
    for options in variants:
        hier = get_solver("hierarchical").solve(Problem(
            graph, budget, time_limit=60, options={"progress": False, **options}))
        assert hier.simulation.peak_bytes <= budget, options
        assert hier.simulation.time <= 1.03 * ilp.simulation.time, options
        times.append(hier.simulation.time)
    # The default is never slower than the hierarchy alone (issue 14: it was, +36.4% vs +29.6%
    # on this MLP at 30% of the baseline: NOTE [ The exact ILP beside the hierarchy ]).
    assert times[0] <= min(times)


def test_a_solver_that_finds_nothing_falls_back_to_the_faster_rescue_schedule():
    """When the solver gives up (HF GPT-2 at 50% in its time limit: least-memory +990% step
    time), block checkpointing is tried next to the least-memory schedule, and the faster one
    that fits runs; gradients stay exact."""
    from remat.planner import _block_checkpointing, least_memory_schedule

    ref, args = make("gpt_manual")
    model, _ = make("gpt_manual")
    rm = remat.rematerialize(model, *args, budget="60%", solver="none")
    plan = rm.plan
    assert "fallback: the solver found none" in plan.detail
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    graph = rm.graphs[0]
    rescue = [least_memory_schedule(graph)[1],
              *(sim for _, sim, _ in _block_checkpointing(graph, "none"))]
    fitting = [sim.time for sim in rescue if sim.peak_bytes <= plan.budget_bytes]
    assert plan.baseline_time_s * (1 + plan.predicted_overhead) == pytest.approx(min(fitting))
    step(ref, args, seed=3)
    step(rm, args, seed=3)
    for a, b in zip(grads(ref), grads(model)):
        assert torch.equal(a, b)


def test_a_crawling_rescue_is_named_with_the_faster_budget():
    """Issue 14: on a Mamba-style scan at 50% only the least-memory schedule fit (105x the step
    time) and ran silently; per-block checkpointing needed 5% more memory at 1.7x."""
    from remat.budget import format_bytes
    from remat.planner import _block_checkpointing, least_memory_schedule

    model, args = make("gpt_manual")
    graph = remat.rematerialize(model, *args, budget="1TiB", solver="none").graphs[0]
    lowest = least_memory_schedule(graph)[1]
    (_, blocks, _), = _block_checkpointing(graph, "none")
    assert lowest.peak_bytes < blocks.peak_bytes and lowest.time > 2 * graph.baseline_time
    budget = (lowest.peak_bytes + blocks.peak_bytes) // 2  # only the least-memory one fits
    with pytest.warns(UserWarning, match=r"only the least-memory schedule fits") as caught:
        rm = remat.rematerialize(model, *args, budget=f"{budget}B", solver="none")
    assert rm.plan.detail.endswith("least-memory fallback: the solver found none")
    text = str(caught[0].message)  # (op times are measured again by the second call)
    assert f"{1 + rm.plan.predicted_overhead:.1f}x the unmodified step's time" in text
    assert f"block checkpointing needs {format_bytes(blocks.peak_bytes)} at 1." in text


def test_nothing_fits_runs_the_lowest_peak_of_every_schedule_offered():
    """NOTE [ Nothing fits: the lowest peak ]: over budget, a later size family ran the
    solver's lowest or the unmodified step, whichever peaked lower, never the rescues it had
    just been offered (HF Mamba at a longer sequence: 9.86 MiB where ~3.8 MiB existed), under
    a warning calling it the lowest-peak schedule found and giving no time."""
    from remat.budget import Budget, format_bytes
    from remat.planner import _block_checkpointing, least_memory_schedule, plan_graph

    model, args = make("gpt_manual")
    graph = remat.rematerialize(model, *args, budget="1TiB", solver="none").graphs[0]
    lowest = least_memory_schedule(graph)[1]
    (_, blocks, _), = _block_checkpointing(graph, "none")  # what solver="checkpoint" finds
    assert lowest.peak_bytes < blocks.peak_bytes
    budget = remat.liveness.peak_lower_bound(graph) - 1  # nothing can fit
    with pytest.warns(UserWarning, match="running the lowest-peak schedule found") as caught:
        plan, schedule = plan_graph(graph, Budget(bytes=budget, text=f"{budget}B"),
                                    solver="checkpoint", time_limit=TIME_LIMIT,
                                    over_budget="lowest")
    assert plan.status == "over_budget"
    assert plan.predicted_peak_bytes == lowest.peak_bytes < plan.baseline_bytes
    assert simulate(graph, schedule).peak_bytes == lowest.peak_bytes
    slower = lowest.time / graph.baseline_time
    text = str(caught[0].message)
    assert f"{format_bytes(lowest.peak_bytes)}, predicted at {slower:.1f}x" in text


def test_nothing_fits_the_solver_is_asked_for_the_crawling_rescues_peak():
    """NOTE [ The fastest at the lowest peak ]: the least-memory schedule, the lowest peak of a
    BatchNorm convnet under an impossible budget, takes ~4x the step's time; the hierarchy,
    asked for that peak, reaches it at a fraction of that."""
    from remat.budget import Budget
    from remat.planner import least_memory_schedule, plan_graph

    model, args = make("cnn_bn")
    graph = remat.rematerialize(model, *args, budget="1TiB", solver="none").graphs[0]
    crawling = least_memory_schedule(graph)[1]
    assert crawling.time > 2 * graph.baseline_time
    budget = remat.liveness.peak_lower_bound(graph) - 1
    with pytest.warns(UserWarning, match=r"predicted at 1\.\dx the unmodified step's time"):
        plan, schedule = plan_graph(graph, Budget(bytes=budget, text=f"{budget}B"),
                                    solver="hierarchical", time_limit=TIME_LIMIT,
                                    over_budget="lowest")
    assert plan.detail.endswith("least-memory schedule, the lowest peak; solver "
                                "'hierarchical' at that peak: faster")
    sim = simulate(graph, schedule)
    assert sim.peak_bytes <= crawling.peak_bytes and sim.time < 2 * graph.baseline_time
    assert plan.predicted_peak_bytes == sim.peak_bytes


class _Scan(torch.nn.Module):
    """A recurrence over time whose steps read slices and ``unsqueeze`` s: many small views."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 8, 4)
        for i in range(x.shape[1]):
            h = torch.tanh(h * self.lin(x[:, i]).unsqueeze(-1) + x[:, i].unsqueeze(-1))
        return h.sum()


def _handed_to_backward(loss: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors the compiled step's forward saved for its backward."""
    todo, seen = [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            return tuple(node.saved_tensors) + tuple(getattr(node, "_tensors_no_vc_check", ()))
        todo.extend(f for f, _ in node.next_functions)
    raise AssertionError("no compiled step in the autograd graph")


@pytest.mark.parametrize("budget", ["none", 0.5])
def test_backward_is_handed_storages_not_views(budget):
    """NOTE [ Save storages, not views ]: each storage reaches backward once, as one tensor
    (the input ``x`` itself, not its six slices), and the gradients are eager's."""
    torch.manual_seed(0)
    model, x = _Scan(), torch.randn(3, 6, 8)
    step(model, (x,))
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    # "none": the captured step saving everything (a budget the eager step fits runs eagerly)
    rm = remat.rematerialize(model, x, budget="100%" if budget == "none" else budget,
                             solver="none" if budget == "none" else remat.DEFAULT_SOLVER,
                             options={"progress": False})
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    loss = rm(x)
    handed = _handed_to_backward(loss)
    loss.backward()
    for got, want in zip(grads(model), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    storages = [t.untyped_storage().data_ptr() for t in handed]
    assert len(set(storages)) == len(storages), "two saved tensors share a storage"
    assert x.untyped_storage().data_ptr() in storages


def test_a_new_shape_met_under_checkpoint_is_recomputed_by_the_graph_that_ran_it():
    """NOTE [ A call runs what its first call ran ]: a smaller batch, met first inside
    ``torch.utils.checkpoint`` (as FSDP2 units that keep only their inputs run), is captured in
    forward and runs the compiled step; its recomputation in backward must run that same step,
    not the eager one whose saved tensors differ (a CheckpointError killed a rank when the
    capture compiled the unmodified step: now it compiles the solved schedule, NOTE [ A capture
    compiles a schedule that needs one ], and later calls of those shapes run it too)."""
    from torch.utils.checkpoint import checkpoint

    ref, _ = make("mlp")
    model, _ = make("mlp")
    batch = torch.randn(512, 32)
    # static shapes first (NOTE [ Static first ]): the shorter batch is captured in its forward
    rm = remat.rematerialize(model, batch, budget="70%", time_limit=TIME_LIMIT, dynamic=None)
    short = batch[:64]
    for _ in range(2):  # the capturing call, then a call of the same shapes
        for p in [*ref.parameters(), *model.parameters()]:
            p.grad = None
        scalar_of(checkpoint(rm, short, use_reentrant=False)).backward()
        scalar_of(ref(short)).backward()
        for a, b in zip(grads(ref), grads(model)):
            assert torch.equal(a, b)
    family = rm.shapes.serving
    entry = rm.shapes.choose(family.key, (64,)).entry
    assert not rm.shapes.entries[entry].eager and entry in rm._remat_slots
