"""HF directory or GGUF file -> a converted directory that restores fast, straight into device shards.

Data flow of `convert_checkpoint`:
  lmjax's own loader reads SRC into host (CPU-device) arrays of `dtype`, one tensor at a time
  -> optional weight-only quantization: w8 and `w4_method="rtn"` round to nearest
     (`lmjax.layers.quant.quantize_model`); w4 by default is AWQ (or GPTQ) over a calibration text
     (`convert.calibrate`, on a float32 copy, the result stored in `dtype`)
  -> with tp > 1, each array is laid out over tp CPU devices by `lmjax.parallel`'s rules, so Orbax
     writes one storage chunk per tensor-parallel shard (a tp restore then reads whole chunks only)
  -> written into a temporary directory beside OUT: lmjax_orbax/ (Orbax, OCDBT), config.json (with an
     `lmjax` section: format, dtype, quant, tp, source), tokenizer files and chat template
  -> renamed to OUT in one `os.rename`. An interrupted conversion leaves at most a `.OUT.tmp-*`
     directory, never a loadable OUT (and removes even that when it can: on any exception).

The reader is `lmjax.loader.orbax_loader` (lmjax never imports this package).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from lmjax import parallel
from lmjax.layers.quant import QuantSpec, quantize_model
from lmjax.loader.model_loader import load_model
from lmjax.loader.orbax_loader import CONFIG_KEY, FORMAT_VERSION, ORBAX_SUBDIR, param_key
from lmjax.loader.resolve import resolve_model_path

logger = logging.getLogger("convert")

DTYPES = ("float32", "bfloat16", "float16")
W4_METHODS = ("awq", "gptq", "rtn")
# Files of an HF directory that travel with the weights (tokenizer, chat template, generation defaults).
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
               "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
               "generation_config.json")


def convert_checkpoint(src: str, out: str, dtype: str = "bfloat16", tp: int = 1, quant: str | None = None,
                       group_size: int = 128, overwrite: bool = False, w4_method: str = "awq",
                       calib_text: str | None = None, quant_lm_head: str | None = None) -> str:
    """Convert `src` (HF directory, .gguf file or model id) into the directory `out`; returns its path.

    dtype: storage (and default compute) dtype of the float parameters. tp: the tensor-parallel size
    the storage chunks are laid out for (restore works at any tp). quant: None, "w8" or "w4"
    (`group_size` input rows per int4 scale). w4_method: "awq" (activation-aware scales, round to
    nearest, least-squares group parameters) or "gptq", both calibrated on `calib_text` (a text file;
    default: lmjax.calibration_text), or "rtn" (round to nearest, no calibration). All write the same
    layout. quant_lm_head: None (the lm_head stays float, as vLLM and LMDeploy keep it), "w8" or "w4"
    (rounded to nearest; a tied lm_head becomes its own weight beside the float embedding)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {DTYPES}")
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    if quant_lm_head and not quant:
        raise ValueError(f"quant_lm_head={quant_lm_head!r} needs quant (w8 or w4) for the rest of the model")
    spec = QuantSpec(quant, group_size, quant_lm_head) if quant else None
    if w4_method not in W4_METHODS:
        raise ValueError(f"w4_method={w4_method!r} is not supported; choose one of {W4_METHODS}")
    calibrated = w4_method if spec is not None and spec.method == "w4" and w4_method != "rtn" else None
    text = _read_text(calib_text) if calibrated else None
    path = os.path.abspath(resolve_model_path(src))
    out = os.path.abspath(os.path.expanduser(out))
    if os.path.exists(out) and not overwrite:
        raise FileExistsError(f"{out} already exists (pass overwrite=True / --overwrite to replace it)")
    os.makedirs(os.path.dirname(out), exist_ok=True)

    params, loaded = _read(path, dtype, tp, spec, calibrated, text)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(out))
    try:
        _save_params(os.path.join(tmp, ORBAX_SUBDIR), params)
        _write_config(tmp, loaded.hf_config, dict(format=FORMAT_VERSION, dtype=dtype, tp=tp, source=path,
                                                  quant=_quant_info(spec, calibrated, calib_text)))
        _write_tokenizer(tmp, path)
        _commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s -> %s (dtype=%s, tp=%d, quant=%s)", path, out, dtype, tp, quant)
    return out


