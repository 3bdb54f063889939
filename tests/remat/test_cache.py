"""PlanCache faults: nothing in a cache file is trusted, and a bad cache never stops a run."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import remat

REPO = Path(__file__).resolve().parents[2]


def mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (nn.Linear(32, 32), nn.Tanh())]
    return nn.Sequential(*layers, nn.Linear(32, 4)), torch.randn(256, 32)


def solve(budget, cache) -> remat.RematModule:
    model, x = mlp()
    return remat.rematerialize(model, x, budget=budget, solver="dp", time_limit=5, cache=cache)


def only_file(directory: Path) -> Path:
    files = list(directory.glob("*.json"))
    assert len(files) == 1
    return files[0]


def test_an_entry_solved_for_another_budget_is_refused(tmp_path):
    loose, tight = tmp_path / "loose", tmp_path / "tight"
    solve("90%", str(loose))
    first = solve("60%", str(tight))
    # Someone copies the 90% plan over the 60% one (or edits its budget): it must not be used.
    only_file(tight).write_text(only_file(loose).read_text())
    with pytest.warns(UserWarning, match="over the budget"):
        again = solve("60%", remat.PlanCache(tight))
    assert not again.plan.cache_hit
    assert again.plan.predicted_peak_bytes <= again.plan.budget_bytes == first.plan.budget_bytes


def test_edited_numbers_are_recomputed_not_trusted(tmp_path):
    first = solve("60%", str(tmp_path))
    path = only_file(tmp_path)
    entry = json.loads(path.read_text())
    entry["plan"].update(predicted_peak_bytes=1, baseline_bytes=2, num_recomputed=-5)
    path.write_text(json.dumps(entry))
    again = solve("60%", remat.PlanCache(tmp_path))
    assert again.plan.cache_hit
    assert again.plan.predicted_peak_bytes == first.plan.predicted_peak_bytes
    assert again.plan.baseline_bytes == first.plan.baseline_bytes
    assert again.plan.num_recomputed == first.plan.num_recomputed


@pytest.mark.parametrize("content", ["[]", '{"version": 1, "forward": "x"}', "{not json"],
                         ids=["list", "wrong-fields", "not-json"])
def test_a_malformed_file_is_ignored_with_a_warning(tmp_path, content):
    first = solve("60%", str(tmp_path))
    only_file(tmp_path).write_text(content)
    with pytest.warns(UserWarning, match="ignoring"):
        again = solve("60%", remat.PlanCache(tmp_path))
    assert not again.plan.cache_hit
    assert again.plan.predicted_peak_bytes == first.plan.predicted_peak_bytes


def test_a_directory_that_cannot_be_made_warns_and_the_run_goes_on(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="cannot write the plan cache"):
        rm = solve("60%", str(blocker / "cache"))
    assert rm.plan.predicted_peak_bytes <= rm.plan.budget_bytes


def test_a_failing_write_warns_and_the_run_goes_on(tmp_path, monkeypatch):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    with pytest.warns(UserWarning, match="cannot write the plan cache"):
        rm = solve("60%", str(tmp_path))
    assert rm.plan.predicted_peak_bytes <= rm.plan.budget_bytes
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # no half-written file


WRITER = textwrap.dedent("""
    import sys
    from remat import PlanCache, Plan
    from remat.schedule import Schedule
    cache = PlanCache(sys.argv[1])
    tag = int(sys.argv[2])
    for k in range(300):
        plan = Plan(baseline_bytes=k, budget_bytes=k, predicted_peak_bytes=k,
                    predicted_overhead=0.0, solver="dp", status="optimal", solve_time_s=0.0)
        cache.put("k" * 32, Schedule((tag, k), frozenset({k}), (k,)), plan)
""")


def test_two_processes_writing_one_key_never_collide(tmp_path):
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(tag)],
                                cwd=REPO, stderr=subprocess.PIPE, text=True) for tag in (1, 2)]
    reads = 0
    while any(w.poll() is None for w in writers):
        path = tmp_path / ("k" * 32 + ".json")
        if path.exists():
            entry = json.loads(path.read_text())  # never empty, never half a file
            assert entry["forward"][0] in (1, 2)
            reads += 1
    for w in writers:
        assert w.wait() == 0, w.stderr.read()
    assert list(tmp_path.glob("*.tmp")) == []
    assert remat.PlanCache(tmp_path).get("k" * 32) is not None


# NOTE [ The same plan every run ]: a tanh MLP through the README's call, with the default cache.
_RUN = textwrap.dedent("""
    import torch, torch.nn as nn, remat
    torch.manual_seed(0)
    layers = [m for k in range(12) for m in (nn.Linear(64 if k == 0 else 256, 256), nn.Tanh())]
    net = nn.Sequential(*layers, nn.Linear(256, 8))
    rm = remat.rematerialize(net, torch.randn(1024, 64), budget="50%")
    print(rm.plan.fingerprint, rm.plan.cache_hit)
