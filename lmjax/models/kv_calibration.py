"""Calibration of the int4 KV cache (quant_policy=4): per layer and KV head, the maps that K is stored
through and queries read it with (why and how: lmjax.layers.kv_basis, lmjax.layers.kv_quant).

One forward over a calibration text (default: lmjax/calibration_text.py, disjoint from the perplexity
text the tests score) with a float cache in the model's dtype: each layer's RoPE'd keys are read back
from that cache, its queries are sown by the attention layers (`Attention.record_queries`, collected
by nnx.capture), exactly as the attention op gets them. The engine runs it when it starts with
quant_policy=4: one prefill-sized forward (SmolLM2 on 2 CPU cores: 10-18 s, most of it compiling; the
1B shape on an H100: 1.5 s), so no conversion step is needed, as with LMDeploy's quant_policy.

Shape letters: T tokens, N q heads, K kv heads, H head dim, P blocks, S block size.
"""
from __future__ import annotations

import logging

import numpy as np
from flax import nnx

from lmjax import parallel
from lmjax.calibration_text import DEFAULT_CALIBRATION_TEXT
from lmjax.layers.kv_basis import int4_kv_maps
from lmjax.layers.kv_quant import kv_rotation
from lmjax.models.forward import prefill_inputs

MAX_CALIBRATION_TOKENS = 2048
# Below a few tokens per dimension the K / q second moments are rank-deficient: the maps fit noise and read
# the cache worse than the rotation alone (SmolLM2, head_dim 64: KL to the float cache 0.32 from 32 tokens,
# 0.16 from the rotation, 0.06 from 2048 tokens; review 33).
MIN_TOKENS_PER_HEAD_DIM = 4
logger = logging.getLogger("lmjax.engine")


@nnx.jit
def _forward_caches(model, ids_T, positions_T, caches, meta):
    _, caches = model(ids_T, positions_T, caches, meta)
    return caches


def calibration_ids(tokenizer, text: str = DEFAULT_CALIBRATION_TEXT) -> list[int]:
    return list(tokenizer.encode(text))


class CalibrationTooShort(ValueError):
    pass


def calibrated_or_none(model, ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """The engine's maps: calibrated on `ids`, or None (the rotation alone) when they are too few to help."""
    try:
        return calibrate_kv_int4(model, ids)
    except CalibrationTooShort as e:
        logger.warning("%s: the int4 KV cache uses the uncalibrated rotation", e)
        return None


def calibrate_kv_int4(model, ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer, (k_map, q_map) float32 [K, H, H] for `make_kv_caches(..., quant_policy=4, kv_maps=...)`,
    from one forward over `ids` (cut to the model's context and MAX_CALIBRATION_TOKENS)."""
    cfg = model.config
    ids = list(ids)[:min(MAX_CALIBRATION_TOKENS, cfg.max_position_embeddings)]
    if len(ids) < MIN_TOKENS_PER_HEAD_DIM * cfg.head_dim:
        raise CalibrationTooShort(f"KV calibration needs at least {MIN_TOKENS_PER_HEAD_DIM * cfg.head_dim} tokens "
                                  f"({MIN_TOKENS_PER_HEAD_DIM} x head_dim {cfg.head_dim}) within the model's "
                                  f"context, got {len(ids)}")
    ids_T, positions_T, caches, meta, mesh = prefill_inputs(model, [ids])
    attentions = [layer.self_attn for layer in model.layers]
    for attn in attentions:
        attn.record_queries = True
    try:
        with parallel.use_mesh(mesh):
            caches, sown = nnx.capture(_forward_caches, nnx.Intermediate)(model, ids_T, positions_T, caches, meta)
    finally:
        for attn in attentions:
            attn.record_queries = False
    queries = [parallel.host_array(sown["layers"][i]["self_attn"]["queries_TNH"].get_value()[0], np.float32)
               for i in range(len(attentions))]  # (host_array: the calibration runs in every process)
    slots_T = np.asarray(meta.slot_mapping_T)
    rotation = kv_rotation(cfg.head_dim)
    maps = []
    for (k_cache_PSKH, _), q_TNH in zip(caches, queries):
        P, S, K, H = k_cache_PSKH.shape
        k_TKH = parallel.host_array(k_cache_PSKH, np.float32).reshape(P * S, K, H)[slots_T]
        k_TKH = k_TKH[:, ::K // cfg.num_kv_heads]  # a tp cache may hold each KV head several times
        maps.append(int4_kv_maps(k_TKH, q_TNH, rotation))
    return maps
