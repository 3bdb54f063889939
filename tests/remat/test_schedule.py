"""The simulator and schedule builders on hand-built graphs (no tracing)."""
import pytest

import remat
from remat.liveness import peak_lower_bound
from remat.schedule import (Schedule, on_demand_schedule, remake_views, save_all_schedule, save_storages,
                            simulate, tidy)

from .graphs import chain

A, D = 100, 10  # activation bytes, weight-gradient bytes (see graphs.chain)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_save_all_peak_by_hand(n):
    graph = chain([1.0] * n, act=A, grad=D)
    sim = simulate(graph, save_all_schedule(graph))
    # Forward keeps a1..an; the first backward op adds the tangent, da_{n-1} and dw_n.
    assert sim.forward_peak_bytes == n * A
    assert sim.peak_bytes == (n + 2) * A + D
    assert sim.saved_bytes == (n - 1) * A
    assert sim.recompute_time == 0.0
    assert sim.time == pytest.approx(3.0 * n)


def test_recomputing_trades_time_for_memory():
    graph = chain([1.0, 5.0, 1.0], act=A, grad=D)
    # Keep a2 only: b2 then needs a1 again, recomputed from x right before it.
    schedule = on_demand_schedule(graph, saved={graph.values.index(next(
        v for v in graph.values if v.name == "a2"))})
    sim = simulate(graph, schedule)
    assert sim.recompute_time == pytest.approx(1.0)  # f1 once
    # b3 no longer holds a1 (4A + D); the peak moves to b2: a3 (output), da2, the recomputed
    # a1, da1 and two weight gradients.
    assert sim.peak_bytes == 4 * A + 2 * D
    assert schedule.recompute_count(graph) == 1


def test_a_recomputation_costs_the_ops_rerun_time():
    # NOTE [ What a recomputation costs ] (remat/costs.py): the unmodified step's ops cost
    # their time, a recomputed op its ``rerun_time``.
    import dataclasses

    graph = chain([1.0, 5.0, 1.0], act=A, grad=D)
    ops = list(graph.ops)
    ops[0] = dataclasses.replace(ops[0], rerun_time=0.25)
    graph = dataclasses.replace(graph, ops=tuple(ops))
    a2 = next(i for i, v in enumerate(graph.values) if v.name == "a2")
    sim = simulate(graph, on_demand_schedule(graph, saved={a2}))
    assert sim.recompute_time == pytest.approx(0.25)
    assert sim.time == pytest.approx(graph.baseline_time + 0.25)
    assert simulate(graph, save_all_schedule(graph)).time == pytest.approx(graph.baseline_time)


def test_missing_value_is_rejected_with_its_name():
    graph = chain([1.0, 1.0, 1.0])
    everything = save_all_schedule(graph)
    broken = Schedule(everything.forward, frozenset(), everything.backward)
    with pytest.raises(remat.ScheduleError, match="reads 'a2'"):
        simulate(graph, broken)


def test_backward_op_twice_or_missing_is_rejected():
    graph = chain([1.0, 1.0])
    s = save_all_schedule(graph)
    with pytest.raises(remat.ScheduleError, match="twice"):
        simulate(graph, Schedule(s.forward, s.saved, s.backward + s.backward[-1:]))
    with pytest.raises(remat.ScheduleError, match="missing"):
        simulate(graph, Schedule(s.forward, s.saved, s.backward[:-1]))


def test_random_ops_are_never_recomputed():
    import dataclasses

    graph = chain([1.0, 1.0, 1.0])
    ops = list(graph.ops)
    ops[0] = dataclasses.replace(ops[0], recomputable=False)
    graph = dataclasses.replace(graph, ops=tuple(ops))
    bad = Schedule((0, 1, 2), frozenset(), (0, *graph.backward_ops))
    with pytest.raises(remat.ScheduleError, match="may not be recomputed"):
        simulate(graph, bad)
    # The builders keep a random op's outputs instead of recomputing it.
    schedule = on_demand_schedule(graph, saved=frozenset())
    assert graph.values.index(next(v for v in graph.values if v.name == "a1")) in schedule.saved
    simulate(graph, schedule)


