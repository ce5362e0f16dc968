"""Train state: master weights under optax, delayed-scaling state merging, stochastic-rounding keys,
train/eval alternation, recipe change mid-training. A micro GPT (1 layer, d_model 32) keeps it fast."""
import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhq import recipes
from jaxhq.train import data, model as M, state as S

CFG = M.preset("micro")
NAMED = ["bf16", "fp8_current", "fp8_delayed", "mxfp8", "nvfp4", "fp8_block", "hybrid:mxfp8:nvfp4"]


@pytest.fixture(scope="module")
def ds():
    return data.load(data.DataConfig(batch_size=2, seq_len=CFG.seq_len, max_bytes=300_000, chunk=1024,
                                     val_every=10))


grads_of = jax.jit(S.loss_and_grads)


def make(recipe, steps=20, seed=0):
    return S.create(M.GPT(CFG, S.named_recipe(recipe)), S.make_optimizer(1e-2, steps, 2), seed)


def leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_cross_entropy_matches_float64_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
    t = rng.integers(0, 7, size=(2, 5))
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    ref = (lse - np.take_along_axis(logits.astype(np.float64), t[..., None], -1)[..., 0]).mean()
    np.testing.assert_allclose(float(S.cross_entropy(jnp.asarray(logits), jnp.asarray(t))), ref, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_embedding_lookup_and_gradient_match_numpy(dtype):
    """The byte embedding: rows of the table (an out-of-range token gives a zero row), cast once to the
    activation dtype; its gradient the float64 scatter-add of the incoming gradient (exact products, float32
    sums: 1e-6 relative)."""
    rng = np.random.default_rng(1)
    table = rng.normal(size=(256, 48)).astype(np.float32)
    tokens = rng.integers(0, 256, size=(3, 40))
    tokens[0, :5] = 7  # a repeated token sums its gradients
    tokens[1, 0] = 300
    g = rng.normal(size=(3, 40, 48)).astype(np.float32)
    want = np.where((tokens < 256)[..., None], table[np.minimum(tokens, 255)], 0.0)
    out = jax.jit(M.embed, static_argnums=2)(jnp.asarray(table), jnp.asarray(tokens), dtype)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                  np.asarray(jnp.asarray(want).astype(dtype).astype(jnp.float32)))
    gd = np.asarray(jnp.asarray(g).astype(dtype).astype(jnp.float32), np.float64)
    ref = np.zeros(table.shape)
    ok = tokens < 256
    np.add.at(ref, tokens[ok], gd[ok])
    grad = jax.jit(jax.grad(lambda t: jnp.sum(M.embed(t, jnp.asarray(tokens), dtype).astype(jnp.float32) *
                                              jnp.asarray(gd, jnp.float32))))(jnp.asarray(table))
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(grad), ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_same_seed_same_initial_weights_under_every_recipe():
    a, b = make("bf16"), make("hybrid:mxfp8:nvfp4")
    assert leaves_equal(a.params, b.params)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(a.params))  # fp32 master weights
    assert not leaves_equal(a.params, make("bf16", seed=1).params)


def test_train_step_applies_optax_to_the_gradient(ds):
    st = make("mxfp8")
    batch = ds.train_batch(0)
    loss, _, grads = grads_of(st, batch)
    upd, _ = st.tx.update(grads, st.opt_state, st.params)
    want = jax.tree.map(lambda p, u: p + u, st.params, upd)
    new, metrics = S.train_step(st, batch)
    assert float(metrics["loss"]) == float(loss) and int(new.step) == 1
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(new.params)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)
    assert float(S.eval_step(st, batch)["loss"]) == pytest.approx(float(loss), rel=1e-6)


@pytest.mark.parametrize("recipe", ["fp8_delayed", "nvfp4"])
def test_donated_step_matches_and_consumes_its_argument(ds, recipe):
    """The run loop's step (state donated) makes the same next state as train_step and frees the one it got
    (fp8_delayed: the amax histories are written over their own buffers; nvfp4: the stochastic-rounding key)."""
    batch = ds.train_batch(0)
    want, wm = S.train_step(make(recipe), batch)
    given = make(recipe)
    got, gm = S.donated_train_step(given, batch)
    assert float(gm["loss"]) == pytest.approx(float(wm["loss"]), rel=1e-6)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)
    assert all(x.is_deleted() for x in jax.tree.leaves(given.params))


