"""Flax linen layers whose GEMMs and attention run under a recipe, with roles named by module path.

See docs/layers.md. Delayed-scaling state lives in the "quant_state" collection, the kernels' amaxes (optional)
in "weight_amax" (jaxhq.layers.state).
"""
from .attention import DotProductAttention, MultiHeadAttention, grad_quantize, quantized_attention, rotary
from .dense import Dense, DenseGeneral, LayerNormDense, quantized_dense
from .intercept import QuantizedModel, quantize_model
from .introspect import model_roles, model_slots
from .mlp import LayerNormMLP
from .moe import MoE, GroupedDense
from .state import QUANT_STATE, WEIGHT_AMAX, merge_quant_state, weight_amax_paths, weight_amaxes
from .transformer import MoEConfig, TransformerLayer

__all__ = ["Dense", "DenseGeneral", "LayerNormDense", "LayerNormMLP", "GroupedDense", "MoE", "MoEConfig",
           "DotProductAttention", "MultiHeadAttention", "TransformerLayer", "quantize_model", "QuantizedModel",
           "model_roles", "model_slots", "merge_quant_state", "QUANT_STATE", "WEIGHT_AMAX", "weight_amaxes",
           "weight_amax_paths", "quantized_dense",
           "quantized_attention", "grad_quantize", "rotary"]
