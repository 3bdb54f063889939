"""Command line: ``python -m recipes.run recipes/<name>.yaml [key=value ...] [--check] [--list]``.

Loads and validates the recipe (see :func:`recipes.config.load_recipe`), prints the resolved
config as YAML, then builds everything and trains (see :func:`recipes.train.run_recipe`), printing
progress lines and a final summary. A bad recipe prints ``error: <message>`` on stderr and exits
with status 2 before anything is built.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from typing import Sequence

from recipes.config import load_recipe, recipe_to_yaml
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
        "--check", action="store_true", help="validate and print the resolved recipe, then exit"
    )
    parser.add_argument(
        "--list", action="store_true", help="list the tasks and plugin sections, then exit"
    )
    return parser


def _describe(get, name: str) -> str:
    try:
        return get(name).description
    except (ImportError, RecipeError) as e:  # one broken entry must not hide the others
        return f"(unavailable: {e})"


def _list() -> str:
    tasks, plugins = available_tasks(), available_plugins()
    width = max(map(len, tasks + plugins)) + 2
    lines = ["tasks (task: <name>):"]
    lines += [f"  {name:<{width}}{_describe(get_task, name)}" for name in tasks]
    lines.append("plugin sections (<name>.enabled=true):")
    lines += [f"  {name:<{width}}{_describe(get_plugin, name)}" for name in plugins]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 bad recipe)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        print(_list())
        return 0
    if args.recipe is None:
        parser.error("the recipe YAML file is required (see --list for tasks)")
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        from lightning.pytorch.utilities import rank_zero_only

        if rank_zero_only.rank == 0:  # DDP re-runs this command in every process
            shown = " ".join(args.overrides)
            print(f"# resolved recipe: {args.recipe}" + (f" {shown}" if shown else ""))
            print(recipe_to_yaml(recipe), flush=True)
        if args.check:
            return 0
        from recipes.train import run_recipe

        # A 2-core CPU run gains nothing from loader workers; keep the output readable.
        warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
        run_recipe(recipe)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    return 0


if __name__ == "__main__":
    sys.exit(main())