@pytest.mark.parametrize("recipe", NAMED)
def test_every_recipe_learns(ds, recipe):
    st = make(recipe)
    val = ds.val_batches(2)
    before = S.evaluate(st, val)
    for i in range(12):
        st, m = S.train_step(st, ds.train_batch(i))
        assert np.isfinite(float(m["loss"]))
    assert S.evaluate(st, val) < before - 0.5  # from ~ln(256)=5.5 down by well over half a nat


def _find(tree, key):
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [getattr(p, "key", None) for p in path]
        if key in names:
            out.append((names, x))
    return out


def test_delayed_scaling_state_takes_forward_and_backward_amaxes(ds):
    st = make("fp8_delayed")
    assert st.quant_state, "fp8_delayed keeps state"
    new, _ = S.train_step(st, ds.train_batch(0))
    hist = {tuple(n): np.asarray(x) for n, x in _find(new.quant_state, "amax_history")}
    assert hist
    for names, h in hist.items():
        assert h[0] > 0 and np.all(h[1:] == 0), names  # one amax recorded, in the newest slot
    # Weight slots recorded max |kernel| of the master weights before the step (numpy reference).
    flat = {tuple(getattr(p, "key", None) for p in path): np.asarray(x)
            for path, x in jax.tree_util.tree_flatten_with_path(st.params)[0]}
    for names, h in hist.items():
        if "weight" in names:
            module = names[:names.index("weight")]
            kernels = [v for k, v in flat.items() if k[:len(module)] == module and k[-1] == "kernel"]
            assert kernels, names
            assert h[0] == np.float32(np.abs(kernels[0]).max()), names
    assert any("grad_output" in n for n in hist)  # backward slots came through the gradient


def test_stochastic_rounding_key_is_folded_with_the_step(ds):
    batch = ds.train_batch(0)
    st = make("nvfp4")
    _, _, g0 = grads_of(st, batch)
    _, _, g0b = grads_of(st, batch)
    _, _, g1 = grads_of(st.replace(step=st.step + 1), batch)
    assert leaves_equal(g0, g0b)  # deterministic for one step
    assert not leaves_equal(g0, g1)  # another step draws other rounding
    m = make("mxfp8")
    assert leaves_equal(grads_of(m, batch)[2],
                        grads_of(m.replace(step=m.step + 1), batch)[2])


@pytest.mark.parametrize("recipe", NAMED)
def test_train_eval_alternation_is_bit_identical(ds, recipe):
    """train, eval, train, eval, eval, train == the same three train steps without the evals."""
    val = ds.val_batches(1)[0]
    a = b = make(recipe)
    la, lb = [], []
    for op in ["train", "eval", "train", "eval", "eval", "train"]:
        if op == "train":
            a, m = S.train_step(a, ds.train_batch(len(la)))
            la.append(float(m["loss"]))
        else:
            assert np.isfinite(float(S.eval_step(a, val)["loss"]))
    for i in range(3):
        b, m = S.train_step(b, ds.train_batch(i))
        lb.append(float(m["loss"]))
    assert la == lb
    assert leaves_equal(a.params, b.params) and leaves_equal(a.opt_state, b.opt_state)
    assert leaves_equal(a.quant_state, b.quant_state)


