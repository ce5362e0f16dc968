"""Quantizer roles and the slot lists of the modules that quantize tensors.

A role names one quantized tensor of a model: `QuantizerRole(module_type, tensor_type, name)`.
A slot is one place in a module where a tensor is quantized; a boundary slot (a module's output or its
grad-input) carries `None` unless the parent wires it to the role of the tensor's consumer.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

MODULE_TYPES = ("linear", "grouped_linear", "dpa")
GEMM_TENSOR_TYPES = ("input", "weight", "grad_output")
DPA_TENSOR_TYPES = ("qkv", "s", "o", "do", "dp", "dqkv")
DPA_FORWARD = ("qkv", "s", "o")
DPA_BACKWARD = ("do", "dp", "dqkv")


@dataclasses.dataclass(frozen=True)
class QuantizerRole:
    module_type: str = ""
    tensor_type: str = ""
    name: str = ""

    def __post_init__(self):
        if self.module_type and self.module_type not in MODULE_TYPES:
            raise ValueError(f"unknown module_type {self.module_type!r} in role; expected one of {MODULE_TYPES}")
        allowed = DPA_TENSOR_TYPES if self.module_type == "dpa" else GEMM_TENSOR_TYPES
        if self.module_type and self.tensor_type and self.tensor_type not in allowed:
            raise ValueError(f"unknown tensor_type {self.tensor_type!r} for module_type {self.module_type!r}; "
                             f"expected one of {allowed}")

    def __str__(self) -> str:
        return f"{self.module_type or '?'}/{self.tensor_type or '?'}@{self.name or '?'}"


@dataclasses.dataclass(frozen=True)
class Slot:
    """A place where a tensor is quantized: its key in the module, direction and role (None: boundary)."""

    key: str
    direction: str  # "forward" or "backward"
    role: Optional[QuantizerRole]
    # grad_output of a dense op with an activation (and no bias): the activation's input gradient, whose copies
    # the kernels make from the activation's input and output gradient (jaxhq.ops.activation)
    activation: Optional[str] = None
    size: Optional[int] = None  # elements of that gradient (where the launch takes it: formats.quantize.act_grad_path)


def gemm_roles(name: str, module_type: str = "linear") -> dict:
    """The three roles of one GEMM module: {"input", "weight", "grad_output"}."""
    return {t: QuantizerRole(module_type, t, name) for t in GEMM_TENSOR_TYPES}


def dense_slots(name: str, output: Optional[QuantizerRole] = None, grad_input: Optional[QuantizerRole] = None,
                module_type: str = "linear", activation: Optional[str] = None, size: Optional[int] = None) -> tuple:
    """Slots of a dense module: forward input, weight and output boundary; backward grad_output (an activation's
    input gradient of `size` elements with `activation`) and grad-input boundary. Boundaries carry the consumer's
    role when the parent knows it, else None."""
    r = gemm_roles(name, module_type)
    return (Slot("input", "forward", r["input"]), Slot("weight", "forward", r["weight"]),
            Slot("output", "forward", output), Slot("grad_output", "backward", r["grad_output"], activation, size),
            Slot("grad_input", "backward", grad_input))


def dpa_slots(name: str) -> tuple:
    return tuple(Slot(t, "forward" if t in DPA_FORWARD else "backward", QuantizerRole("dpa", t, name))
                 for t in DPA_TENSOR_TYPES)
