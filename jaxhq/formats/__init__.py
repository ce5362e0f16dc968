"""Formats: quantizers, the quantized-tensor pytree and the reference numerics (plain jnp)."""
from .base import COLUMNWISE, ROWWISE, USAGES, QTensor, QuantizationError, Quantizer, Storage
from .fp8 import Float8CurrentScaling, Float8DelayedScaling
from .fp8_block import Float8Block
from .hybrid import Hybrid, side
from .identity import Identity
from .mxfp8 import MXFP8
from .nvfp4 import NVFP4
from .quantize import ActivationGrad, dequantize, fake_quantize, init_state, normalize, quantize, update_state

__all__ = ["COLUMNWISE", "ROWWISE", "USAGES", "QTensor", "QuantizationError", "Quantizer", "Storage",
           "Float8CurrentScaling", "Float8DelayedScaling", "Float8Block", "Hybrid", "Identity", "MXFP8", "NVFP4",
           "ActivationGrad", "dequantize", "fake_quantize", "init_state", "normalize", "quantize", "update_state",
           "side"]
