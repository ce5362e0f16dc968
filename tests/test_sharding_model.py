"""Helpers for the sharding tests (no tests here): a 2-layer pre-norm MLP block stack written with
jaxhq.ops.dense and grouped_dense, its training step, and the unsharded reference step.

Layer i: h += down_i(gelu(up_i(rmsnorm(h)))); with `experts`, layer 1's MLP is a 2-expert grouped dense
(tokens split half and half). Kernels carry logical axes (embed, mlp, expert); activations (batch, length, ...).
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import jaxhq
from jaxhq import recipes
from jaxhq.sharding import DEFAULT_RULES, constrain, expert_sharding, mesh_axes, weight_sharding

# Kernel dims are not powers of two and token counts are, so no activation has a (gathered) kernel's shape;
# shards stay whole blocks: 384 / 4 fsdp = 96 and 640 / 4 tp = 160 are multiples of 32 (and of 16).
D, F, B, L, G = 384, 640, 8, 32, 2
AXES = {"up": ("embed", "mlp"), "down": ("mlp", "embed"), "scale": ("embed",),
        "eup": ("expert", "embed", "mlp"), "edown": ("expert", "mlp", "embed")}
LR = 0.1


def init_params(seed: int = 0, experts: bool = False):
    ks = iter(jax.random.split(jax.random.key(seed), 16))
    params = {}
    for i in range(2):
        p = {"scale": 1.0 + 0.1 * jax.random.normal(next(ks), (D,))}
        if experts and i == 1:
            p["eup"] = jax.random.normal(next(ks), (G, D, F)) * D ** -0.5
            p["edown"] = jax.random.normal(next(ks), (G, F, D)) * F ** -0.5
        else:
            p["up"] = jax.random.normal(next(ks), (D, F)) * D ** -0.5
            p["down"] = jax.random.normal(next(ks), (F, D)) * F ** -0.5
        params[f"layers_{i}"] = p
    x = jax.random.normal(next(ks), (B, L, D))
    y = jax.random.normal(next(ks), (B, L, D))
    return params, (x, y)


def _rmsnorm(h, scale):
    h32 = h.astype(jnp.float32)
    return (h32 * jax.lax.rsqrt(jnp.mean(h32 ** 2, axis=-1, keepdims=True) + 1e-6) * scale).astype(h.dtype)


def _ws(names, name, mesh):
    return None if mesh is None else weight_sharding(names, name, mesh=mesh)


def _es(names, name, mesh):
    return None if mesh is None else expert_sharding(names, name, mesh=mesh)


def _c(x, names, mesh):
    return x if mesh is None else constrain(x, names, mesh)


def loss_fn(params, batch, recipe, key, mesh=None, hook=True):
    """Mean squared error of the 2-layer stack; `mesh` adds the sharding hook (hook=False: plain XLA gathers)."""
    x, y = batch
    h = _c(x, ("batch", "length", "embed"), mesh)
    wmesh = mesh if hook else None
    for i in range(2):
        p, name = params[f"layers_{i}"], f"layers_{i}"
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        n = _rmsnorm(h, p["scale"])
        if "up" in p:
            u = jaxhq.dense(n, p["up"], quantizers=recipe.dense_quantizers(f"{name}.up"), key=k1,
                            weight_sharding=_ws(AXES["up"], f"{name}.up", wmesh))
            u = jax.nn.gelu(_c(u, ("batch", "length", "mlp"), mesh))
            d = jaxhq.dense(u, p["down"], quantizers=recipe.dense_quantizers(f"{name}.down"), key=k2,
                            weight_sharding=_ws(AXES["down"], f"{name}.down", wmesh))
        else:
            t = n.reshape(-1, D)
            sizes = jnp.array([t.shape[0] // 2, t.shape[0] - t.shape[0] // 2], jnp.int32)
            qs_up = [recipe.dense_quantizers(f"{name}.experts_{g}.up", "grouped_linear") for g in range(G)]
            qs_dn = [recipe.dense_quantizers(f"{name}.experts_{g}.down", "grouped_linear") for g in range(G)]
            u = jax.nn.gelu(jaxhq.grouped_dense(t, p["eup"], sizes, quantizers=qs_up, key=k1,
                                                expert_sharding=_es(AXES["eup"], f"{name}.eup", wmesh)))
            d = jaxhq.grouped_dense(u, p["edown"], sizes, quantizers=qs_dn, key=k2,
                                    expert_sharding=_es(AXES["edown"], f"{name}.edown", wmesh)).reshape(h.shape)
        h = h + _c(d, ("batch", "length", "embed"), mesh)
    return jnp.mean((h.astype(jnp.float32) - y) ** 2)


# Justified tolerance. Quantization under sharding is bit-exact and the dense op differs from the unsharded
# one only by fp32 summation order (test_sharding.py checks both, the latter against a rigorous bound), but a
# whole step chains layers: an ulp difference in one layer's output is re-quantized by the next, where a value
# within an ulp of a rounding boundary flips to the neighbouring code. Block formats with power-of-two scales
# (MXFP8) or per-block scales absorb this: observed <= 0.08 of the recipe's own quantization error, most leaves
# ~1e-6. Per-tensor current scaling amplifies it: every flip nudges every downstream element, so the tensor's
# amax, hence its continuous scale, hence the rounding of all its elements move (the forward of 2 transformer
# layers under (fsdp 2, tp 4) differs by 1.4e-3 relative in fp8_current and 6e-8 in mxfp8); observed up to
# 0.56 of the quantization error under tensor parallelism. A sharding bug (wrong gather layout, missing or
# doubled reduction, per-shard scales) gives an error uncorrelated with the unsharded one, ~1-1.4x the
# quantization error or far more. Bound per leaf: NOISE_FRACTION (0.5; 1.0 for per-tensor recipes) x the
# recipe's error against the exact (bf16 recipe, fp32) step, plus 1e-6 relative.
# Under sequence parallelism the copies of a length-split grad_output are quantized in shard-major order
# (jaxhq/sharding/sequence.py), so stochastic rounding (NVFP4 gradients) draws other random numbers than unsharded:
# the two steps hold independent samples of that noise, whose difference is up to sqrt(2) times it, and it is
# part of the recipe's error: bound 1.5x that error (observed up to 1.0x for hybrid:mxfp8:nvfp4, whose error is
# mostly this noise). test_sequence_parallel.py checks the same ops without stochastic rounding within the
# summation-order bound.
NOISE_FRACTION, PER_TENSOR_NOISE_FRACTION, STOCHASTIC_SP_NOISE_FRACTION, FP32_RTOL = 0.5, 1.0, 1.5, 1e-6


def rounds_stochastically(recipe) -> bool:
    """Whether the recipe's gradients (grad_output copies) round stochastically."""
    from jaxhq.formats import USAGES, side
    q = recipe.dense_quantizers("layers_0.mlp.fc2").grad_output
    return any(getattr(side(q, a), "stochastic_rounding", False) for a in USAGES)


