"""Read a directory written by `lmjax convert` (the `convert` package): an Orbax checkpoint restored
straight into device arrays with their target shardings.

Layout of a converted directory:
  config.json        the HF config, plus an `lmjax` section: {"format": 1, "dtype", "quant", "tp", "source"}
  tokenizer files    tokenizer.json, tokenizer_config.json (chat template inside), ...
  lmjax_orbax/       Orbax (OCDBT) checkpoint of one flat dict {"layers.0.self_attn.q_proj.kernel": array}
                     keyed by the model's NNX parameter paths; quantized linears hold `kernel` + `scale`

Data flow: config.json -> ModelConfig -> the model built abstractly (`nnx.eval_shape`, Linears swapped
for QuantLinears when the `lmjax.quant` entry says so, but those its modules_to_not_convert keeps float)
-> one `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` per parameter (a single device, or
`lmjax.parallel`'s NamedSharding under tp) -> Orbax restores every parameter into exactly those shardings:
TensorStore reads each device's slice and puts it on that device, so no full host copy of a sharded
tensor is ever made. Float parameters are cast to the
requested dtype while restoring; quantized kernels keep their integer dtype.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from lmjax import parallel
from lmjax.layers.quant import QuantSpec, quantize_model
from lmjax.loader import model_loader
from lmjax.loader.awq import checkpoint_module_name
from lmjax.loader.converted_config import conversion_info, converted_quant
from lmjax.loader.safetensors_loader import CheckpointError, read_config
from lmjax.models.registry import ARCHITECTURES, parse_config

ORBAX_SUBDIR = "lmjax_orbax"
FORMAT_VERSION = 1


def is_converted(path: str) -> bool:
    """Whether `path` is a directory written by `lmjax convert`."""
    return os.path.isdir(os.path.join(path, ORBAX_SUBDIR)) and os.path.exists(os.path.join(path, "config.json"))


def param_key(path: tuple) -> str:
    """NNX parameter path -> the flat key it is stored under ("layers.0.mlp.up_proj.kernel")."""
    return ".".join(map(str, path))


def build_abstract(hf_config: dict, dtype, **overrides):
    """(ModelConfig, graphdef, {path: abstract Variable}) of the model a converted config describes."""
    cfg = parse_config(hf_config, **overrides)
    spec = QuantSpec.from_dict(converted_quant(hf_config))  # an AWQ source's skip list included
    arch = ARCHITECTURES[cfg.architecture]
    names = checkpoint_module_name(cfg.architecture)  # matched as when the source was loaded
    model = nnx.eval_shape(lambda: quantize_model(arch.model_cls(cfg, dtype=dtype), spec, abstract=True,
                                                  module_name=names))
    graphdef, state = nnx.split(model)
    return cfg, graphdef, state


def _target_dtype(var, dtype):
    return var.dtype if jnp.issubdtype(var.dtype, jnp.integer) else jnp.dtype(dtype)


def require_orbax(what: str) -> None:
    """A ValueError saying what to install, before any work, when the optional orbax-checkpoint is missing."""
    try:
        import orbax.checkpoint  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{what} needs orbax-checkpoint, which is not installed ({e}): "
                         "pip install 'lmjax[convert]'") from None


def restore_params(path: str, targets: dict) -> dict:
    """Restore the flat {key: jax.ShapeDtypeStruct(..., sharding=...)} from `path`/lmjax_orbax."""
    import orbax.checkpoint as ocp  # optional dependency: `pip install lmjax[convert]`

    ckpt = os.path.abspath(os.path.join(path, ORBAX_SUBDIR))
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        try:
            return checkpointer.restore(ckpt, args=ocp.args.StandardRestore(targets))
        except Exception as e:  # noqa: BLE001  (a damaged file: TensorStore raises a bare Exception)
            # The first line names what is wrong; Orbax / TensorStore append a 100-line dump (kept as __cause__)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            summary = first.split(" See full TensorStore")[0][:300]
            raise CheckpointError(f"cannot restore the converted checkpoint {ckpt}: {summary}") from e


def _host_sharding() -> SingleDeviceSharding | None:
    """The CPU backend's first device, or None where JAX runs without it (JAX_PLATFORMS=cuda): a
    placer then takes each array from the device it was restored on."""
    try:
        return SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    except RuntimeError:
        return None


def load_converted(path: str, dtype: str = "auto", *, placer=None, tp: int = 1, mesh=None,
                   **overrides) -> "model_loader.LoadedModel":
    """`load_model` for a converted directory: same arguments, same result."""
    require_orbax(f"{path} (an lmjax convert directory)")
    hf_config = read_config(path)
    info = conversion_info(hf_config)
    if info.get("format", FORMAT_VERSION) > FORMAT_VERSION:
        raise CheckpointError(f"{path} was converted by a newer lmjax (format {info['format']})")
    cfg = parse_config(hf_config, **overrides)
    if mesh is None and tp > 1:
        parallel.check_tp(cfg, tp)
        mesh = parallel.make_mesh(tp)
    elif mesh is not None:
        parallel.check_tp(cfg, parallel.tp_size(mesh))
    jdtype = model_loader.resolve_dtype(dtype, hf_config)
    cfg, graphdef, state = build_abstract(hf_config, jdtype, **overrides)
    flat = dict(nnx.to_flat_state(state))
    device = SingleDeviceSharding(jax.local_devices()[0])
    host = (_host_sharding() or device) if placer is not None else None

    def sharding(p, var):
        if placer is not None:
            return host  # the caller places: restore on the host, then hand each array over
        if mesh is None:
            return device
        return NamedSharding(mesh, parallel.param_spec(p, var.shape, mesh, cfg))

    targets = {param_key(p): jax.ShapeDtypeStruct(v.shape, _target_dtype(v, jdtype), sharding=sharding(p, v))
               for p, v in flat.items()}
    restored = restore_params(path, targets)
    for p, var in flat.items():
        value = restored[param_key(p)]
        if placer is not None:
            value = placer(p, np.asarray(value))
        var.set_value(value) if hasattr(var, "set_value") else setattr(var, "value", value)
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return model_loader.LoadedModel(model, cfg, hf_config, path, jdtype, mesh)
