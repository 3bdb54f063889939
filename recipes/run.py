"""Command line: ``python -m recipes.run recipes/<name>.yaml [key=value ...] [--check]
[--print-config] [--list]``, the flags anywhere among the arguments.

Loads and validates the recipe (see :func:`recipes.config.load_recipe`) without importing
Lightning, prints one line naming the recipe file and the overrides (the whole resolved config
as YAML with ``--print-config``), builds the plugin callbacks and the Trainer
(:func:`recipes.train.prepare_run`), then builds the model and data and trains (see
:func:`recipes.train.run_recipe`), printing progress lines, a progress bar where stderr is a
terminal, and a final summary. ``--check`` prints the resolved YAML and stops after the
callbacks and the Trainer are built: it makes every check a run makes before training. A bad
recipe prints ``error: <message>`` on stderr and exits with status 2; when the recipe itself is
wrong that happens before Lightning is imported.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Sequence

from recipes.config import RECIPES_DIR, load_recipe, recipe_line, recipe_to_yaml
from recipes.errors import RecipeError
from recipes.registry import available_plugins, available_tasks, get_plugin, get_task

EXIT_BAD_RECIPE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.run",
        description="Train a hiremate recipe: a YAML file plus dotted key=value overrides.",
        epilog="example: python -m recipes.run recipes/gpt_remat.yaml remat.budget=50%% "
        "trainer.max_steps=5",
    )
    parser.add_argument("recipe", nargs="?", help="the recipe YAML, e.g. recipes/cnn_plain.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. trainer.max_steps=5")
    parser.add_argument(
        "--check", action="store_true",
        help="validate and print the resolved recipe, build the callbacks and the Trainer (every "
        "check a run makes before training), then exit",
    )
    parser.add_argument(
        "--print-config", action="store_true",
        help="print the whole resolved recipe as YAML before training (a run prints one line "
        "naming the file and the overrides)",
    )
    parser.add_argument(
        "--list", action="store_true",
        help="list the recipe files, tasks and plugin sections, then exit",
    )
    return parser


def _describe(get, name: str) -> str:
    try:
        return get(name).description
    except (ImportError, RecipeError) as e:  # one broken entry must not hide the others
        return f"(unavailable: {e})"


def recipe_purpose(path: Path) -> str:
    """The one-line purpose of a recipe file: its second line, ``# <purpose>`` (the first line is
    the command that runs it); see "Adding a task" in ``recipes/README.md``."""
    lines = path.read_text().splitlines()
    second = lines[1] if len(lines) > 1 else ""
    if second.startswith("# ") and second[2:].strip():
        return second[2:].strip()
    return "(no purpose line: make the second line '# <what it trains>')"


def _list() -> str:
    files = sorted(RECIPES_DIR.glob("*.yaml"))
    tasks, plugins = available_tasks(), available_plugins()
    width = max(map(len, [p.name for p in files] + tasks + plugins)) + 2
    lines = ["recipes (python -m recipes.run recipes/<file> [key=value ...]):"]
    lines += [f"  {p.name:<{width}}{recipe_purpose(p)}" for p in files]
    lines.append("tasks (task: <name>):")
    lines += [f"  {name:<{width}}{_describe(get_task, name)}" for name in tasks]
    lines.append("plugin sections (<name>.enabled=true):")
    lines += [f"  {name:<{width}}{_describe(get_plugin, name)}" for name in plugins]
    return "\n".join(lines)


def _is_rank_zero() -> bool:
    """Lightning's ``rank_zero_only.rank == 0``, read from the variables its launchers set (DDP
    re-runs this command in every process) without importing Lightning."""
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if key in os.environ:
            return int(os.environ[key]) == 0
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 bad recipe)."""
    parser = _parser()
    # Flags anywhere: `recipe.yaml --check key=value` keeps its overrides.
    args = parser.parse_intermixed_args(argv)
    if args.list:
        print(_list())
        return 0
    if args.recipe is None:
        parser.error("the recipe YAML file is required (see --list for the recipes)")
    try:
        recipe = load_recipe(args.recipe, args.overrides)  # no Lightning imported yet
        if _is_rank_zero() and (args.check or args.print_config):
            shown = " ".join(args.overrides)
            print(f"# resolved recipe: {args.recipe}" + (f" {shown}" if shown else ""))
            print(recipe_to_yaml(recipe), flush=True)
        elif _is_rank_zero():
            print(recipe_line(args.recipe, args.overrides), flush=True)
        try:
            from recipes.stats import ProgressBar
            from recipes.train import check_run, run_recipe
        except ModuleNotFoundError as e:
            raise RecipeError(f"training needs {e.name!r}, which is not installed; install it "
                              'with pip install "hiremate[recipes]"') from e

        if args.check:
            check_run(recipe)
            return 0
        # A 2-core CPU run gains nothing from loader workers; keep the output readable.
        warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
        run_recipe(recipe, progress_bar=_is_rank_zero() and ProgressBar.terminal())
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    return 0


if __name__ == "__main__":
    sys.exit(main())
