"""Recipe tasks, one module each; a recipe selects one with ``task: <module name>``.

Each module defines ``TASK = recipes.registry.Task(model=..., data=..., build=..., description=...)``.
Modules whose name starts with ``_`` are private helpers, not tasks. See ``recipes/README.md``.
"""