def _read_text(calib_text: str | None) -> str | None:
    if calib_text is None:
        return None  # lmjax.calibration_text
    if not os.path.isfile(calib_text):
        raise ValueError(f"calibration text calib_text={calib_text!r} is not a file")
    with open(calib_text, encoding="utf-8") as f:
        return f.read()


def _quant_info(spec: QuantSpec | None, calibrated: str | None, calib_text: str | None) -> dict | None:
    """The `quant` entry of config.json: the layout (QuantSpec) and, for the record, how it was made."""
    if spec is None:
        return None
    how = {"algorithm": calibrated, "calibration": calib_text or "builtin"} if calibrated else {"algorithm": "rtn"}
    return {**spec.to_dict(), **how}


def _read(path: str, dtype: str, tp: int, spec: QuantSpec | None, calibrated: str | None = None,
          text: str | None = None):
    """({key: array}, LoadedModel): parameters on CPU devices, quantized (w4 calibrated by the method
    `calibrated` over `text`, None: the built-in calibration text), laid out for tp."""
    cpu = jax.local_devices(backend="cpu")
    # Calibration runs its forward passes in float32 (bf16 matmuls are slow on CPU) and rounds the stored
    # scales to `dtype` itself; every float parameter is cast to `dtype` afterwards.
    loaded = load_model(path, "float32" if calibrated else dtype, placer=lambda p, a: jax.device_put(a, cpu[0]))
    if calibrated:
        from convert.calibrate import calibrate_w4, calibration_prompts
        from lmjax.loader.tokenizer import load_tokenizer

        prompts = calibration_prompts(load_tokenizer(path), text)
        calibrate_w4(loaded.model, spec, prompts, method=calibrated, param_dtype=jnp.dtype(dtype))
    else:
        quantize_model(loaded.model, spec)
    flat = {p: _as_dtype(v[...], dtype) for p, v in nnx.to_flat_state(nnx.state(loaded.model))}
    if tp == 1:
        return {param_key(p): a for p, a in flat.items()}, loaded
    parallel.check_tp(loaded.config, tp)
    if len(cpu) < tp:
        logger.warning("tp=%d but only %d CPU device(s): storage chunks are not split per shard (set "
                       "XLA_FLAGS=--xla_force_host_platform_device_count=%d; `lmjax convert` does)",
                       tp, len(cpu), tp)
        return {param_key(p): a for p, a in flat.items()}, loaded
    mesh = Mesh(np.array(cpu[:tp]), (parallel.TP_AXIS,))
    params = {}
    for p, a in flat.items():
        spec_ = parallel.param_spec(p, a.shape, mesh, loaded.config)
        params[param_key(p)] = jax.device_put(a, NamedSharding(mesh, spec_))
    return params, loaded


def _as_dtype(array: jax.Array, dtype: str) -> jax.Array:
    """Float parameters in the storage dtype; integer (quantized) kernels as they are."""
    return array.astype(dtype) if jnp.issubdtype(array.dtype, jnp.floating) else array


def _save_params(directory: str, params: dict) -> None:
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        checkpointer.save(directory, args=ocp.args.StandardSave(params))


def _write_config(directory: str, hf_config: dict, info: dict) -> None:
    config = {k: v for k, v in hf_config.items() if k != CONFIG_KEY}
    config["torch_dtype"] = info["dtype"]  # `dtype="auto"` on an accelerator then means the stored dtype
    config[CONFIG_KEY] = info
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _write_tokenizer(directory: str, path: str) -> None:
    """Copy an HF directory's tokenizer files; save a GGUF's tokenizer (chat template included)."""
    if os.path.isdir(path):
        copied = [n for n in _SIDE_FILES if os.path.exists(os.path.join(path, n))]
        for name in copied:
            shutil.copy2(os.path.join(path, name), os.path.join(directory, name))
        if not any(n.startswith(("tokenizer", "vocab")) for n in copied):
            logger.warning("%s has no tokenizer files: the converted model needs a tokenizer path", path)
        return
    from lmjax.loader.tokenizer import load_tokenizer

    load_tokenizer(path).save_pretrained(directory)


def _commit(tmp: str, out: str) -> None:
    """Move the finished conversion into place in one rename (an old OUT goes only after that)."""
    if not os.path.exists(out):
        os.rename(tmp, out)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
    os.rename(out, os.path.join(old, "x"))
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
