"""Task and plugin registries: discovery by file, error messages, and the plugin contract."""
from __future__ import annotations

import dataclasses
import sys
import textwrap
import types
from types import SimpleNamespace

import pytest

import recipes.plugins
import recipes.tasks
from recipes import RecipeError, get_plugin, get_task, load_recipe
from recipes.registry import Plugin, available_plugins, available_tasks
from recipes.train import build_callbacks

from .conftest import RECIPES_DIR

GPT = RECIPES_DIR / "gpt_plain.yaml"


def test_available_names():
    # other engineers add tasks and plugins: these are the ones that must always be there
    assert {"digits_cnn", "gpt_lm"} <= set(available_tasks())
    assert "remat" in available_plugins()
    assert available_tasks() == sorted(available_tasks())


def test_unknown_task_lists_every_task():
    with pytest.raises(RecipeError) as info:
        get_task("resnet")
    text = str(info.value)
    assert text.startswith("task='resnet': unknown task. Available tasks: ")
    assert f"Available tasks: {', '.join(available_tasks())}." in text
    assert "recipes/tasks/<name>.py" in text and "recipes/README.md" in text


def test_unknown_plugin_lists_every_plugin():
    with pytest.raises(RecipeError) as info:
        get_plugin("remta")
    text = str(info.value)
    assert text.startswith("plugin 'remta': unknown plugin section; did you mean 'remat'?")
    assert f"Available plugins: {', '.join(available_plugins())}." in text


@pytest.mark.parametrize("name", available_plugins())
def test_every_plugin_is_a_section_off_by_default(name):
    plugin = get_plugin(name)
    assert plugin.name == name
    assert plugin.config().enabled is False
    recipe = load_recipe(GPT)
    assert dataclasses.asdict(getattr(recipe, name)) == dataclasses.asdict(plugin.config())


@pytest.mark.parametrize("name", available_tasks())
def test_every_task_builds_a_module_whose_only_network_is_net(name):
    task = get_task(name)
    module, datamodule = task.build(task.model(), task.data(), load_recipe(GPT).optim)
    children_with_params = [n for n, c in module.named_children() if any(True for _ in c.parameters())]
    assert children_with_params == ["net"]
    assert hasattr(datamodule, "train_dataloader") and hasattr(datamodule, "val_dataloader")


# --- the extension contract of recipes/README.md: one new file, nothing shared edited ----------

DEMO_PLUGIN = '''
from dataclasses import dataclass
from recipes.errors import InvalidValue
from recipes.registry import Plugin

@dataclass
class DemoConfig:
    enabled: bool = False
    level: int = 2
    def __post_init__(self):
        if self.level not in (1, 2, 3):
            raise InvalidValue("level", self.level, "expected one of 1, 2, 3")

def make_callback(cfg):
    return ("demo-callback", cfg.level)

PLUGIN = Plugin(config=DemoConfig, make_callback=make_callback, order=10, description="demo")
'''


@pytest.fixture
def demo_plugin(tmp_path, monkeypatch):
    """Adds recipes/plugins/demo.py the way the README says, in a temporary directory."""
    (tmp_path / "demo.py").write_text(textwrap.dedent(DEMO_PLUGIN))
    monkeypatch.setattr(recipes.plugins, "__path__", [*recipes.plugins.__path__, str(tmp_path)])
    yield
    sys.modules.pop("recipes.plugins.demo", None)


def test_adding_a_plugin_file_adds_a_section(demo_plugin):
    assert "demo" in available_plugins()
    recipe = load_recipe(GPT, ["demo.enabled=true", "demo.level=3"])
    assert recipe.demo.level == 3 and recipe.demo.enabled
    assert build_callbacks(recipe) == [("demo-callback", 3)]
    with pytest.raises(RecipeError, match=r"^unknown key 'demo.levl' .*did you mean 'demo.level'\?"):
        load_recipe(GPT, ["demo.levl=3"])
    with pytest.raises(RecipeError, match=r"^demo.level=5 \(from override 'demo.level=5'\): expected one of 1, 2, 3$"):
        load_recipe(GPT, ["demo.level=5"])


def test_plugin_without_enabled_field_is_refused(tmp_path, monkeypatch):
    (tmp_path / "broken.py").write_text(
        "from dataclasses import dataclass\nfrom recipes.registry import Plugin\n"
        "@dataclass\nclass C:\n    level: int = 1\n"
        "PLUGIN = Plugin(config=C, make_callback=lambda cfg: None)\n"
    )
    monkeypatch.setattr(recipes.plugins, "__path__", [*recipes.plugins.__path__, str(tmp_path)])
    try:
        with pytest.raises(TypeError, match=r"recipes/plugins/broken.py: PLUGIN.config must be a dataclass with a field `enabled: bool = False`"):
            get_plugin("broken")
    finally:
        sys.modules.pop("recipes.plugins.broken", None)