def noise_fraction(recipe_name: str, sequence_parallel: bool = False) -> float:
    if sequence_parallel and rounds_stochastically(recipes.get(recipe_name)):
        return STOCHASTIC_SP_NOISE_FRACTION
    return PER_TENSOR_NOISE_FRACTION if recipe_name in ("fp8_current", "fp8_delayed") else NOISE_FRACTION


def assert_close(got, want, exact, what, fraction=NOISE_FRACTION):
    """|got - want| <= fraction |want - exact| + FP32_RTOL |want| (Frobenius norms), see above."""
    got, want, exact = (np.asarray(a, np.float64) for a in (got, want, exact))
    diff, noise = np.linalg.norm(got - want), np.linalg.norm(want - exact)
    bound = fraction * noise + FP32_RTOL * np.linalg.norm(want)
    assert diff <= bound, (f"{what}: sharded - unsharded = {diff:.3e} > {bound:.3e} "
                           f"(the recipe's quantization error is {noise:.3e})")


def order_bound(a, b):
    """Bound on |fl(a @ b) - fl'(a @ b)| for two summation orders (any tree, across devices too): each is within
    K u |a_i|.|b_j| <= K u ||a_i|| ||b_j|| of the exact product (Higham), u = 2^-24; the GEMM reads dequantized
    operands whose row norms exceed the inputs' by < 1.5x (FP4's worst rounding up is 6/5 per element, RHT
    is orthonormal), hence 2 x 1.5^2 = 4.5 < 8."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return 8 * a.shape[1] * 2.0 ** -24 * np.outer(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=0))


def activation_gathers(hlo, tensor=1):
    """All-gathers of anything but a kernel copy, told apart by element count: a copy holds D F / tensor
    elements over 1, 2 (packed FP4), 16, 32, 128, 256 or 128^2 (block scales), in whatever 2D shape the backend
    gathers it (XLA's GPU backend gathers along the major dim, [shards * F, D / shards], then transposes);
    norm scales are 1D. D = 3 * 128 and F = 5 * 128 are not powers of two and token counts (32..256) are, so
    no activation (or its scales) has such a count."""
    from jaxhq.sharding.hlo import collectives
    counts = {D * F // (t * u) for t in {1, tensor} for u in (1, 2, 16, 32, 128, 256, 128 * 128)}
    return [c for c in collectives(hlo, "all-gather") if len(c.shape) != 1 and math.prod(c.shape) not in counts]


def param_shardings(params, mesh, rules=DEFAULT_RULES):
    return {l: {n: NamedSharding(mesh, mesh_axes(AXES[n], rules, mesh)) for n in p} for l, p in params.items()}


def batch_sharding(mesh, rules=DEFAULT_RULES):
    s = NamedSharding(mesh, mesh_axes(("batch", "length", "embed"), rules, mesh))
    return (s, s)


def step_fn(recipe, key, mesh=None, hook=True):
    """One SGD training step: (params, batch) -> (loss, grads, new params)."""
    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, recipe, key, mesh, hook)
        return loss, grads, jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return step


def sharded_step(recipe, key, mesh, params, hook=True):
    """The jitted sharded step, lowered and compiled for `params`' shapes; inputs placed on the mesh."""
    ps, bs = param_shardings(params, mesh), batch_sharding(mesh)
    jitted = jax.jit(step_fn(recipe, key, mesh, hook), in_shardings=(ps, bs), out_shardings=(None, ps, ps))
    return jitted, ps, bs


@functools.lru_cache(maxsize=None)
def reference(recipe_name: str, experts: bool = False, seed: int = 0):
    """The unsharded step on one device (numpy outputs), cached per recipe."""
    params, batch = init_params(seed, experts)
    loss, grads, new = jax.jit(step_fn(recipes.get(recipe_name), jax.random.key(seed + 1)))(params, batch)
    return jax.tree.map(np.asarray, (loss, grads, new))


# -- a 2-layer stack of jaxhq.layers.TransformerLayer ------------------------------------------------------
TD, TH, TF = 128, 4, 256


def transformer_stack(recipe, heads=TH, d_ff=TF, kv_heads=None):
    import flax.linen as nn
    from jaxhq.layers import TransformerLayer

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(2):
                x = TransformerLayer(num_heads=heads, d_ff=d_ff, num_kv_heads=kv_heads, recipe=recipe,
                                     name=f"layers_{i}")(x)
                x = constrain(x, ("batch", "length", "embed"))  # no-op without a mesh
            return x

    return Stack()


def transformer_init(seed: int = 0, shape=(B, L, TD), **stack):
    """(boxed params, params, (x, y)) of `transformer_stack(**stack)` for activations of `shape`."""
    import flax.linen as nn
    ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(ks[0], shape)
    y = jax.random.normal(ks[1], shape)
    boxed = transformer_stack(recipes.bf16(), **stack).init({"params": ks[2]}, x)["params"]
    return boxed, nn.unbox(boxed), (x, y)


def transformer_step(recipe, key):
    model = transformer_stack(recipe)

    def loss(p, batch):
        out = model.apply({"params": p}, batch[0], rngs={"quant": key})
        return jnp.mean((out.astype(jnp.float32) - batch[1]) ** 2)

    return jax.jit(jax.value_and_grad(loss))


@functools.lru_cache(maxsize=None)
def transformer_reference(recipe_name: str, seed: int = 0):
    _, params, batch = transformer_init(seed)
    return jax.tree.map(np.asarray, transformer_step(recipes.get(recipe_name), jax.random.key(seed + 1))(params,
                                                                                                         batch))