""")

_BURN = "import time\\nend = time.time() + 60\\nwhile time.time() < end: pass"


def _fresh_run(env: dict, busy: bool = False) -> tuple[str, bool]:
    burners = [subprocess.Popen([sys.executable, "-c", _BURN]) for _ in range(2 if busy else 0)]
    try:
        done = subprocess.run([sys.executable, "-c", _RUN], cwd=REPO, env=env, text=True,
                              capture_output=True, timeout=300)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    fingerprint, hit = done.stdout.split()
    return fingerprint, hit == "True"


def test_every_fresh_process_runs_the_same_plan_by_default(tmp_path):
    """NOTE [ The same plan every run ]: with no ``cache=`` argument the first process solves
    and writes its schedule to the user's cache directory; later processes, one of them beside
    two CPU-burning neighbours, run that schedule (the same fingerprint) without solving."""
    import os

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("HIREMATE_CACHE_DIR", None)  # the suite turns the default off; a user has it on
    first = _fresh_run(env)
    again = _fresh_run(env)
    loaded = _fresh_run(env, busy=True)
    assert first[1] is False and again == loaded == (first[0], True)
    assert len(list((tmp_path / "hiremate" / "plans").glob("*.json"))) == 1


def test_the_default_cache_can_be_turned_off_or_moved(tmp_path, monkeypatch):
    from remat.cache import default_cache_dir, plan_cache_for, resolve_cache

    monkeypatch.delenv("HIREMATE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "hiremate" / "plans"
    assert resolve_cache(True).directory == tmp_path / "xdg" / "hiremate" / "plans"
    monkeypatch.setenv("HIREMATE_CACHE_DIR", str(tmp_path / "mine"))
    assert resolve_cache(True).directory == tmp_path / "mine"
    assert plan_cache_for(None).directory == tmp_path / "mine"
    for off in ("off", "0", "false", ""):
        monkeypatch.setenv("HIREMATE_CACHE_DIR", off)
        assert default_cache_dir() is None and resolve_cache(True) is None
        cache = plan_cache_for(None)  # a callback keeps one in memory (DDP, checkpoints)
        assert isinstance(cache, remat.PlanCache) and cache.directory is None
    assert resolve_cache(False) is None and resolve_cache(None) is None
    assert resolve_cache("off") is None and plan_cache_for("off").directory is None
    with pytest.raises(TypeError, match=r"cache=3: expected True"):
        resolve_cache(3)


def test_the_fingerprint_names_the_schedule(tmp_path):
    """Equal schedules, equal fingerprints (a cache hit runs the same one); another budget's
    schedule has another; ``plan.summary()`` shows it."""
    solved = solve("60%", str(tmp_path))
    hit = solve("60%", str(tmp_path))
    other = solve("90%", None)
    assert hit.plan.cache_hit and hit.plan.fingerprint == solved.plan.fingerprint
    assert len(solved.plan.fingerprint) == 10 and other.plan.fingerprint != solved.plan.fingerprint
    assert f"schedule                    {solved.plan.fingerprint}" in solved.plan.summary()


def _counting_measurements(monkeypatch) -> list[int]:
    """The ``repeats`` of every measurement of op costs the backend makes from now on."""
    import remat.dynamo_backend as backend

    real, calls = backend.measure_op_times, []

    def counted(*args, repeats=3, **kwargs):
        calls.append(repeats)
        return real(*args, repeats=repeats, **kwargs)

    monkeypatch.setattr(backend, "measure_op_times", counted)
    return calls


def test_op_costs_are_measured_once_per_graph_and_machine(tmp_path, monkeypatch):
    """NOTE [ Costs measured once ]: a later capture of the same graph (another budget, another
    process's cache) takes the costs measured first instead of running the step four more
    times; its plan prints the same numbers. Costs tagged with another machine are measured
    again."""
    calls = _counting_measurements(monkeypatch)
    first = solve("60%", str(tmp_path))
    assert calls == [3]
    other_budget = solve("80%", remat.PlanCache(tmp_path))  # solves, measures nothing
    again = solve("60%", remat.PlanCache(tmp_path))  # a hit, measures nothing
    assert calls == [3] and not other_budget.plan.cache_hit and again.plan.cache_hit
    assert again.plan.predicted_overhead == first.plan.predicted_overhead
    assert again.plan.predicted_peak_bytes == first.plan.predicted_peak_bytes
    assert again.plan.fingerprint == first.plan.fingerprint

    (kept,) = (tmp_path / "costs").glob("*.json")
    entry = json.loads(kept.read_text())
    assert len(entry["times"]) == len(entry["workspaces"]) == first.plan.num_ops
    kept.write_text(json.dumps({**entry, "machine": "cpu:another|threads=64|torch=0"}))
    solve("60%", remat.PlanCache(tmp_path))
    assert calls == [3, 3]  # another machine's costs are not this one's
    kept.write_text(json.dumps({**entry, "times": entry["times"][1:]}))  # not this graph's
    solve("60%", remat.PlanCache(tmp_path))
    assert calls == [3, 3, 3]


def test_estimate_measures_memory_only(monkeypatch):
    """``remat.estimate`` solves nothing and times nothing: one run for scratch memory, and the
    same figures as the capture that times every op."""
    calls = _counting_measurements(monkeypatch)
    model, x = mlp()
    report = remat.estimate(model, x)
    assert calls == [0]
    timed = remat.rematerialize(model, x, budget="60%", cache=False)
    assert calls == [0, 3]
    assert report.activation_peak_bytes == timed.plan.baseline_bytes
    assert report.lowest_peak_bytes == timed.plan.lower_bound_bytes
