"""Quantized training helpers.

* :mod:`quant.fewbit` — few-bit activation gradients (Novikov et al., ICML 2022).
* :mod:`quant.cp` — quantization-aware CP factorization of conv/linear layers by ADMM
  (Cherniuk et al., 2023).

Import from the sub-packages: ``from quant.fewbit import replace_activations``.
"""
