"""One train step of the GPT sharded on a device mesh (data, fsdp, tensor axes), equal to the unsharded step.

Parameters and optimizer moments are placed by their logical axes (jaxhq.sharding rules), the batch is split
on the batch axis, and FSDP weights are gathered as quantized bytes inside the dense op. On a CPU the example
fakes 8 devices (XLA_FLAGS must be set before jax is imported):

    python examples/sharded_step.py --mesh data=2,fsdp=2,tensor=2
"""
import argparse
import os

if "jax" not in os.sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxhq.sharding import make_mesh  # noqa: E402
from jaxhq.train import data, model, sharded, state  # noqa: E402


def main(mesh_spec: str = "data=2,fsdp=2,tensor=2", recipe: str = "mxfp8", model_name: str = "tiny",
         steps: int = 3, batch_size: int = 8) -> dict:
    sizes = {k: int(v) for k, v in (p.split("=") for p in mesh_spec.split(","))}
    mesh = make_mesh(**sizes)
    cfg = model.preset(model_name)
    ds = data.load(data.DataConfig(batch_size=batch_size, seq_len=cfg.seq_len))
    fresh = state.create(model.GPT(cfg, state.named_recipe(recipe)), state.make_optimizer(steps=steps))
    st = sharded.shard_train_state(fresh, mesh)
    kernel = st.params["layers_0"]["mlp"]["fc1"]["kernel"] if "mlp" in st.params["layers_0"] else None
    losses, ref_losses = [], []
    with sharded.mesh_context(mesh):
        for i in range(steps):
            st, m = state.train_step(st, sharded.shard_batch(ds.train_batch(i), mesh))
            losses.append(float(m["loss"]))
    ref = fresh
    for i in range(steps):
        ref, m = state.train_step(ref, ds.train_batch(i))
        ref_losses.append(float(m["loss"]))
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(st.params), jax.tree.leaves(ref.params)))
    print(f"mesh {dict(mesh.shape)} on {len(mesh.devices.flat)} {jax.devices()[0].platform} devices, {recipe}")
    if kernel is not None:
        print(f"layers_0.mlp.fc1 kernel {kernel.shape} placed as {kernel.sharding.spec}")
    print("sharded losses:  ", [round(l, 5) for l in losses])
    print("unsharded losses:", [round(l, 5) for l in ref_losses])
    print(f"max |weight difference| after {steps} steps: {diff:.2e}")
    return {"losses": losses, "ref_losses": ref_losses, "max_param_diff": diff,
            "fc1_spec": None if kernel is None else tuple(kernel.sharding.spec)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="data=2,fsdp=2,tensor=2")
    p.add_argument("--recipe", default="mxfp8")
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    main(a.mesh, a.recipe, a.model, a.steps)
