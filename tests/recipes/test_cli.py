"""`python -m recipes.run`: --list, missing files, --check making every check a run makes, path
options, validation without Lightning, and the setup/training split of the summary."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import time

import lightning as L
import pytest
import torch

import recipes.config
import recipes.train
from recipes import RecipeError, load_recipe, run_recipe
from recipes.registry import all_plugins, available_plugins, available_tasks
from recipes.run import EXIT_BAD_RECIPE, main, recipe_purpose
from recipes.stats import Summary, format_summary

from .conftest import RECIPES_DIR, REPO

YAML_NAMES = sorted(p.name for p in RECIPES_DIR.glob("*.yaml"))
GPT_REMAT = RECIPES_DIR / "gpt_remat.yaml"
CNN = RECIPES_DIR / "cnn_plain.yaml"
# Seconds the fake plugin below sleeps in setup and in one training step: only needs to stand
# clearly above timer noise.
SETUP_SLEEP_S = 0.3


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# ---- --list ------------------------------------------------------------------------------------


def test_list_names_every_recipe_file_with_its_purpose(capsys):
    status, out, _ = _run(capsys, "--list")
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == "recipes (python -m recipes.run recipes/<file> [key=value ...]):"
    for name in YAML_NAMES:
        purpose = recipe_purpose(RECIPES_DIR / name)
        assert any(line.split() == [name, *purpose.split()] for line in lines), name
    assert "  gpt_remat.yaml" in out and "gpt_plain with HiRemate at 50%" in out
    assert lines.index("tasks (task: <name>):") == len(YAML_NAMES) + 1
    assert all(f"  {t} " in out for t in available_tasks())
    assert all(f"  {p} " in out for p in available_plugins())


def test_list_says_how_to_fix_a_recipe_without_purpose(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("# python -m recipes.run recipes/x.yaml\n#\ntask: gpt_lm\n")
    assert recipe_purpose(path) == "(no purpose line: make the second line '# <what it trains>')"


# ---- a recipe file that is not there -----------------------------------------------------------


@pytest.mark.parametrize(
    "given, suggestion",
    [
        pytest.param("recipes/gpt_remmat.yaml", "did you mean 'recipes/gpt_remat.yaml'?", id="typo"),
        pytest.param("recipes/gpt_plain", "did you mean 'recipes/gpt_plain.yaml'?", id="no-suffix"),
        pytest.param("recipe/cnn_remat.yaml", "did you mean 'recipes/cnn_remat.yaml'?", id="bad-folder"),
        pytest.param("recipes/resnet.yaml", "", id="nothing-close"),
    ],
)
def test_missing_recipe_file_suggests_the_closest_and_lists_them(capsys, monkeypatch, given, suggestion):
    monkeypatch.chdir(REPO)
    status, out, err = _run(capsys, given, "--check")
    assert status == EXIT_BAD_RECIPE and out == ""
    listed = ", ".join(YAML_NAMES)
    hint = f"; {suggestion}" if suggestion else "."
    assert err == (f"error: recipe file {given!r} not found{hint} Recipes in recipes/: {listed} "
                   "(python -m recipes.run --list says what each one trains)\n")


def test_recipe_path_that_is_a_directory(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    status, _, err = _run(capsys, "recipes")
    assert status == EXIT_BAD_RECIPE
    assert err.startswith("error: recipe file 'recipes' is a directory, not a recipe file. Recipes in ")


# ---- --check rejects what a run rejects --------------------------------------------------------


@pytest.mark.parametrize(
    "recipe, override, message",
    [
        pytest.param(GPT_REMAT, "remat.solver=hirarchical",
                     "remat.solver='hirarchical' (from override 'remat.solver=hirarchical'): "
                     "unknown solver; did you mean 'hierarchical'?; expected one of ",
                     id="solver-typo"),
        pytest.param(GPT_REMAT, "remat.solver=ILP",
                     "remat.solver='ILP' (from override 'remat.solver=ILP'): unknown solver; "
                     "expected one of ", id="solver-case"),
        pytest.param(RECIPES_DIR / "gpt_accelerate.yaml", "remat.solver=ILP",
                     "remat.solver='ILP' (from override", id="accelerate-recipe"),
        pytest.param(RECIPES_DIR / "gpt_accelerate.yaml", "fewbit.enabled=true",
                     "accelerate.enabled=True (in ", id="accelerate-would-ignore-fewbit"),
        pytest.param(CNN, "trainer.strategy=ddp_nonsense",
                     "trainer: Lightning rejected the settings: ", id="lightning-strategy"),
    ],
)
def test_check_rejects_what_the_run_rejects(capsys, recipe, override, message):
    status, out, err = _run(capsys, str(recipe), override, "--check")
    assert status == EXIT_BAD_RECIPE, out
    assert err.startswith(f"error: {message}"), err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_check_rejects_an_accelerator_that_is_not_there(capsys):
    status, _, err = _run(capsys, str(CNN), "trainer.accelerator=cuda", "--check")
    assert status == EXIT_BAD_RECIPE
    assert err.startswith("error: trainer: Lightning rejected the settings: `CUDAAccelerator` can "
                          "not run on your system")


def test_check_of_a_good_recipe_builds_the_trainer(capsys, monkeypatch):
    built = []
    original = recipes.train.build_trainer
    monkeypatch.setattr(recipes.train, "build_trainer",
                        lambda cfg, callbacks: built.append(original(cfg, callbacks)) or built[-1])
    status, out, _ = _run(capsys, str(GPT_REMAT), "remat.solver=dp", "--check")
    assert status == 0 and "  solver: dp\n" in out and "== summary ==" not in out
    (trainer,) = built
    names = [type(c).__name__ for c in trainer.callbacks]
    assert names[0] == "FitPhases" and "HiRemateCallback" in names


# ---- flags anywhere, one config line -----------------------------------------------------------


MISSPELT = ("error: unknown key 'remat.solvr' (from override 'remat.solvr=dp'); did you mean "
            "'remat.solver'? Keys allowed under 'remat': enabled, budget, module, solver, "
            "time_limit, cache_dir, strict, verbose\n")


@pytest.mark.parametrize("argv", [
    pytest.param(["--check", str(GPT_REMAT), "remat.solvr=dp"], id="check-first"),
    pytest.param([str(GPT_REMAT), "--check", "remat.solvr=dp"], id="check-before-overrides"),
    pytest.param([str(GPT_REMAT), "remat.solvr=dp", "--check"], id="check-last"),
])
def test_flags_go_anywhere_and_a_misspelt_key_is_reported(capsys, argv):
    status, out, err = _run(capsys, *argv)
    assert (status, out, err) == (EXIT_BAD_RECIPE, "", MISSPELT)


def test_check_before_the_overrides_applies_them(capsys):
    status, out, err = _run(capsys, str(GPT_REMAT), "--check", "remat.solver=dp",
                            "trainer.max_steps=7")
    assert status == 0, err
    assert out.startswith(f"# resolved recipe: {GPT_REMAT} remat.solver=dp trainer.max_steps=7\n")
    assert "  solver: dp\n" in out and "  max_steps: 7\n" in out


@pytest.fixture
def no_training(monkeypatch):
    """``recipes.run`` up to the training, which is recorded instead of run."""
    calls = []
    monkeypatch.setattr(recipes.train, "run_recipe",
                        lambda recipe, **kwargs: calls.append((recipe, kwargs)))
    return calls


@pytest.mark.parametrize("overrides, line", [
    pytest.param([], "config: {path}; full config: --print-config", id="no-override"),
    pytest.param(["trainer.max_steps=30"], "config: {path} + 1 override (trainer.max_steps=30); "
                 "full config: --print-config", id="one-override"),
    pytest.param(["trainer.max_steps=30", "remat.budget=70%"],
                 "config: {path} + 2 overrides (trainer.max_steps=30, remat.budget=70%); full "
                 "config: --print-config", id="two-overrides"),
])
def test_a_run_prints_one_config_line(capsys, no_training, overrides, line):
    status, out, _ = _run(capsys, str(GPT_REMAT), *overrides)
    assert status == 0 and out == line.format(path=GPT_REMAT) + "\n"
    ((recipe, kwargs),) = no_training
    assert recipe.trainer.max_steps == (30 if overrides else 300)
    assert kwargs == {"progress_bar": False}  # pytest's stderr is no terminal: no bar


def test_print_config_prints_the_resolved_yaml_before_the_run(capsys, no_training):
    status, out, _ = _run(capsys, "--print-config", str(GPT_REMAT), "trainer.max_steps=30")
    assert status == 0 and len(no_training) == 1
    assert out.startswith(f"# resolved recipe: {GPT_REMAT} trainer.max_steps=30\ntask: gpt_lm\n")
    assert "\n  max_steps: 30\n" in out and "full config: --print-config" not in out


def test_a_terminal_gets_a_progress_bar(capsys, no_training, monkeypatch):
    from recipes.stats import ProgressBar

    monkeypatch.setattr(ProgressBar, "terminal", staticmethod(lambda: True))
    assert _run(capsys, str(GPT_REMAT))[0] == 0
    assert no_training[0][1] == {"progress_bar": True}


# ---- checks that used to wait for build time ---------------------------------------------------


@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        pytest.param(
            "gpt_remat_varlen.yaml", ["data.min_length=200"],
            "data.min_length=200 (from override 'data.min_length=200'): expected at most "
            "model.block_size=128, or null", id="min-length-over-block"),
        pytest.param(
            "gpt_plain.yaml", ["data.val_fraction=0.0001"],
            "data.val_fraction=0.0001 (from override 'data.val_fraction=0.0001'): the validation "
            "text would be ", id="gpt-val-text-too-short"),
        pytest.param(
            "gpt_plain.yaml", ["data.batch_size=100000"],
            "data.batch_size=100000 (from override 'data.batch_size=100000'): the training text "
            "holds ", id="gpt-batch-too-large"),
        pytest.param(
            "cnn_plain.yaml", ["data.batch_size=1500"],
            "data.batch_size=1500 (from override 'data.batch_size=1500'): expected at most the 1437 "
            "training images (data.val_fraction=0.2); the last incomplete batch is dropped, so no "
            "step would run", id="cnn-batch-too-large"),
        pytest.param(
            "cnn_plain.yaml", ["data.val_fraction=0.001"],
            "data.val_fraction=0.001 (from override 'data.val_fraction=0.001'): holds out 2 of the "
            "1797 images and trains on 1795; the stratified split needs at least 10 (one per "
            "class) on each side", id="cnn-val-too-small"),
        pytest.param(
            "digits_ode_adjoint.yaml", ["model.method=dopri6"],
            "model.method='dopri6' (from override 'model.method=dopri6'): not a torchdiffeq "
            "solver; choose one of 'dopri8', 'dopri5',", id="ode-method"),
        pytest.param(
            "digits_ode_adjoint.yaml", ["model.grad=interpolated", "model.method=euler"],
            "model.method='euler' (from override 'model.method=euler'): method='euler' with "
            "grad='interpolated': the interpolated adjoint needs an adaptive Runge-Kutta solver",
            id="ode-method-for-interpolated"),
    ],
)
def test_build_time_checks_run_when_the_recipe_is_loaded(recipe, overrides, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(RECIPES_DIR / recipe, overrides)
    assert str(info.value).startswith(message), str(info.value)


def test_min_length_up_to_the_block_size_is_fine():
    recipe = load_recipe(RECIPES_DIR / "gpt_remat_varlen.yaml", ["model.block_size=16"])
    assert recipe.data.min_length == recipe.model.block_size == 16


def test_plugin_check_runs_at_load_time_with_the_callbacks_own_message(monkeypatch):
    # A plugin's `check` is the callback's own argument check, run without Lightning; here
    # HiRemateCallback's (integrations._remat_shared.check_settings).
    from integrations._remat_shared import check_settings

    def check(cfg, recipe):
        assert recipe.remat is cfg
        check_settings(budget=cfg.budget, solver=cfg.solver, time_limit=cfg.time_limit,
                       module=cfg.module, cache_dir=cfg.cache_dir, strict=cfg.strict,
                       verbose=cfg.verbose)

    plugins = all_plugins()
    plugins["remat"] = dataclasses.replace(plugins["remat"], check=check)
    monkeypatch.setattr(recipes.config, "all_plugins", lambda: plugins)
    with pytest.raises(RecipeError) as info:
        load_recipe(GPT_REMAT, ["remat.solver=hirarchical"])
    assert str(info.value).startswith(
        "remat.solver='hirarchical' (from override 'remat.solver=hirarchical'): unknown solver; "
        "did you mean 'hierarchical'?; expected one of "), str(info.value)
    assert load_recipe(GPT_REMAT, ["remat.solver=hirarchical", "remat.enabled=false"])  # off: unchecked


def test_a_module_name_the_model_lacks_is_a_recipe_error_before_training(recipe_path):
    recipe = load_recipe(recipe_path("cnn_remat.yaml"), ["remat.module=nett", "trainer.max_steps=2"])
    with pytest.raises(RecipeError) as info:
        run_recipe(recipe, printer=lambda _: None)
    text = str(info.value)
    assert text.startswith("remat: HiRemateCallback(module='nett'): DigitsClassifier has no "
                           "submodule 'nett'; did you mean 'net'?"), text
    assert text.endswith("(raised while fit was setting up, before the first step; fix the "
                         "remat: section)")


# ---- path options ------------------------------------------------------------------------------


def _afile(tmp_path):
    path = tmp_path / "afile"
    path.write_text("not a directory")
    return path


@pytest.mark.parametrize(
    "key, make, reason",
    [
        pytest.param("remat.cache_dir", lambda t: _afile(t),
                     "remat.enabled=true writes there, but '{p}' is a file, not a directory; pass a "
                     "directory that exists or can be created, or null", id="cache-dir-is-a-file"),
        pytest.param("remat.cache_dir", lambda t: _afile(t) / "plans",
                     "remat.enabled=true writes there, but '{p}' cannot be created: '{a}' is a "
                     "file; pass a directory that exists or can be created, or null",
                     id="cache-dir-parent-is-a-file"),
        pytest.param("trainer.default_root_dir", lambda t: _afile(t),
                     "trainer.logger=true writes there, but '{p}' is a file, not a directory; pass "
                     "a directory that exists or can be created", id="root-dir-is-a-file"),
    ],
)
def test_a_directory_option_that_cannot_be_written_is_a_recipe_error(capsys, tmp_path, key, make, reason):
    path = make(tmp_path)
    status, out, err = _run(capsys, str(GPT_REMAT), f"{key}={path}", "trainer.logger=true", "--check")
    assert status == EXIT_BAD_RECIPE and out == ""
    expected = reason.format(p=path, a=tmp_path / "afile")
    assert err == f"error: {key}={str(path)!r} (from override '{key}={path}'): {expected}\n"


def test_an_unwritable_directory_is_a_recipe_error(tmp_path, monkeypatch):
    # running as root, os.access grants everything: deny writing to tmp_path instead
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    with pytest.raises(RecipeError) as info:
        load_recipe(GPT_REMAT, [f"remat.cache_dir={tmp_path}"])
    assert str(info.value).endswith(
        f"remat.enabled=true writes there, but the directory '{tmp_path}' is not writable; pass a "
        "directory that exists or can be created, or null")
    with pytest.raises(RecipeError, match=r"cannot be created: '.*' is not writable; "):
        load_recipe(GPT_REMAT, [f"remat.cache_dir={tmp_path / 'new' / 'plans'}"])


def test_directories_are_checked_only_when_written(tmp_path):
    afile = _afile(tmp_path)
    creatable = tmp_path / "not" / "yet" / "there"
    assert load_recipe(GPT_REMAT, [f"remat.cache_dir={creatable}"]).remat.cache_dir == str(creatable)
    assert not creatable.exists()  # loading writes nothing
    load_recipe(GPT_REMAT, [f"remat.cache_dir={afile}", "remat.enabled=false"])
    load_recipe(GPT_REMAT, [f"trainer.default_root_dir={afile}"])  # no logger, no checkpoints


# ---- validation never imports Lightning --------------------------------------------------------


def test_a_bad_recipe_fails_before_lightning_is_imported():
    script = textwrap.dedent(f"""
        import contextlib, io, sys
        from recipes.run import main
        from recipes.config import load_recipe
        for name in {YAML_NAMES!r}:
            load_recipe("recipes/" + name)
        bad = [
            ["recipes/gpt_remmat.yaml"],
            ["recipes/gpt_remat.yaml", "trainer.max_step=5", "--check"],
            ["recipes/gpt_remat.yaml", "remat.cache_dir=recipes/gpt_remat.yaml", "--check"],
            ["recipes/gpt_remat_varlen.yaml", "data.min_length=500", "--check"],
            ["recipes/digits_ode_adjoint.yaml", "model.method=dopri6", "--check"],
            ["recipes/gpt_remat.yaml", "remat.solver=hirarchical", "--check"],
            ["recipes/cnn_cp.yaml", "remat.enabled=true", "--check"],
        ]
        for argv in bad:
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                status = main(argv)
            assert status == 2 and err.getvalue().startswith("error: "), (argv, err.getvalue())
        heavy = [m for m in ("lightning", "pytorch_lightning", "transformers", "accelerate")
                 if m in sys.modules]
        print("heavy:", heavy)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("heavy: []"), proc.stdout[-2000:]


