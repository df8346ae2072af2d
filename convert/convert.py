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
  -> renamed to OUT in one `os.rename`. An interrupted conversion leaves at most a `.OUT.tmp-HOST-PID-*`
     directory, never a loadable OUT. On any exception (Ctrl-C included) it waits for Orbax's writer
     threads and removes it; one left by a killed run (SIGKILL, a power cut) is removed by the next
     conversion of the same OUT on that host, once its PID is gone.

An SRC that is already quantized (a w8 / w4 conversion, an AWQ checkpoint) converts only to its own layout
(re-saved as it is: another dtype for its float parameters, another tp layout); any other request is an
error, since dequantizing and rounding again would compound two roundings. `overwrite` replaces only an
OUT that is a conversion or an empty directory, never one holding SRC.

The reader is `lmjax.loader.orbax_loader` (lmjax never imports this package).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from lmjax import parallel
from lmjax.layers.quant import QuantSpec, quantize_model
from lmjax.loader.awq import awq_spec
from lmjax.loader.model_loader import load_model, read_model_config
from lmjax.loader.converted_config import CONFIG_KEY, converted_quant
from lmjax.loader.orbax_loader import FORMAT_VERSION, ORBAX_SUBDIR, is_converted, param_key, require_orbax
from lmjax.loader.resolve import resolve_model_path
from lmjax.loader.safetensors_loader import read_config

from convert import staging

logger = logging.getLogger("convert")

DTYPES = ("float32", "bfloat16", "float16")
W4_METHODS = ("awq", "gptq", "rtn")
GROUP_SIZE = 128  # convert_checkpoint's default group_size
# How long an interrupted save waits for Orbax's writer threads before removing what they write.
WRITER_WAIT_S = 60.0
# Files of an HF directory that travel with the weights (tokenizer, chat template, generation defaults).
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
               "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
               "generation_config.json")
_TEMPLATES_DIR = "additional_chat_templates"


def convert_checkpoint(src: str, out: str, dtype: str = "bfloat16", tp: int = 1, quant: str | None = None,
                       group_size: int | None = None, *, overwrite: bool = False, w4_method: str | None = None,
                       calib_text: str | None = None, quant_lm_head: str | None = None) -> str:
    """Convert `src` (HF directory, .gguf file or model id) into the directory `out`; returns its path.

    dtype: storage (and default compute) dtype of the float parameters. tp: the tensor-parallel size
    the storage chunks are laid out for (restore works at any tp). quant: None, "w8" or "w4"
    (`group_size` input rows per int4 scale, default 128). w4_method (default "awq"): "awq"
    (activation-aware scales, round to nearest, least-squares group parameters) or "gptq", both calibrated
    on `calib_text` (a text file; default: lmjax.calibration_text), or "rtn" (round to nearest, no
    calibration). All write the same layout. quant_lm_head: None (the lm_head stays float, as vLLM and
    LMDeploy keep it), "w8" or "w4" (rounded to nearest; a tied lm_head becomes its own weight beside the
    float embedding). An option the request would ignore (a group_size without w4, a w4_method without
    quant="w4", ...) is a ValueError. An already-quantized `src` converts only to its own quant layout,
    re-saved as it is. overwrite: replace an `out` that is a
    conversion or an empty directory."""
    spec, calibrated = _check_options(dtype, tp, quant, group_size, w4_method, calib_text, quant_lm_head)
    require_orbax("lmjax convert")
    path = os.path.abspath(resolve_model_path(src))
    if tp > 1:  # (from the config alone: before a load and a calibration of minutes)
        parallel.check_tp(read_model_config(path), tp)
    out = os.path.abspath(os.path.expanduser(out))
    stored = _stored_quant(path, spec, w4_method, calib_text)
    prompts = _calibration_prompts(path, _read_text(calib_text)) if calibrated and stored is None else None
    _check_out(path, out, overwrite)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    staging.sweep_stale(out)

    if stored is not None:  # SRC's quantized weights, as they are
        params, loaded = _read(path, dtype, tp, None)
        quant_info = stored
    else:
        params, loaded = _read(path, dtype, tp, spec, calibrated, prompts)
        quant_info = _quant_info(spec, calibrated, calib_text)
    tmp = staging.make_tmp(out)
    try:
        _save_params(os.path.join(tmp, ORBAX_SUBDIR), params)
        _write_config(tmp, loaded.hf_config, dict(format=FORMAT_VERSION, dtype=dtype, tp=tp, source=path,
                                                  quant=quant_info))
        _write_tokenizer(tmp, path)
        _check_out(path, out, overwrite)  # again: OUT may have appeared (another run, a user) meanwhile
        staging.commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s -> %s (dtype=%s, tp=%d, quant=%s)", path, out, dtype, tp, quant)
    return out


