"""Convert at tp = 4 and restore on 8 forced CPU devices, in a fresh process (the device count must be
set before jax is imported); prints one JSON line.

    python tests/convert/tp_restore_driver.py '{"src": DIR, "out": DIR, "tp": 4, "quant": null}'

Reports, per parameter, whether it arrived with `lmjax.parallel`'s sharding, each device holding only
its own slice, and the largest host array handed to a device while restoring (a full host copy of a
sharded tensor would show up there); plus greedy tokens at tp and from the source at tp = 1.
"""
import json
import os
import sys

SPEC = json.loads(sys.argv[1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={SPEC.get('devices', 8)}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from convert import convert_checkpoint  # noqa: E402
from lmjax import parallel  # noqa: E402
from lmjax.loader.model_loader import load_model  # noqa: E402
from lmjax.models.forward import greedy_generate  # noqa: E402


def _recording_device_put(log: list):
    real = jax.device_put

    def device_put(x, *args, **kwargs):
        for leaf in jax.tree.leaves(x):
            log.append(tuple(np.shape(leaf)))
        return real(x, *args, **kwargs)
    return real, device_put


def main() -> None:
    tp, prompts = SPEC["tp"], SPEC.get("prompts", [[1, 2, 3, 4], [5, 6, 7]])
    convert_checkpoint(SPEC["src"], SPEC["out"], dtype="float32", tp=tp, quant=SPEC.get("quant"),
                       group_size=SPEC.get("group_size"))
    log: list = []
    real, recording = _recording_device_put(log)
    jax.device_put = recording
    try:
        loaded = load_model(SPEC["out"], "float32", tp=tp)
    finally:
        jax.device_put = real
    mesh = loaded.mesh
    params = []
    for path, var in nnx.to_flat_state(nnx.state(loaded.model)):
        array = var[...]
        want = NamedSharding(mesh, parallel.param_spec(path, array.shape, mesh, loaded.config))
        shards = array.addressable_shards
        params.append({
            "path": ".".join(map(str, path)), "shape": list(array.shape), "dtype": str(array.dtype),
            "sharded": not want.is_fully_replicated, "shard_shape": list(want.shard_shape(array.shape)),
            "sharding_ok": array.sharding.is_equivalent_to(want, array.ndim),
            "devices_ok": sorted(s.device.id for s in shards) == sorted(d.id for d in mesh.devices.flat),
            "shard_shapes_ok": all(s.data.shape == want.shard_shape(array.shape) for s in shards),
        })
    tokens = greedy_generate(loaded.model, prompts, 8)
    reference = load_model(SPEC.get("reference", SPEC["out"]), "float32")
    print(json.dumps({"params": params, "device_put_shapes": [list(s) for s in log], "tokens": tokens,
                      "tokens_tp1": greedy_generate(reference.model, prompts, 8),
                      "devices": jax.device_count()}), flush=True)


if __name__ == "__main__":
    main()
