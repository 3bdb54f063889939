"""Thin adapters that put hiremate where people already train.

* :mod:`integrations.lightning` — Lightning callbacks (``HiRemateCallback``, ``FewBitCallback``,
  ``CPCompressionCallback``, ``InterpolatedAdjointCallback``).
* :mod:`integrations.accelerate` — ``HiRematePlugin`` / ``HiRemateAccelerator``, the
  ``HIREMATE_*`` launcher variables and the launcher for unedited scripts:
  ``HIREMATE_BUDGET=70% accelerate launch -m integrations.accelerate train.py``.

Nothing here is imported by the core packages (``remat``, ``quant``, ``ode``).
"""