def _check_options(dtype: str, tp: int, quant: str | None, group_size: int | None, w4_method: str | None,
                   calib_text: str | None, quant_lm_head: str | None) -> tuple[QuantSpec | None, str | None]:
    """(QuantSpec or None, the calibration method or None) of valid options; a ValueError naming the value
    otherwise."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {DTYPES}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be an int >= 1")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)):
        raise ValueError(f"group_size={group_size!r} must be an int")
    if quant_lm_head and not quant:
        raise ValueError(f"quant_lm_head={quant_lm_head!r} needs quant (w8 or w4) for the rest of the model")
    if w4_method is not None and w4_method not in W4_METHODS:
        raise ValueError(f"w4_method={w4_method!r} is not supported; choose one of {W4_METHODS}")
    _check_unused(quant, group_size, w4_method, calib_text, quant_lm_head)
    spec = QuantSpec(quant, GROUP_SIZE if group_size is None else group_size, quant_lm_head) if quant else None
    w4_method = w4_method or W4_METHODS[0]
    calibrated = w4_method if spec is not None and spec.method == "w4" and w4_method != "rtn" else None
    return spec, calibrated


def _check_unused(quant: str | None, group_size: int | None, w4_method: str | None, calib_text: str | None,
                  quant_lm_head: str | None) -> None:
    """An option this request would not use is an error rather than silently ignored (the user expects
    it to act); None is "not given"."""
    if group_size is not None and "w4" not in (quant, quant_lm_head):
        raise ValueError(f"group_size={group_size} (--group-size) applies to w4 only, but quant={quant!r} and "
                         f"quant_lm_head={quant_lm_head!r}")
    if w4_method is not None and quant != "w4":
        raise ValueError(f"w4_method={w4_method!r} (--w4-method) applies to quant='w4' only, but quant={quant!r}")
    if calib_text is not None and (quant != "w4" or w4_method == "rtn"):  # awq by default
        raise ValueError(f"calib_text={calib_text!r} (--calib-text) applies to quant='w4' with w4_method 'awq' "
                         f"or 'gptq' only, but quant={quant!r} and w4_method={w4_method!r}")


def _source_quant(path: str) -> dict | None:
    """The quant record of SRC's weights when they are already quantized: a conversion's `lmjax.quant`
    entry, or an AWQ checkpoint's w4 layout; None for float weights (a GGUF is dequantized when read)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None  # a .gguf file (or a directory load_model reports as unreadable)
    hf_config = read_config(path)
    if is_converted(path):
        return converted_quant(hf_config)
    awq = awq_spec(hf_config)
    return {**awq.to_dict(), "algorithm": "awq", "calibration": "AWQ checkpoint"} if awq else None


def _stored_quant(path: str, spec: QuantSpec | None, w4_method: str | None, calib_text: str | None) -> dict | None:
    """SRC's quant record when its weights are already quantized in exactly the layout `spec` asks for
    (they are then re-saved as they are); None for a float SRC. Any other request on a quantized SRC is
    a ValueError: the loader hands over SRC's quantized layers, which neither quantize_model nor the
    calibration touch, so config.json would describe a layout the checkpoint does not hold."""
    source = _source_quant(path)
    if not source:
        return None
    have = QuantSpec.from_dict(source)
    if spec is None or spec.with_skip(have.skip) != have:  # no option names a skip list: SRC's goes along
        raise ValueError(f"SRC {path} is already quantized ({_describe(have)}); convert from the float "
                         f"checkpoint it was made from, or ask for its own layout to re-save it as it is "
                         f"({_flags(have)})")
    made_by = source.get("algorithm")
    # Nothing is calibrated or rounded again: only a method that says so (or the default) fits.
    unused = [f"calib_text={calib_text!r}"] if calib_text is not None else []
    unused += [f"w4_method={w4_method!r}"] if w4_method not in (None, "rtn", made_by) else []
    if unused:
        raise ValueError(f"SRC {path} is already quantized ({_describe(have)}, by {made_by}) and is re-saved "
                         f"as it is: {' and '.join(unused)} cannot apply")
    logger.info("%s is already quantized (%s): re-saving its weights as they are", path, _describe(have))
    return source


def _describe(spec: QuantSpec) -> str:
    group = f", group_size {spec.group_size}" if "w4" in (spec.method, spec.lm_head) else ""
    head = f", lm_head {spec.lm_head}" if spec.lm_head else ""
    return f"{spec.method}{group}{head}"