# ---- setup and training time -------------------------------------------------------------------


class _SlowSetup(L.Callback):
    """Stands in for a plugin whose on_fit_start works (remat captures and solves there) and that
    works once during training (CP compresses at a given step)."""

    def on_fit_start(self, trainer, pl_module):
        time.sleep(SETUP_SLEEP_S)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            time.sleep(SETUP_SLEEP_S)


def test_summary_splits_fit_into_setup_and_training(recipe_path, monkeypatch):
    original = recipes.train.plugin_callbacks
    monkeypatch.setattr(recipes.train, "plugin_callbacks",
                        lambda r: {**original(r), "slow": _SlowSetup()})
    lines: list[str] = []
    summary = run_recipe(load_recipe(recipe_path("cnn_plain.yaml"), ["trainer.max_steps=2"]),
                         printer=lines.append)
    assert SETUP_SLEEP_S <= summary.plugin_setup_s["slow"] < summary.setup_time_s
    assert SETUP_SLEEP_S <= summary.plugin_training_s["slow"] < summary.training_time_s
    assert summary.plugin_training_s["slow"] < 2 * SETUP_SLEEP_S  # one sleep, not one per hook
    assert summary.plugin_wrapup_s["slow"] >= 0
    assert summary.setup_time_s + summary.training_time_s <= summary.fit_time_s
    # the steps themselves are inside the training phase
    assert sum(summary.step_times_s) <= summary.training_time_s
    text = lines[-1]
    assert f"\nsetup: {summary.setup_time_s:.2f} s before the first step; plugin hooks: slow " \
           f"{summary.plugin_setup_s['slow']:.2f} s\n" in text
    assert f"\ntraining: {summary.training_time_s:.2f} s for 2 steps, " in text
    assert f"; plugin hooks: slow {summary.plugin_training_s['slow']:.2f} s\n" in text


