"""Quantization-aware CP factorization of Conv2d and Linear layers by ADMM.

Cherniuk, Abukhovich, Phan, Oseledets, Cichocki, Gusak, "Quantization Aware Factorization for
Deep Neural Network Compression" (2023): find CP factors directly on a few-bit grid instead of
decomposing then quantizing, and replace each layer by the equivalent sequence of small layers.

    from quant.cp import compress_model, load_compressed

    report = compress_model(model, rate=2.0, bits=4, example_inputs=x[:1])
    print(report.summary())
    torch.save(model.state_dict(), "compressed.pt")   # int8 codes + scales
    load_compressed(build_model(), torch.load("compressed.pt"))

Layers too small for the rate are skipped, and layers whose quantized CP model has a large error
are named in a warning: tiny first convs (1-3 input channels) and classifiers usually lose most
accuracy, so ``exclude=[...]`` them. With Lightning,
``integrations.lightning.CPCompressionCallback`` compresses at fit start, at a step or at fit
end, and fine-tunes the factors.

Lower level: :func:`quantized_cp` (returns a :class:`CPResult`), :func:`cp_then_quantize` (the
baseline), :func:`cp_als` (norm-controlled float CP), :class:`CPConv2d` / :class:`CPLinear`
(``from_conv`` / ``from_linear``), :func:`plan_compression`, :func:`apply_plan`,
:func:`solve_compressed`, :func:`add_flops`, :func:`plan_from_state_dict`.
"""
from .admm import INITS, CPResult, cp_then_quantize, quantized_cp
from .compress import (
    LAYERS,
    add_flops,
    apply_plan,
    compress_model,
    load_compressed,
    plan_from_state_dict,
    solve_compressed,
    stored_trainable,
    warn_high_error,
    warn_skipped,
)
from .cp_als import CPALSResult, cp_als
from .factor import QuantizedFactor
from .grid import qbounds, search_scale
from .layers import CPConv2d, CPLinear, rank_for_rate
from .plan import KINDS, CompressionPlan, PlannedLayer, plan_compression
from .report import CompressionReport, LayerReport, SkippedLayer

__all__ = [
    "CPALSResult",
    "CPConv2d",
    "CPLinear",
    "CPResult",
    "CompressionPlan",
    "CompressionReport",
    "INITS",
    "KINDS",
    "LAYERS",
    "LayerReport",
    "PlannedLayer",
    "QuantizedFactor",
    "SkippedLayer",
    "add_flops",
    "apply_plan",
    "compress_model",
    "cp_als",
    "cp_then_quantize",
    "load_compressed",
    "plan_compression",
    "plan_from_state_dict",
    "qbounds",
    "quantized_cp",
    "rank_for_rate",
    "search_scale",
    "solve_compressed",
    "stored_trainable",
    "warn_high_error",
    "warn_skipped",
]
