"""Run a model outside the engine: whole-prompt logits and a simple greedy decode loop over a paged
cache laid out contiguously. For parity tests and notebooks; the engine has its own scheduler and steps.

Shape letters: B sequences, L tokens of one sequence, V vocab, P blocks, S block size, K kv heads, H head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lmjax import parallel
from lmjax.layers.attention import AttentionMetadata, contiguous_metadata
from lmjax.layers.kv_quant import make_quant_kv_caches
from lmjax.models.config import ModelConfig


def make_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype, mesh=None,
                   quant_policy: int = 0, kv_maps=None) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed per-layer (k_PSKH, v_PSKH) caches; under a tp mesh, sharded on KV heads. quant_policy
    8 / 4: `QuantKV` caches (int8 / int4 codes standing in for `dtype`, see lmjax.layers.kv_quant);
    int4 with kv_maps from lmjax.models.kv_calibration, else the uncalibrated rotation."""
    if quant_policy:
        return make_quant_kv_caches(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                    quant_policy, dtype, mesh, kv_maps)
    return parallel.make_kv_caches(cfg, num_blocks, block_size, dtype, mesh)


@nnx.jit
def _forward_all(model, ids_T, positions_T, caches, meta):
    hidden_TD, caches = model(ids_T, positions_T, caches, meta)
    return model.compute_logits(hidden_TD), caches


def prefill_inputs(model, prompts: list[list[int]], block_size: int = 16, quant_policy: int = 0, kv_maps=None):
    """(ids_T, positions_T, caches, meta, mesh) to prefill whole prompts in one ragged step into zeroed
    caches in the model's dtype laid out contiguously (`make_kv_caches`, `contiguous_metadata`)."""
    lengths = [len(p) for p in prompts]
    num_blocks = 1 + sum(-(-n // block_size) for n in lengths)
    dtype = model.embed_tokens.embedding[...].dtype
    mesh = parallel.mesh_of(model)
    caches = make_kv_caches(model.config, num_blocks, block_size, dtype, mesh, quant_policy, kv_maps)
    meta = contiguous_metadata(lengths, block_size, num_blocks)
    ids_T = jnp.asarray(np.concatenate(prompts), jnp.int32)
    positions_T = jnp.asarray(np.concatenate([np.arange(n) for n in lengths]), jnp.int32)
    return ids_T, positions_T, caches, meta, mesh


def prompt_logits(model, prompts: list[list[int]], block_size: int = 16, quant_policy: int = 0,
                  kv_maps=None) -> list[np.ndarray]:
    """float32 logits [L, V] at every position of each prompt, all prompts in one ragged step
    (through a KV cache quantized by `quant_policy` 8 / 4 when set; int4 with `kv_maps`, see
    `make_kv_caches`)."""
    lengths = [len(p) for p in prompts]
    ids_T, positions_T, caches, meta, mesh = prefill_inputs(model, prompts, block_size, quant_policy, kv_maps)
    with parallel.use_mesh(mesh):
        logits_TV, _ = _forward_all(model, ids_T, positions_T, caches, meta)
    return np.split(parallel.host_array(logits_TV), np.cumsum(lengths)[:-1])


def perplexity(model, ids: list[int], quant_policy: int = 0, kv_maps=None) -> float:
    """exp(mean next-token NLL) of `ids` under `model` (`prompt_logits`' KV cache options)."""
    logits_LV = prompt_logits(model, [ids], quant_policy=quant_policy, kv_maps=kv_maps)[0]
    logp_LV = jax.nn.log_softmax(jnp.asarray(logits_LV[:-1]), axis=-1)
    nll_L = -jnp.take_along_axis(logp_LV, jnp.asarray(ids[1:])[:, None], axis=1)
    return float(jnp.exp(jnp.mean(nll_L)))


@nnx.jit
def _greedy_step(model, ids_T, positions_T, caches, meta, last_rows_B):
    hidden_TD, caches = model(ids_T, positions_T, caches, meta)
    logits_BV = model.compute_logits(hidden_TD[last_rows_B])
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), caches


def _decode_metadata(meta: AttentionMetadata, kv_lens_B: np.ndarray, block_size: int) -> AttentionMetadata:
    """Metadata for one decode token per sequence at position kv_len - 1, in the prompt's block table."""
    tables_BM = np.asarray(meta.block_tables_BM)
    pos_B = kv_lens_B - 1
    slots_B = tables_BM[np.arange(len(pos_B)), pos_B // block_size] * block_size + pos_B % block_size
    return AttentionMetadata(
        slot_mapping_T=jnp.asarray(slots_B, jnp.int32), seq_lens_T=jnp.asarray(kv_lens_B, jnp.int32),
        kv_lens_B=jnp.asarray(kv_lens_B, jnp.int32), block_tables_BM=meta.block_tables_BM,
        cu_q_lens_B1=jnp.arange(len(kv_lens_B) + 1, dtype=jnp.int32))


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16,
                    quant_policy: int = 0) -> list[list[int]]:
    """Greedy tokens for each prompt: one prefill step, then incremental decode steps over the KV cache.

    No early stop on EOS: exactly `max_new_tokens` tokens each (like HF generate with min_new_tokens).
    """
    lengths = [len(p) + max_new_tokens for p in prompts]
    num_blocks = 1 + sum(-(-n // block_size) for n in lengths)
    mesh = parallel.mesh_of(model)  # a model sharded by lmjax.parallel runs tensor-parallel
    caches = make_kv_caches(model.config, num_blocks, block_size, model.embed_tokens.embedding[...].dtype, mesh,
                            quant_policy)
    with parallel.use_mesh(mesh):
        return _greedy_loop(model, prompts, max_new_tokens, block_size, num_blocks, lengths, caches)


def _greedy_loop(model, prompts, max_new_tokens, block_size, num_blocks, lengths, caches):
    prompt_lens = np.array([len(p) for p in prompts])
    # Each sequence owns blocks for its whole output from the start.
    prefill = contiguous_metadata(list(prompt_lens), block_size, num_blocks, capacity=lengths)
    ids_T = jnp.asarray(np.concatenate(prompts), jnp.int32)
    positions_T = jnp.asarray(np.concatenate([np.arange(n) for n in prompt_lens]), jnp.int32)
    last_rows_B = jnp.asarray(np.cumsum(prompt_lens) - 1, jnp.int32)
    tokens_B, caches = _greedy_step(model, ids_T, positions_T, caches, prefill, last_rows_B)
    out = [np.asarray(tokens_B)]
    kv_lens_B = prompt_lens.copy()
    for _ in range(max_new_tokens - 1):
        kv_lens_B = kv_lens_B + 1
        meta = _decode_metadata(prefill, kv_lens_B, block_size)
        rows_B = jnp.arange(len(prompts), dtype=jnp.int32)
        tokens_B, caches = _greedy_step(model, tokens_B, jnp.asarray(kv_lens_B - 1, jnp.int32), caches, meta, rows_B)
        out.append(np.asarray(tokens_B))
    return np.stack(out, axis=1).tolist()