def test_adding_a_task_file_adds_a_task(tmp_path, monkeypatch):
    (tmp_path / "tiny.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from recipes.registry import Task

        @dataclass
        class M:
            width: int = 4

        @dataclass
        class D:
            batch_size: int = 2

        TASK = Task(model=M, data=D, build=lambda m, d, o: (m, d), description="tiny")
    '''))
    (tmp_path / "_helper.py").write_text("X = 1\n")  # private helpers are not tasks
    monkeypatch.setattr(recipes.tasks, "__path__", [*recipes.tasks.__path__, str(tmp_path)])
    try:
        assert "tiny" in available_tasks() and "_helper" not in available_tasks()
        path = tmp_path / "tiny.yaml"
        path.write_text("task: tiny\nmodel:\n  width: 8\n")
        recipe = load_recipe(path)
        assert recipe.model.width == 8 and recipe.data.batch_size == 2
    finally:
        sys.modules.pop("recipes.tasks.tiny", None)


def test_callbacks_are_ordered_by_plugin_order(monkeypatch):
    plugins = {
        "late": Plugin(config=object, make_callback=lambda cfg: "late", order=100, name="late"),
        "early": Plugin(config=object, make_callback=lambda cfg: "early", order=10, name="early"),
        "off": Plugin(config=object, make_callback=lambda cfg: "off", order=1, name="off"),
    }
    monkeypatch.setattr("recipes.train.all_plugins", lambda: plugins)
    recipe = SimpleNamespace(
        late=SimpleNamespace(enabled=True), early=SimpleNamespace(enabled=True),
        off=SimpleNamespace(enabled=False),
    )
    assert build_callbacks(recipe) == ["early", "late"]


# --- the remat plugin against HiRemateCallback's contract -----------------------------------------


class _RecordingCallback:
    def __init__(self, budget="70%", *, module=None, solver="hierarchical", time_limit=60.0,
                 cache_dir=None, strict=False, verbose=True):
        self.args = dict(budget=budget, module=module, solver=solver, time_limit=time_limit,
                         cache_dir=cache_dir, strict=strict, verbose=verbose)


@pytest.fixture
def fake_remat_callback(monkeypatch):
    import integrations.lightning as api

    fake = types.ModuleType("integrations.remat_callback")
    fake.HiRemateCallback = _RecordingCallback
    monkeypatch.setitem(sys.modules, "integrations.remat_callback", fake)
    monkeypatch.delattr(api, "HiRemateCallback", raising=False)  # drop the lazy-import cache
    yield
    monkeypatch.delattr(api, "HiRemateCallback", raising=False)


def test_remat_plugin_passes_every_argument(fake_remat_callback):
    recipe = load_recipe(
        RECIPES_DIR / "gpt_remat.yaml",
        ["remat.budget=0.4", "remat.module=[net]", "remat.time_limit=5", "remat.cache_dir=/tmp/c",
         "remat.strict=true", "remat.verbose=false", "remat.solver=dp"],
    )
    (callback,) = build_callbacks(recipe)
    assert isinstance(callback, _RecordingCallback)
    assert callback.args == dict(budget=0.4, module=["net"], solver="dp", time_limit=5.0,
                                 cache_dir="/tmp/c", strict=True, verbose=False)


def test_remat_plugin_without_the_callback_says_so(monkeypatch):
    import integrations.lightning as api

    monkeypatch.setitem(sys.modules, "integrations.remat_callback", None)  # import fails
    monkeypatch.delattr(api, "HiRemateCallback", raising=False)
    recipe = load_recipe(RECIPES_DIR / "gpt_remat.yaml")
    with pytest.raises(RecipeError) as info:
        build_callbacks(recipe)
    text = str(info.value)
    assert text.startswith(
        "remat.enabled=true needs integrations.lightning.HiRemateCallback, which cannot be imported"
    )
    assert text.endswith("this hiremate checkout does not provide it yet, or set remat.enabled=false")


def test_callback_rejecting_its_arguments_is_a_recipe_error(monkeypatch):
    import integrations.lightning as api

    class Picky:  # rejects what the load-time check let through (e.g. a newer rule)
        def __init__(self, budget, **kwargs):
            raise ValueError(f"solver={kwargs['solver']!r}: not on this machine; choose hierarchical")

    fake = types.ModuleType("integrations.remat_callback")
    fake.HiRemateCallback = Picky
    monkeypatch.setitem(sys.modules, "integrations.remat_callback", fake)
    monkeypatch.delattr(api, "HiRemateCallback", raising=False)
    recipe = load_recipe(RECIPES_DIR / "gpt_remat.yaml", ["remat.solver=ilp"])
    with pytest.raises(RecipeError, match=r"^remat: the callback rejected its arguments: solver='ilp': not on this machine"):
        build_callbacks(recipe)
    monkeypatch.delattr(api, "HiRemateCallback", raising=False)
