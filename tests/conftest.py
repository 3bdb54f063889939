"""Shared test fixtures: every test starts from the same global state and leaves it as found."""
from __future__ import annotations

import random

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _no_default_plan_cache():
    """NOTE [ The same plan every run ]: remat keeps plans in the user's cache directory by
    default. Tests (and the processes they start) solve for themselves instead of reading each
    other's plans or the developer's; tests of the default cache point it at a directory."""
    import os
    import tempfile

    names = ("HIREMATE_CACHE_DIR", "XDG_CACHE_HOME")
    before = {name: os.environ.get(name) for name in names}
    with tempfile.TemporaryDirectory(prefix="hiremate-tests-cache-") as home:
        os.environ["HIREMATE_CACHE_DIR"] = "off"
        os.environ["XDG_CACHE_HOME"] = home  # where a test that unsets it writes, not ~/.cache
        yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _restore_global_torch_state(request):
    """Restore seed, default dtype, deterministic flags and dynamo caches around every test.

    Tests marked ``dynamo_state_carries`` keep dynamo's caches from one to the next (a user's
    run never resets them, and what builds up over many models and shapes is tested there);
    any other test resets them on entry and on exit."""
    dtype = torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled()
    grad_enabled = torch.is_grad_enabled()
    rng = torch.get_rng_state()
    py_rng = random.getstate()
    carries = request.node.get_closest_marker("dynamo_state_carries") is not None
    if not carries:
        torch._dynamo.reset()  # after a test whose state carried
    torch.manual_seed(0)
    random.seed(0)
    yield
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(deterministic)
    torch.set_grad_enabled(grad_enabled)
    torch.set_rng_state(rng)
    random.setstate(py_rng)
    if not carries:
        torch._dynamo.reset()


@pytest.fixture
def one_thread():
    """Two cores shared with other jobs: OpenMP spinning on 2 threads makes steps ~20x slower.
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests with a reason when no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
