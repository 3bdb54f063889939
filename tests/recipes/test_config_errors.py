"""Misspelt keys and bad values fail at load time with the documented messages (recipes/README.md)."""
from __future__ import annotations

import re

import pytest

from recipes import RecipeError, available_plugins, available_tasks, load_recipe
from recipes.run import EXIT_BAD_RECIPE, main

from .conftest import RECIPES_DIR

GPT = RECIPES_DIR / "gpt_plain.yaml"
# Other engineers add tasks and plugin sections: the messages list whatever is registered.
TASKS = ", ".join(available_tasks())
TOP_LEVEL = ", ".join(["task", "seed", "model", "data", "optim", "trainer", *available_plugins()])

BAD_OVERRIDES = [
    pytest.param(
        "trainer.max_step=5",
        "unknown key 'trainer.max_step' (from override 'trainer.max_step=5'); did you mean "
        "'trainer.max_steps'? Keys allowed under 'trainer': max_steps, accelerator,",
        id="misspelt-nested-key",
    ),
    pytest.param(
        "trainr.max_steps=5",
        "unknown key 'trainr' (from override 'trainr.max_steps=5'); did you mean 'trainer'? "
        f"Keys allowed at the top level: {TOP_LEVEL}",
        id="misspelt-section",
    ),
    pytest.param(
        "remat.budgt=50%",
        "unknown key 'remat.budgt' (from override 'remat.budgt=50%'); did you mean 'remat.budget'?",
        id="misspelt-plugin-key",
    ),
    pytest.param(
        "model.channels=[8]",
        "unknown key 'model.channels' (from override 'model.channels=[8]'). Keys allowed under "
        "'model': block_size, n_layer, n_head, n_embd, dropout, bias, tie_weights (the keys of "
        "'model' depend on the task; task='gpt_lm')",
        id="key-of-another-task",
    ),
    pytest.param(
        "trainer.max_steps=abc",
        "trainer.max_steps='abc' (from override 'trainer.max_steps=abc'): Value 'abc' of type "
        "'str' could not be converted to Integer",
        id="wrong-type",
    ),
    pytest.param(
        "trainer.accelerator=gpux",
        "trainer.accelerator='gpux' (from override 'trainer.accelerator=gpux'): Invalid value "
        "'gpux', expected one of [cpu, cuda, gpu, mps, auto]",
        id="unknown-enum",
    ),
    pytest.param(
        "optim.name=adam",
        "optim.name='adam' (from override 'optim.name=adam'): expected one of adamw, sgd",
        id="unknown-optimizer",
    ),
    pytest.param(
        "optim.schedule=linear",
        "optim.schedule='linear' (from override 'optim.schedule=linear'): expected one of "
        "constant, cosine",
        id="unknown-schedule",
    ),
    pytest.param(
        "trainer.precision=16",
        "trainer.precision='16' (from override 'trainer.precision=16'): expected one of 32-true, "
        "64-true, 16-mixed, bf16-mixed, 16-true, bf16-true",
        id="unknown-precision",
    ),
    pytest.param(
        "trainer.max_steps=0",
        "trainer.max_steps=0 (from override 'trainer.max_steps=0'): expected an int >= 1",
        id="max-steps-zero",
    ),
    pytest.param(
        "model.n_head=3",
        "model.n_embd=128 (in ",  # the check is on n_embd, which the YAML set
        id="heads-do-not-divide-width",
    ),
    pytest.param(
        "trainer=5",
        "trainer=5 (from override 'trainer=5'): 'trainer' is a section; expected a mapping of "
        "its keys (max_steps, accelerator,",
        id="scalar-for-section",
    ),
    pytest.param(
        "trainer.max_steps",
        "override 'trainer.max_steps': expected dotted.key=value, e.g. trainer.max_steps=5",
        id="override-without-value",
    ),
    pytest.param(
        "task=gpt",
        f"task='gpt': unknown task; did you mean 'gpt_lm'? Available tasks: {TASKS}.",
        id="unknown-task",
    ),
    pytest.param(
        "task=5",
        f"task=5: expected a task name, one of {TASKS}",
        id="task-not-a-name",
    ),
    pytest.param(
        "data.files=[nope.py,bisect.py]",
        "data.files=['nope.py', 'bisect.py'] (from override 'data.files=[nope.py,bisect.py]'): "
        "nope.py not found under ",
        id="stdlib-file-missing",
    ),
    pytest.param(
        "model.dropout=${nope}",
        "model.dropout='${nope}' (from override 'model.dropout=${nope}'): Interpolation key 'nope' not found",
        id="bad-interpolation",
    ),
    pytest.param(
        "remat.module=[1]",
        "remat.module=[1] (from override 'remat.module=[1]'): expected null (auto), an "
        "attribute name such as net, or a list of names",
        id="remat-module-not-names",
    ),
]