def _flags(spec: QuantSpec) -> str:
    """The `lmjax convert` options that ask for `spec`."""
    group = f" --group-size {spec.group_size}" if "w4" in (spec.method, spec.lm_head) else ""
    head = f" --quant-lm-head {spec.lm_head}" if spec.lm_head else ""
    return f"--quant {spec.method}{group}{head}"


def _check_out(path: str, out: str, overwrite: bool) -> None:
    """OUT must not exist; with `overwrite`, it may be a conversion or an empty directory, which the
    commit then replaces, but never SRC or a directory holding it, nor a directory of other files."""
    if not os.path.lexists(out):
        return
    real_out = os.path.realpath(out)
    if os.path.commonpath([os.path.realpath(path), real_out]) == real_out:  # (before suggesting --overwrite)
        raise ValueError(f"OUT {out} is SRC {path} or holds it: overwrite would delete the source; "
                         f"write the conversion elsewhere")
    if not overwrite:
        raise FileExistsError(f"{out} already exists (pass overwrite=True / --overwrite to replace it)")
    if not (is_converted(out) or (os.path.isdir(out) and not os.listdir(out))):
        raise ValueError(f"OUT {out} is neither an lmjax conversion nor an empty directory: overwrite replaces "
                         f"only those (remove it yourself if you mean to)")
    logger.warning("%s exists: replacing it (overwrite)", out)


def _read_text(calib_text: str | None) -> str | None:
    if calib_text is None:
        return None  # lmjax.calibration_text
    if not os.path.isfile(calib_text):
        raise ValueError(f"calibration text calib_text={calib_text!r} is not a file")
    try:
        with open(calib_text, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"calibration text calib_text={calib_text!r} is not UTF-8 text: {e}") from None


def _quant_info(spec: QuantSpec | None, calibrated: str | None, calib_text: str | None) -> dict | None:
    """The `quant` entry of config.json: the layout (QuantSpec) and, for the record, how it was made."""
    if spec is None:
        return None
    how = {"algorithm": calibrated, "calibration": calib_text or "builtin"} if calibrated else {"algorithm": "rtn"}
    return {**spec.to_dict(), **how}


def _calibration_prompts(path: str, text: str | None) -> list:
    """The calibration text (None: the built-in one) as the model's token ids: a text too short fails here."""
    from convert.calibrate import calibration_prompts
    from lmjax.loader.tokenizer import load_tokenizer

    return calibration_prompts(load_tokenizer(path), text)


def _read(path: str, dtype: str, tp: int, spec: QuantSpec | None, calibrated: str | None = None,
          prompts: list | None = None):
    """({key: array}, LoadedModel): parameters on CPU devices, quantized (w4 calibrated by the method
    `calibrated` over `prompts`), laid out for tp."""
    cpu = jax.local_devices(backend="cpu")
    # Calibration runs its forward passes in float32 (bf16 matmuls are slow on CPU) and rounds the stored
    # scales to `dtype` itself; every float parameter is cast to `dtype` afterwards.
    loaded = load_model(path, "float32" if calibrated else dtype, placer=lambda p, a: jax.device_put(a, cpu[0]))
    if calibrated:
        from convert.calibrate import calibrate_w4

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

    before = set(threading.enumerate())
    try:
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
            checkpointer.save(directory, args=ocp.args.StandardSave(params))
    except BaseException:
        # A Ctrl-C stops only this thread: Orbax's writer threads go on writing (recreating directories)
        # under `directory`, and the caller's rmtree, racing them, would leave their tree behind. The
        # checkpointer is closed by now (no new work starts); wait for what runs.
        _join(set(threading.enumerate()) - before, WRITER_WAIT_S)
        raise


def _join(threads: set, timeout: float) -> None:
    """Wait up to `timeout` seconds in all for `threads` to end."""
    deadline = time.monotonic() + timeout
    for thread in threads:
        while True:
            try:
                thread.join(max(0.0, deadline - time.monotonic()))
                break
            except RuntimeError:  # threading.enumerate lists a thread in limbo: started, not yet running
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
    if any(t.is_alive() for t in threads):
        logger.warning("Orbax writer threads still run after %.0f s: the next conversion of this OUT removes "
                       "what they leave", timeout)


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
        templates = os.path.join(path, _TEMPLATES_DIR)
        if os.path.isdir(templates):  # named chat templates (tool_use, ...) that transformers saves apart
            shutil.copytree(templates, os.path.join(directory, _TEMPLATES_DIR))
        if not any(n.startswith(("tokenizer", "vocab")) for n in copied):
            logger.warning("%s has no tokenizer files: the converted model needs a tokenizer path", path)
        return
    from lmjax.loader.tokenizer import load_tokenizer

    load_tokenizer(path).save_pretrained(directory)
