"""Round-trip error of every format: relative Frobenius error of dequantize(quantize(x)) on N(0,1) data."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from common import parser, print_table, write_json
from jaxhq.formats import (COLUMNWISE, MXFP8, NVFP4, ROWWISE, Float8Block, Float8CurrentScaling, Identity,
                           quantize)

FORMATS = [Float8CurrentScaling("e4m3"), Float8CurrentScaling("e5m2"), MXFP8("e4m3"), MXFP8("e5m2"), NVFP4(),
           NVFP4(block_2d=True), NVFP4(rht=True), NVFP4(stochastic_rounding=True), Float8Block((1, 128)),
           Float8Block((128, 128)), Identity(jnp.bfloat16)]


def main():
    args = parser(__doc__).parse_args()
    n = 512 if args.quick else 4096
    x = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    xn = np.asarray(x, np.float64)
    rows = []
    for q in FORMATS:
        qt = jax.jit(lambda v: quantize(v, q, key=jax.random.PRNGKey(1)))(x)
        r = {"format": q.label, "shape": f"{n}x{n}"}
        for axis in (ROWWISE, COLUMNWISE):
            d = np.asarray(qt.dequantize(axis), np.float64)
            r[f"{axis}_rel_err"] = float(np.linalg.norm(d - xn) / np.linalg.norm(xn))
        r["bytes_per_element"] = qt.rowwise.nbytes() / (n * n)
        rows.append(r)
    print_table(rows, ["format", "shape", "rowwise_rel_err", "columnwise_rel_err", "bytes_per_element"])
    print("wrote", write_json("roundtrip", rows, args.out))


if __name__ == "__main__":
    main()
