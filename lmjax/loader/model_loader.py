"""load_model: any supported checkpoint (HF directory or GGUF file) -> a ready Flax model.

Path resolution -> HF config dict -> ModelConfig (with engine overrides) -> tensors renamed to HF Llama
names by the architecture's weight map -> parameters filled one tensor at a time. An AWQ checkpoint
(`quantization_config.quant_method == "awq"`) builds w4 QuantLinears and converts each Linear's
qweight / qzeros / scales into them as they stream by (lmjax.loader.awq); the Linears its
`modules_to_not_convert` names stay float and load their plain `weight`. With tp > 1 (or a
mesh), each tensor goes straight into its shards (`lmjax.parallel.make_placer`). The seconds of each
load phase go to the log and to `LoadedModel.load_seconds`.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from lmjax import parallel
from lmjax.layers.quant import quantize_model
from lmjax.loader.awq import awq_spec, awq_tensors, checkpoint_module_name
from lmjax.loader.gguf import gguf_config, load_gguf
from lmjax.loader.phases import PhaseTimes
from lmjax.loader.resolve import resolve_model_path
from lmjax.loader.safetensors_loader import iter_tensors, read_config
from lmjax.loader.weights import Placer, load_params
from lmjax.models.config import ModelConfig
from lmjax.models.registry import ARCHITECTURES, parse_config

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
logger = logging.getLogger("lmjax.engine")
_CHECKPOINT_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                      "torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


@dataclasses.dataclass
class LoadedModel:
    model: nnx.Module
    config: ModelConfig
    hf_config: dict
    path: str
    dtype: jnp.dtype
    mesh: Mesh | None = None  # the tp mesh the parameters are sharded over (None: one device)
    # Seconds per load phase (lmjax.loader.phases): init (the device backend's start), build, read,
    # convert, place, transpose, sync, merge, and the load's total wall and cpu seconds.
    load_seconds: dict = dataclasses.field(default_factory=dict)


def resolve_dtype(dtype: str, hf_config: dict, is_gguf: bool = False):
    """'auto' = the checkpoint's dtype on accelerators; float32 on CPU, where bf16 matmuls are slow and
    parity with transformers' float32 reference is the point. GGUF is dequantized: bf16 on accelerators."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; choose 'auto' or one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    if jax.default_backend() == "cpu":
        return jnp.float32
    declared = hf_config.get("torch_dtype") or hf_config.get("dtype")
    name = "bfloat16" if is_gguf else _CHECKPOINT_DTYPES.get(str(declared), "bfloat16")
    return DTYPES[name]


def _checkpoint(path: str):
    """(hf_config, tensor iterator, source name) for a directory or a .gguf file."""
    if os.path.isdir(path):
        return read_config(path), lambda: iter_tensors(path), path
    if path.endswith(".gguf"):
        config, weights = load_gguf(path, np.float32)
        return config, lambda: iter(weights.items()), path
    raise ValueError(f"model path {path!r} is neither a checkpoint directory nor a .gguf file")


def read_model_config(model: str | None = None, **overrides) -> ModelConfig:
    """The model's config without its weights (a directory's config.json, `lmjax convert`'s included, or a
    GGUF file's metadata), to check settings against it before a load of seconds to minutes."""
    path = resolve_model_path(model)
    hf_config = read_config(path) if os.path.isdir(path) or not path.endswith(".gguf") else gguf_config(path)
    return parse_config(hf_config, **overrides)


def load_model(model: str | None = None, dtype: str = "auto", *, placer: Placer | None = None, tp: int = 1,
               mesh: Mesh | None = None, **overrides) -> LoadedModel:
    """Load a model. `overrides`: TurboMind's rope_scaling_factor, use_dynamic_ntk, use_logn_attn.

    tp > 1 builds a mesh over the first tp devices (`mesh` gives one instead) and loads every tensor
    straight into its shards by `lmjax.parallel`'s rules; `placer` overrides the placement.
    """
    times = PhaseTimes()
    with times.phase("init"):
        parallel.initialize_distributed()  # before the backend starts: the LMJAX_* variables alone join processes
        jax.local_devices()  # the backend's start (a GPU client and its memory pool): not the checkpoint's
    path = resolve_model_path(model)
    loaded = _load(path, dtype, placer, tp, mesh, times, overrides)
    loaded.load_seconds = times.summary()
    logger.info("loaded %s in %s", path, times.describe())
    return loaded


def _load(path: str, dtype: str, placer: Placer | None, tp: int, mesh: Mesh | None, times: PhaseTimes,
          overrides: dict) -> LoadedModel:
    from lmjax.loader import orbax_loader  # a directory written by `lmjax convert`

    if orbax_loader.is_converted(path):
        with times.phase("restore"):
            return orbax_loader.load_converted(path, dtype, placer=placer, tp=tp, mesh=mesh, **overrides)
    with times.phase("read"):
        hf_config, tensors, source = _checkpoint(path)  # a GGUF file is read and dequantized here
    cfg = parse_config(hf_config, **overrides)
    if mesh is None and tp > 1:
        parallel.check_tp(cfg, tp)  # before touching devices: a clear error for heads that do not fit
        mesh = parallel.make_mesh(tp)
    elif mesh is not None:
        parallel.check_tp(cfg, parallel.tp_size(mesh))
    jdtype = resolve_dtype(dtype, hf_config, path.endswith(".gguf"))
    arch = ARCHITECTURES[cfg.architecture]
    if placer is None and mesh is not None:
        placer = parallel.make_placer(mesh, cfg)
    kwargs = {"placer": placer} if placer is not None else {}
    spec = awq_spec(hf_config)
    # AWQ first: its (kernel, scale, offset) are [in, out]-major, which a fused projection's split must know
    named = arch.tensor_map(awq_tensors(tensors(), spec) if spec is not None else tensors(), cfg)
    names = checkpoint_module_name(cfg.architecture)  # modules_to_not_convert names the checkpoint's modules
    net = load_params(lambda: quantize_model(arch.model_cls(cfg, dtype=jdtype), spec, abstract=True,
                                             module_name=names), named, jnp.dtype(jdtype), source, times=times,
                      **kwargs)
    return LoadedModel(net, cfg, hf_config, path, jdtype, mesh)
