"""Optional callback sections of every recipe, one module each (``remat``, ``fewbit``, ...).

Each module defines ``PLUGIN = recipes.registry.Plugin(config=..., make_callback=..., order=...)``;
the module name is the section name. Keep these modules cheap to import (dataclasses only): the
callback itself is imported inside ``make_callback``. See ``recipes/README.md``.
"""
