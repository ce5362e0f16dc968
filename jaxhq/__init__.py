"""jaxhq: low-precision training for JAX with per-role quantizers and hybrid forward/backward formats."""
from . import formats, ops, recipes, roles
from .formats import (MXFP8, NVFP4, Float8Block, Float8CurrentScaling, Float8DelayedScaling, Hybrid, Identity,
                      QTensor, Quantizer, dequantize, quantize)
from .ops import dense, grouped_dense
from .plan import plan
from .recipes import (CustomRecipe, DenseQuantizers, bf16, fp8_block, fp8_current, fp8_delayed, hybrid, mxfp8,
                      nvfp4)
from .roles import QuantizerRole

__version__ = "0.1.0"

from . import layers  # noqa: E402  (after the ops and recipes it builds on)
from .layers import quantize_model  # noqa: E402
