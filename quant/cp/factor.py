"""One quantized CP factor as a module: int8 codes and a scale, or a trainable latent copy.

See NOTE [ Two storage forms ].
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ._checks import check_bits, internal_assert
from .grid import qbounds, to_codes

__all__ = ["QuantizedFactor"]

# NOTE [ Two storage forms ]
# A factor is ``scale * codes`` with ``codes`` integers in [-2^(b-1), 2^(b-1) - 1].
# * frozen (the deployable form): buffers ``codes`` (int8) and ``scale``; no parameters.
# * trainable (for fine-tuning): a float Parameter ``latent`` and the buffer ``scale``. The forward
#   value is the latent rounded onto the grid, so a trainable factor computes exactly what the
#   frozen one with ``codes = round(latent / scale)`` computes; gradients reach ``latent`` by the
#   straight-through estimator (Bengio et al., 2013), zero where the latent is clamped (as in LSQ,
#   Esser et al., ICLR 2020). The scale stays fixed during fine-tuning.
# ``state_dict`` holds whichever form the module is in (``codes`` int8, or ``latent`` float, plus
# ``scale`` and the bit width as extra state), and ``load_state_dict`` accepts either form in
# either module: codes become ``latent = scale * codes``; a latent is rounded to codes. Switching
# forms (``freeze``/``unfreeze``) replaces the tensors, so do it before building an optimizer.


class QuantizedFactor(nn.Module):
    """A CP factor ``scale * codes`` of shape ``(rows, rank)`` on a ``bits``-bit symmetric grid.

    Cherniuk et al., "Quantization Aware Factorization for Deep Neural Network Compression"
    (2023): factors live on the grid, so the deployed layer stores ``bits`` per value.

    Args:
        rows: size of the mode this factor belongs to.
        rank: CP rank ``R``.
        bits: bit width in ``[2, 8]``.
        trainable: hold a float ``latent`` Parameter (fake-quantized in forward) instead of the
            int8 ``codes`` buffer. See NOTE [ Two storage forms ].
        device: device of the tensors.
        dtype: float dtype of ``scale`` (and ``latent``); the output follows it.

    Example:
        >>> f = QuantizedFactor(6, 2, bits=4)
        >>> f().shape, f.codes.dtype
        (torch.Size([6, 2]), torch.int8)
    """

    def __init__(
        self,
        rows: int,
        rank: int,
        *,
        bits: int,
        trainable: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.bits = check_bits(bits)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.register_buffer("scale", torch.ones((), device=device, dtype=dtype))
        if trainable:
            self.latent = nn.Parameter(torch.zeros(rows, rank, device=device, dtype=dtype))
        else:
            self.register_buffer("codes", torch.zeros(rows, rank, device=device, dtype=torch.int8))

    @property
    def trainable(self) -> bool:
        """Whether the factor holds a trainable ``latent`` (else int8 ``codes``)."""
        return "latent" in self._parameters

    @property
    def shape(self) -> torch.Size:
        """``(rows, rank)``."""
        return (self.latent if self.trainable else self.codes).shape

    def int_codes(self) -> Tensor:
        """The integer codes as an ``int8`` tensor (rounded from ``latent`` when trainable)."""
        if self.trainable:
            return to_codes(self.latent.detach(), self.scale, self.bits).to(torch.int8)
        return self.codes

    def forward(self) -> Tensor:
        """The factor ``scale * codes`` in the dtype of ``scale``; shape ``(rows, rank)``."""
        if not self.trainable:
            return self.codes.to(self.scale.dtype) * self.scale
        qmin, qmax = qbounds(self.bits)
        clamped = torch.clamp(self.latent, qmin * self.scale, qmax * self.scale)
        value = to_codes(clamped.detach(), self.scale, self.bits) * self.scale
        # straight-through: forward is exactly `value`, gradient is d(clamped)/d(latent)
        return value + (clamped - clamped.detach())

    @torch.no_grad()
    def set_(self, codes: Tensor, scale: float) -> None:
        """Overwrite the values in place (same tensors, so an existing optimizer stays valid)."""
        qmin, qmax = qbounds(self.bits)
        internal_assert(tuple(codes.shape) == tuple(self.shape),
                        f"codes of shape {tuple(codes.shape)} for a factor of shape "
                        f"{tuple(self.shape)}")
        internal_assert(int(codes.min()) >= qmin and int(codes.max()) <= qmax,
                        f"codes outside the {self.bits}-bit range")
        self.scale.fill_(scale)
        if self.trainable:
            self.latent.copy_(codes.to(self.latent.dtype) * self.scale)
        else:
            self.codes.copy_(codes)

    def freeze(self) -> QuantizedFactor:
        """Switch to the frozen form (int8 ``codes`` buffer); returns ``self``."""
        if self.trainable:
            codes = self.int_codes().clone()
            del self.latent
            self.register_buffer("codes", codes)
        return self

    def unfreeze(self) -> QuantizedFactor:
        """Switch to the trainable form (float ``latent`` Parameter); returns ``self``."""
        if not self.trainable:
            latent = self.codes.to(self.scale.dtype) * self.scale
            del self.codes
            self.latent = nn.Parameter(latent)
        return self

    def get_extra_state(self) -> dict[str, Any]:
        return {"bits": self.bits}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.bits = check_bits(state["bits"], name="state_dict bits")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):  # noqa: D401 - torch hook signature
        # NOTE [ Two storage forms ]: convert the stored form to this module's form.
        codes_key, latent_key = prefix + "codes", prefix + "latent"
        extra = state_dict.get(prefix + "_extra_state")
        bits = extra["bits"] if isinstance(extra, dict) and "bits" in extra else self.bits
        scale = state_dict.get(prefix + "scale", self.scale)
        if self.trainable and codes_key in state_dict and latent_key not in state_dict:
            codes = state_dict.pop(codes_key)
            state_dict[latent_key] = codes.to(self.latent.dtype) * scale.to(self.latent.dtype)
        elif not self.trainable and latent_key in state_dict and codes_key not in state_dict:
            latent = state_dict.pop(latent_key)
            state_dict[codes_key] = to_codes(latent, scale.to(latent.dtype), bits).to(torch.int8)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        rows, rank = self.shape
        return f"rows={rows}, rank={rank}, bits={self.bits}, trainable={self.trainable}"
