"""`jaxhq.plan`: the table of every quantized slot with its role, the formats of its two copies and how each
copy is made on the default backend (an FFI kernel or XLA's fusion of the jnp reference)."""
from __future__ import annotations

import dataclasses
from typing import Iterable

import jax

from .formats import COLUMNWISE, ROWWISE, side
from .formats.quantize import act_grad_path, copy_path
from .ops.gemm import decoded_copies, saved_decoded, shares_transposed_copy
from .recipes import CustomRecipe, get
from .roles import QuantizerRole

# Which GEMM reads each copy, per tensor type (DESIGN section 3).
READERS = {"input": ("forward", "wgrad"), "weight": ("forward", "dgrad"), "grad_output": ("dgrad", "wgrad")}


@dataclasses.dataclass(frozen=True)
class PlanRow:
    role: QuantizerRole
    rowwise: str
    columnwise: str
    path: str = ""  # how the copies are made here: "kernel" (+"decoded": bf16 values for a GEMM that dequantizes,
    # jaxhq.ops.gemm.decoded_copies; +"act": an activation's gradient, made from the activation's input and output
    # gradient in the same launch, jaxhq.ops.activation) or "xla" per copy, "rowwise|columnwise"; "rowwise.T": the
    # columnwise copy is the rowwise one read transposed (jaxhq.ops.gemm.shares_transposed_copy)


@dataclasses.dataclass(frozen=True)
class Plan:
    recipe: str
    rows: tuple

    def __str__(self) -> str:
        head = ("module", "tensor", "type", "rowwise (reader)", "columnwise (reader)", "path (row|col)")
        body = []
        for r in self.rows:
            rd = READERS.get(r.role.tensor_type, ("", ""))
            body.append((r.role.name, r.role.tensor_type, r.role.module_type,
                         f"{r.rowwise} ({rd[0]})" if rd[0] else r.rowwise,
                         f"{r.columnwise} ({rd[1]})" if rd[1] else r.columnwise, r.path))
        widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
        fmt = "  ".join("{:<%d}" % w for w in widths)
        lines = [f"recipe: {self.recipe}", fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*row) for row in body]
        return "\n".join(lines)

    def formats(self) -> dict:
        return {r.role: (r.rowwise, r.columnwise) for r in self.rows}


def plan(recipe, roles_or_model: Iterable[QuantizerRole] = (), *example_inputs) -> Plan:
    """Plan of a recipe over a list of roles, or over a Flax model traced with `example_inputs`."""
    from .ffi.dispatch import takes_act_grad
    rec: CustomRecipe = get(recipe)
    acts = {}  # grad_output roles that are an activation's gradient -> its elements (from a traced model)
    if hasattr(roles_or_model, "apply"):
        from .layers.introspect import model_slots, roles_of
        slots = model_slots(roles_or_model, rec, *example_inputs)
        roles = roles_of(slots)
        acts = {s.role: s.size for _, ss in slots for s in ss if s.activation}
    else:
        roles = list(roles_or_model)
    platform = "cpu" if jax.default_backend() == "cpu" else "cuda"
    rows = []
    for role in roles:
        q = rec.quantizer(role)
        # the dense op decodes the copies its GEMMs read at once: the forward's, and both of the gradient; the MoE
        # experts' (grouped_linear) copies likewise (the capacity dispatch runs the dense op per expert; the
        # grouped one decodes the same copies, and for its wgrad along the tokens the input's columnwise one too),
        # and with saved_decoded the backward's copies of the input and the weight
        dense_op = role.module_type in ("linear", "grouped_linear")
        now = (ROWWISE, COLUMNWISE) if role.tensor_type == "grad_output" else (ROWWISE,)
        if dense_op and role.tensor_type != "grad_output":
            now += saved_decoded(q, role.tensor_type, rec.quantizer(dataclasses.replace(role, tensor_type="weight")))
        decoded = decoded_copies(q, now) if dense_op else ()

        shared = dense_op and role.tensor_type == "weight" and shares_transposed_copy(q)
        both = (ROWWISE, COLUMNWISE)
        act = (role in acts and act_grad_path(q, both, acts[role]) == "kernel" and
               takes_act_grad(q, both, platform) and
               all(copy_path(q, a, platform) == "kernel" for a in both))

        def how(a):
            p = copy_path(q, a, platform)
            if a == COLUMNWISE and shared and p == "kernel":
                return "rowwise.T"
            return p + ("+decoded" if p == "kernel" and a in decoded else "") + ("+act" if act else "")
        path = "|".join(how(a) if side(q, a).name != "identity" else "-" for a in both)
        rows.append(PlanRow(role, side(q, ROWWISE).label, side(q, COLUMNWISE).label, path))
    return Plan(rec.name, tuple(rows))