def test_progress_bar_counts_the_run_steps_and_prints_the_lines_above_it(recipe_path, capsys):
    """NOTE [ A progress bar on a terminal, lines in a log ]: the bar (on stderr) counts
    ``max_steps``; the progress lines still reach the printer."""
    lines: list[str] = []
    recipe = load_recipe(recipe_path("cnn_plain.yaml"),
                         ["trainer.max_steps=3", "trainer.print_every_n_steps=1"])
    run_recipe(recipe, printer=lines.append, progress_bar=True)
    err = capsys.readouterr().err
    assert "training: 100%" in err and "| 3/3 [" in err and ", train_loss=" in err, err[-2000:]
    assert [line.split("  ")[0] for line in lines[:3]] == ["step 1/3", "step 2/3", "step 3/3"]


def test_the_summary_defines_every_metric_it_prints():
    from recipes.registry import get_task

    summary = Summary(
        steps=2, step_times_s=[0.1, 0.1], timed_steps=[1], train_losses=[5.5, 5.0],
        val_metrics={"val_bpb": 4.2122, "val_loss": 2.9197, "val_ppl": 18.5353},
        step_peak_bytes=None, step_peak_step=None, step_peak_error="", fit_peak_bytes=None,
        device="cpu", fit_time_s=1.0, num_params=10, legend=dict(get_task("gpt_lm").metrics),
    )
    lines = format_summary(summary).splitlines()
    assert lines[lines.index("val_ppl: 18.5353") + 1] == (
        "legend: train_loss = training cross-entropy per byte, in nats; val_bpb = validation bits "
        "per byte, val_loss / ln 2; val_loss = validation cross-entropy per byte, in nats (a "
        "uniform guess: ln 256 = 5.55); val_ppl = validation perplexity, exp(val_loss)")