@pytest.mark.parametrize("override, message", BAD_OVERRIDES)
def test_bad_override_message(override, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(GPT, [override])
    assert str(info.value).startswith(message), str(info.value)


# parse_budget is the lead's remat/budget.py; the recipe adds the key and where it came from.
@pytest.mark.parametrize(
    "budget, shown, reason",
    [
        pytest.param("150%", "'150%'", "a percentage budget must be in (0%, 100%]; pass ", id="150%"),
        pytest.param("-1GB", "'-1GB'", "a byte budget must be at least 1 byte; pass ", id="-1GB"),
        pytest.param("abc", "'abc'", "cannot read this as a percentage, a fraction or a byte count", id="abc"),
        pytest.param("1.5", "1.5", "a fraction budget must be in (0, 1]", id="fraction-1.5"),
        # NOTE [ A bare number is a fraction ]: omegaconf hands over the int 50 for
        # remat.budget=50, which used to pass --check as a 50-byte budget.
        pytest.param("50", "50", 'a bare number is a budget only as a fraction in (0, 1]; for 50 '
                     'write its unit: "50%" (50% of the measured step) or a byte count such as '
                     '"50MiB" ("50B" is 50 bytes)', id="bare-50"),
        pytest.param("1500000000", "1500000000", 'a bare number is a budget only as a fraction in '
                     '(0, 1]; for 1500000000 write its unit: "1500000000B" for 1500000000 bytes '
                     '(1.40 GiB)', id="bare-bytes"),
    ],
)
def test_bad_budget_fails_at_load_time(budget, shown, reason):
    with pytest.raises(RecipeError) as info:
        load_recipe(GPT, [f"remat.budget={budget}"])
    expected = f"remat.budget={shown} (from override 'remat.budget={budget}'): {reason}"
    assert str(info.value).startswith(expected), str(info.value)


@pytest.mark.parametrize(
    "override, value",
    [
        pytest.param("remat.budget=0.7", 0.7, id="float"),
        pytest.param("remat.budget=70%", "70%", id="percent-string"),
        pytest.param("remat.budget=6GiB", "6GiB", id="bytes-string"),
        pytest.param("remat.budget=1500000000B", "1500000000B", id="bytes-with-unit"),
        pytest.param("remat.budget=1", 1, id="int-one-is-100%"),
    ],
)
def test_budget_keeps_its_yaml_type(override, value):
    budget = load_recipe(GPT, [override]).remat.budget
    assert budget == value and type(budget) is type(value)


@pytest.mark.parametrize(
    "override, message",
    [
        pytest.param("remat.time_limit=nan", "remat.time_limit=nan (from override "
                     "'remat.time_limit=nan'): expected a finite number of seconds > 0; pass e.g. "
                     "remat.time_limit=60", id="nan"),
        pytest.param("remat.time_limit=inf", "remat.time_limit=inf (from override "
                     "'remat.time_limit=inf'): expected a finite number of seconds > 0", id="inf"),
        pytest.param("remat.time_limit=0", "remat.time_limit=0.0 (from override "
                     "'remat.time_limit=0'): expected a finite number of seconds > 0", id="zero"),
        pytest.param("remat.time_limit=-1", "remat.time_limit=-1.0 (from override "
                     "'remat.time_limit=-1'): expected a finite number of seconds > 0", id="negative"),
    ],
)
def test_bad_time_limit_fails_at_load_time(override, message):
    # remat.check_time_limit (NOTE [ One check per setting ]): the same rule as the API's.
    with pytest.raises(RecipeError) as info:
        load_recipe(GPT, [override])
    assert str(info.value).startswith(message), str(info.value)


def test_cli_check_refuses_a_bare_budget(capsys):
    """The user's report: ``recipes.run recipes/gpt_remat.yaml remat.budget=50 --check`` passed."""
    status = main([str(RECIPES_DIR / "gpt_remat.yaml"), "remat.budget=50", "--check"])
    captured = capsys.readouterr()
    assert status == EXIT_BAD_RECIPE
    assert captured.err.startswith(
        "error: remat.budget=50 (from override 'remat.budget=50'): a bare number is a budget only "
        'as a fraction in (0, 1]; for 50 write its unit: "50%"'), captured.err
    assert "resolved recipe" not in captured.out


def _write(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, message",
    [
        pytest.param(
            "task: gpt_lm\ntrainer:\n  max_step: 5\n",
            "unknown key 'trainer.max_step' (in {path}); did you mean 'trainer.max_steps'?",
            id="misspelt-key-in-yaml",
        ),
        pytest.param(
            "task: digits_cnn\nmodel:\n  dropout: 2.0\n",
            "model.dropout=2.0 (in {path}): expected a float in [0, 1)",
            id="bad-value-in-yaml",
        ),
        pytest.param(
            "task: digits_cnn\noptim:\n  lr: fast\n",
            "optim.lr='fast' (in {path}): Value 'fast' of type 'str' could not be converted to Float",
            id="wrong-type-in-yaml",
        ),
        pytest.param(
            "seed: 1\n",
            "missing key 'task' (in {path}): set it to one of " + TASKS
            + ", e.g. task: " + available_tasks()[0],
            id="no-task",
        ),
        pytest.param("- 1\n- 2\n", "{path}: expected a mapping of sections at the top level", id="list"),
        pytest.param("task: [gpt_lm\n", "{path}: not valid YAML:", id="invalid-yaml"),
    ],
)
def test_bad_yaml_message(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(info.value).startswith(message.format(path=path)), str(info.value)


def test_missing_file():
    with pytest.raises(RecipeError, match=re.escape("recipe file 'no/such.yaml' not found")):
        load_recipe("no/such.yaml")


def test_later_override_wins_and_task_can_be_switched(tmp_path):
    path = _write(tmp_path, "task: gpt_lm\n")
    recipe = load_recipe(path, ["task=digits_cnn", "trainer.max_steps=7", "trainer.max_steps=9"])
    assert recipe.task == "digits_cnn"
    assert recipe.model.channels == [16, 32, 64]  # digits_cnn's model section
    assert recipe.trainer.max_steps == 9


def test_cli_prints_error_and_exits_2_before_building(capsys):
    status = main([str(GPT), "trainer.max_step=5"])
    captured = capsys.readouterr()
    assert status == EXIT_BAD_RECIPE == 2
    assert captured.err.startswith("error: unknown key 'trainer.max_step'")
    assert "resolved recipe" not in captured.out  # nothing printed, nothing built


def test_cli_check_prints_resolved_config(capsys):
    status = main([str(GPT), "trainer.max_steps=3", "remat.budget=0.5", "--check"])
    out = capsys.readouterr().out
    assert status == 0
    assert f"# resolved recipe: {GPT} trainer.max_steps=3 remat.budget=0.5" in out
    assert "  max_steps: 3\n" in out and "  budget: 0.5\n" in out
    assert "== summary ==" not in out  # --check does not train
