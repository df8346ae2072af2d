"""Preparing a loaded model for the engine's steps: which projections to merge (and lay out out-major), and the
smallest batch bucket of the multi-step decode call, both decided from the backend and the model's layers."""
from __future__ import annotations

import logging

import jax
from flax import nnx

from lmjax.env import env_choice, env_int
from lmjax.layers.attention import kv_write_impl
from lmjax.layers.out_major import OutMajorLinear, out_major_wanted
from lmjax.layers.quant import QuantLinear

logger = logging.getLogger("lmjax.engine")


def decode_batch_floor(model: nnx.Module | None = None) -> int:
    """Smallest batch bucket of the multi-step decode call (LMJAX_DECODE_BATCH_FLOOR overrides, for A/B
    runs): 1 on GPU for a model with int4 weights, so a batch-1 step runs one row and its QuantLinears take
    the one-token GEMV of pallas_kernels/w4_matmul.py, and for out-major layers (their one-row GEMV with
    fused norms, lmjax.layers.out_major); else 4. For bf16 weights XLA handles one-row
    dots worse than four-row ones (H200, 2026-11-23, tp_decode batch 1: 8B 5.58 vs 4.57 ms a step, 1B
    1.56 vs 1.11 ms: it turns them into Triton GEMMs and reductions), and on CPU every extra bucket is one
    more compilation of seconds."""
    default = 4
    if model is not None:
        layers = [m for _, m in _iter_modules(model)]
        w4 = jax.default_backend() == "gpu" and any(isinstance(m, QuantLinear) and m.spec.method == "w4"
                                                    for m in layers)
        default = 1 if w4 or any(isinstance(m, OutMajorLinear) for m in layers) else 4
    floor = env_int("LMJAX_DECODE_BATCH_FLOOR", default, minimum=1)
    if floor & (floor - 1):
        raise ValueError(f"LMJAX_DECODE_BATCH_FLOOR={floor} must be a power of two")
    return floor


def merge_gate_up_enabled() -> bool:
    """One gate/up weight (one GEMM launch instead of two): LMJAX_MERGE_GATE_UP=1 or 0, else "auto", on
    GPU only. Measured there (H200, 2026-11-23, batch-1 decode): 8B 4.533 -> 4.437 ms a step, 1B 1.069 ->
    1.073 (flat). Off on CPU, where it would only change what the tests compile."""
    value = env_choice("LMJAX_MERGE_GATE_UP", ("auto", "0", "1"), "auto")
    return value == "1" or (value == "auto" and jax.default_backend() == "gpu")


def merge_projections(model: nnx.Module, quant_policy: int, tp: int) -> None:
    """q/k/v as one weight when the fused RoPE + KV-write kernel will read its output whole (GPU,
    unquantized cache: `kv_write_impl`; under tp in per-device blocks, when every device holds whole KV
    heads), gate/up on one GPU (`merge_gate_up_enabled`); float or quantized weights. Under tp, XLA
    already makes one GEMM of gate and up (2 x H200 profile, 2026-11-23). Then, on one device where
    `out_major_wanted`, the merged layers out-major (lmjax.layers.out_major), which needs both merges."""
    out_major = tp == 1 and quant_policy == 0 and hasattr(model, "to_out_major") and \
        out_major_wanted(model.config.hidden_size)
    if quant_policy == 0 and (out_major or kv_write_impl(merged=True) == "kernel") and hasattr(model, "merge_qkv"):
        logger.info("merged the q/k/v projections of %d layers", model.merge_qkv(tp))
    if tp == 1 and (out_major or merge_gate_up_enabled()) and hasattr(model, "merge_gate_up"):
        logger.info("merged the gate/up projections of %d layers", model.merge_gate_up())
    if out_major:
        logger.info("out-major weights (one-row GEMV with fused norms) in %d layers", model.to_out_major())


def _iter_modules(model: nnx.Module):
    iter_modules = getattr(nnx, "iter_modules", None) or type(model).iter_modules  # flax 0.12 spelling first
    return iter_modules(model)