def test_a_saved_view_keeps_its_whole_base_alive():
    graph = chain([1.0] * 4, act=A, grad=D, view_every=1)
    sim = simulate(graph, save_all_schedule(graph))
    # Views cost nothing of their own, and the storages are the same as without views.
    assert sim.peak_bytes == simulate(chain([1.0] * 4, act=A, grad=D),
                                      save_all_schedule(chain([1.0] * 4, act=A, grad=D))).peak_bytes
    # Saving nothing but views still remakes them from bases that must be recomputed.
    schedule = tidy(graph, remake_views(graph, on_demand_schedule(graph, saved=frozenset())))
    assert simulate(graph, schedule).recompute_time > 0


def test_backward_gets_the_storages_and_remakes_the_views():
    """NOTE [ Save storages, not views ]: a saved view is replaced by its base, the same
    storage, and remade in backward: same peak, no view handed over, nothing else recomputed."""
    graph = chain([1.0] * 4, act=A, grad=D, view_every=1)
    everything = save_all_schedule(graph)
    views = {v for v in everything.saved if graph.values[v].alias_of is not None}
    assert views, "the unmodified step of this chain saves views"
    storages = save_storages(graph, everything)
    assert not any(graph.values[v].alias_of is not None for v in storages.saved)
    assert {graph.values[v].alias_of for v in views} <= storages.saved
    sim, unmodified = simulate(graph, storages), simulate(graph, everything)
    assert (sim.peak_bytes, sim.saved_bytes) == (unmodified.peak_bytes, unmodified.saved_bytes)
    # What backward runs again is exactly the views it reads, each right before its reader.
    remade = [i for i in storages.backward if i < graph.num_forward]
    assert sorted(v for i in remade for v in graph.ops[i].outputs) == sorted(views)
    assert [i for i in storages.backward if i >= graph.num_forward] == list(graph.backward_ops)
    # A schedule that saves no view is returned as it is.
    assert save_storages(graph, storages) is storages
    plain = chain([1.0] * 4, act=A, grad=D)
    assert save_storages(plain, save_all_schedule(plain)) == save_all_schedule(plain)


def test_lower_bound_is_below_every_schedule():
    graph = chain([1.0] * 6, act=A, grad=D)
    bound = peak_lower_bound(graph)
    for saved in (frozenset(), save_all_schedule(graph).saved):
        assert bound <= simulate(graph, on_demand_schedule(graph, saved)).peak_bytes
    # At b2: a6 (kept by the caller), da2 in, da1 out, dw6..dw2, and b2 reads a1.
    assert bound == 4 * A + 5 * D


def test_flat_tables_follow_the_graph_they_were_made_from():
    """The simulator reads ``graph.flat`` (cached per graph): a graph with new times or flags
    is another graph, with tables of its own."""
    import dataclasses

    graph = chain([1.0] * 3, act=A, grad=D, view_every=1)
    everything = save_all_schedule(graph)
    assert simulate(graph, everything).time == pytest.approx(9.0)
    slower = graph.with_times([2.0] * len(graph.ops))
    assert simulate(slower, everything).time == pytest.approx(18.0)
    assert simulate(graph, everything).time == pytest.approx(9.0)
    ops = list(graph.ops)
    ops[0] = dataclasses.replace(ops[0], recomputable=False)
    fixed = dataclasses.replace(graph, ops=tuple(ops))
    recompute_first = Schedule(everything.forward, everything.saved, (0, *graph.backward_ops))
    with pytest.raises(remat.ScheduleError, match="may not be recomputed"):
        simulate(fixed, recompute_first)
    # Views made in forward, by base: each activation's view (and nothing made in backward).
    for v, value in enumerate(graph.values):
        views = graph.flat.forward_views[v]
        assert all(graph.values[w].alias_of == v and graph.values[w].producer < graph.num_forward
                   for w in views)
    assert sum(map(len, graph.flat.forward_views)) == sum(
        1 for value in graph.values if value.alias_of is not None and value.producer < graph.num_forward)