def test_with_recipe_mid_training(ds):
    from jaxhq import plan
    st = make("fp8_current")
    tokens = jnp.zeros((1, CFG.seq_len), jnp.int32)
    losses = []
    for i, (rec, fmt) in enumerate([("fp8_current", "fp8"), ("fp8_delayed", "fp8"), ("mxfp8", "mxfp8"),
                                    ("hybrid:mxfp8:nvfp4", "nvfp4")]):
        if i:
            before = st.params
            st = st.with_recipe(rec)
            assert leaves_equal(before, st.params) and int(st.step) == 2 * i
        assert st.recipe.name == rec
        assert bool(st.quant_state) == (rec == "fp8_delayed")  # state only where the recipe keeps one
        labels = " ".join(f"{r.rowwise} {r.columnwise}" for r in plan(st.recipe, st.model, tokens).rows)
        assert fmt in labels.lower()
        for _ in range(2):
            st, m = S.train_step(st, ds.train_batch(int(st.step)))
            losses.append(float(m["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recipe", ["fp8_current", "nvfp4", "hybrid:mxfp8:nvfp4"])
def test_weight_amax_from_the_update_is_exact(ds, recipe, dtype):
    """The kernels' amaxes the state carries (computed in the step whose update wrote the kernels) give the same
    steps, bit for bit, as a reduction over each kernel inside the step (the collection left out: the layers
    then take their own amax pass); after each step they are the new params' own. Exact because a max is, and
    the cast to the model's dtype rounds monotonically (bfloat16: the amax of the cast kernel is the cast amax)."""
    st = S.create(M.GPT(CFG.replace(dtype=dtype), S.named_recipe(recipe)), S.make_optimizer(1e-2, 20, 2), 0)
    bare = st.replace(weight_amax={})
    for i in range(3):
        st, m1 = S.train_step(st, ds.train_batch(i))
        bare, m2 = S.train_step(bare, ds.train_batch(i))
        bare = bare.replace(weight_amax={})
        assert float(m1["loss"]) == float(m2["loss"]) and leaves_equal(st.params, bare.params), i
        assert leaves_equal(st.weight_amax, S.weight_amaxes(st.params, S.collection_paths(st.weight_amax)))
        assert leaves_equal(st.with_params(st.params).weight_amax, st.weight_amax)


@pytest.mark.parametrize("recipe,used", [("fp8_current", True), ("nvfp4", True), ("mxfp8", False),
                                         ("fp8_delayed", False)])
def test_weight_amax_is_read_where_a_weight_copy_takes_one(ds, recipe, used, monkeypatch):
    """The state carries the amaxes of the kernels whose weight copies take a per-tensor amax before quantizing
    (FP8 current scaling and NVFP4: all of them; MXFP8 and delayed scaling: none, so no reduction is added to
    their steps), and the layers read them (a wrong amax changes the loss); under JAXHQ_WEIGHT_AMAX=0 (read at
    trace time) they do not."""
    st = make(recipe)
    kernels = {k[:-1] for k in flax.traverse_util.flatten_dict(st.params) if k[-1] == "kernel"}
    assert set(S.collection_paths(st.weight_amax)) == (kernels if used else set())  # every dense kernel, or none
    wrong = st.replace(weight_amax=jax.tree.map(lambda a: a * 3.0, st.weight_amax))  # not a power of 2
    batch = ds.train_batch(0)
    loss = lambda s: float(S.eval_step(s, batch)["loss"])  # noqa: E731
    assert (loss(st) == loss(wrong)) != used
    monkeypatch.setenv("JAXHQ_WEIGHT_AMAX", "0")
    jax.clear_caches()  # traced again, reading the switch
    assert loss(st) == loss(wrong)


def test_logged_step_keeps_its_buffers(ds):
    """The run loop's step writes the new state and loss log into the buffers it was given (donated) and reads
    only arrays the loop keeps, so from the second step on every input and output stays at its device address:
    what lets XLA replay the step's CUDA graphs without recording them again (docs/training.md). Its batch is
    the one data.train_batch gives for the state's step: its loss is train_step's on that batch (two programs,
    which XLA may fuse differently: rtol 1e-6, about 10 float32 ulps of these losses)."""
    st = S.create(M.GPT(CFG, S.named_recipe("bf16")), S.make_optimizer(1e-2, 20, 2))
    tokens, starts = jax.device_put(ds.train), jax.device_put(ds.train_starts_table(0, 4))
    log = jax.device_put(np.zeros(16, np.float32))
    ptrs = lambda t: [x.unsafe_buffer_pointer() for x in jax.tree.leaves(t)]  # noqa: E731
    st, log = S.logged_train_step(st, log, tokens, starts, ds.config.seq_len)  # the first may copy the log in
    for i in range(1, 3):
        before = ptrs((st, log))
        _, want = S.train_step(st, ds.train_batch(i))
        st, log = S.logged_train_step(st, log, tokens, starts, ds.config.seq_len)
        assert ptrs((st, log)) == before
        np.testing.assert_allclose(float(log[i]), float(want["loss"]), rtol=1e-6)
