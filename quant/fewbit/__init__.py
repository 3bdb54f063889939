"""Few-bit activation gradients (Novikov et al., "Few-Bit Backward: Quantized Gradients of
Activation Functions for Memory Footprint Reduction", ICML 2022).

A pointwise nonlinearity normally keeps its whole input (4 bytes per fp32 element) for backward.
Few-bit activations keep a ``bits``-bit code of which interval the input fell in (0.125-0.5 bytes)
and use an L2-optimal piecewise-constant approximation of the derivative, found by dynamic
programming; forward is bit-identical to torch's::

    from quant.fewbit import FewBitGELU, replace_activations

    report = replace_activations(model, bits=2)   # nn.GELU -> FewBitGELU(bits=2), ...
    print(report)

Pieces: :func:`fit_stepwise` (the DP), :func:`get_table` (shipped and on-demand tables),
``FewBit*`` modules, :mod:`quant.fewbit.functional`, :func:`replace_activations`, and
:class:`SavedTensorsMeter` / :class:`FewBitMemoryMeter` to measure the saving.
"""
from quant.fewbit import functional
from quant.fewbit._checks import SUPPORTED_BITS
from quant.fewbit.activations import ACTIVATIONS, UNSUPPORTED_ACTIVATIONS
from quant.fewbit.fit import StepwiseTable, fit_stepwise, gradient_error
from quant.fewbit.function import FewBitFunction
from quant.fewbit.memory import FewBitMemoryMeter, FewBitMemoryReport, SavedTensorsMeter
from quant.fewbit.modules import (
    FEWBIT_MODULES,
    FewBitCELU,
    FewBitELU,
    FewBitGELU,
    FewBitHardshrink,
    FewBitHardsigmoid,
    FewBitHardswish,
    FewBitHardtanh,
    FewBitLeakyReLU,
    FewBitLogSigmoid,
    FewBitMish,
    FewBitReLU,
    FewBitReLU6,
    FewBitSELU,
    FewBitSiLU,
    FewBitSigmoid,
    FewBitSoftplus,
    FewBitSoftshrink,
    FewBitSoftsign,
    FewBitTanh,
    FewBitTanhshrink,
    FewBitThreshold,
    convert_activation,
)
from quant.fewbit.packing import pack, packed_bytes, unpack
from quant.fewbit.replace import (
    FunctionalCall,
    ReplacedActivation,
    ReplacementReport,
    SkippedActivation,
    replace_activations,
)
from quant.fewbit.tables import get_table

__all__ = [
    "ACTIVATIONS",
    "FEWBIT_MODULES",
    "FewBitCELU",
    "FewBitELU",
    "FewBitFunction",
    "FewBitGELU",
    "FewBitHardshrink",
    "FewBitHardsigmoid",
    "FewBitHardswish",
    "FewBitHardtanh",
    "FewBitLeakyReLU",
    "FewBitLogSigmoid",
    "FewBitMemoryMeter",
    "FewBitMemoryReport",
    "FewBitMish",
    "FewBitReLU",
    "FewBitReLU6",
    "FewBitSELU",
    "FewBitSiLU",
    "FewBitSigmoid",
    "FewBitSoftplus",
    "FewBitSoftshrink",
    "FewBitSoftsign",
    "FewBitTanh",
    "FewBitTanhshrink",
    "FewBitThreshold",
    "FunctionalCall",
    "ReplacedActivation",
    "ReplacementReport",
    "SUPPORTED_BITS",
    "SavedTensorsMeter",
    "SkippedActivation",
    "StepwiseTable",
    "UNSUPPORTED_ACTIVATIONS",
    "convert_activation",
    "fit_stepwise",
    "functional",
    "get_table",
    "gradient_error",
    "pack",
    "packed_bytes",
    "replace_activations",
    "unpack",
]
