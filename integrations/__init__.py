"""Thin adapters that put hiremate where people already train.

* :mod:`integrations.lightning` — Lightning callbacks (``HiRemateCallback``, ``FewBitCallback``,
  ``CPCompressionCallback``, ``InterpolatedAdjointCallback``).
* :mod:`integrations.accelerate` — ``HiRematePlugin`` / ``HiRemateAccelerator`` and the
  ``HIREMATE_*`` launcher variables.

Nothing here is imported by the core packages (``remat``, ``quant``, ``ode``).
"""