def test_format_of_the_time_lines():
    summary = Summary(
        steps=200, step_times_s=[0.04] * 200, timed_steps=list(range(1, 199)), train_losses=[1.0],
        val_metrics={}, step_peak_bytes=None, step_peak_step=None, step_peak_error="",
        fit_peak_bytes=None, device="cpu", fit_time_s=66.71, num_params=10,
        setup_time_s=58.1, training_time_s=8.46, plugin_setup_s={"fewbit": 0.02, "remat": 57.9},
        plugin_training_s={"fewbit": 0.31, "remat": 0.05}, plugin_wrapup_s={"fewbit": 0.0, "remat": 0.1},
    )
    lines = format_summary(summary).splitlines()
    assert lines[3:7] == [
        "fit time: 66.71 s = setup 58.10 s + training 8.46 s + wrap-up 0.15 s",
        "setup: 58.10 s before the first step; plugin hooks: fewbit 0.02 s, remat 57.90 s",
        "training: 8.46 s for 200 steps, 42.30 ms/step (data loading and validation during fit "
        "included); plugin hooks: fewbit 0.31 s, remat 0.05 s",
        "wrap-up: 0.15 s after training; plugin hooks: fewbit 0.00 s, remat 0.10 s",
    ]
    plain = dataclasses.replace(summary, setup_time_s=None, training_time_s=None,
                                plugin_setup_s={}, plugin_training_s={}, plugin_wrapup_s={})
    assert format_summary(plain).splitlines()[3] == "fit time: 66.71 s"  # e.g. the Accelerate loop
