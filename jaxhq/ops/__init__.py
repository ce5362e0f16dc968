"""Functional ops: the quantized dense op, grouped dense for MoE, and the GEMM dispatch table."""
from .dense import dense
from .gemm import GemmError, gemm, register
from .grouped import grouped_dense

__all__ = ["dense", "grouped_dense", "gemm", "register", "GemmError"]
