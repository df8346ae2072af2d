"""Run a model outside the engine: whole-prompt logits and a simple greedy decode loop over a paged
cache laid out contiguously. For parity tests and notebooks; the engine has its own scheduler and steps.

Shape letters: B sequences, L tokens of one sequence, V vocab, P blocks, S block size, K kv heads, H head dim.
"""
from __future__ import annotations

from numbers import Integral

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lmjax import parallel
from lmjax.layers.attention import AttentionMetadata, contiguous_metadata_host
from lmjax.layers.kv_quant import make_quant_kv_caches
from lmjax.models.config import ModelConfig
from lmjax.validation import check_token_ids


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


def prefill_inputs(model, prompts: list[list[int]], block_size: int = 16, quant_policy: int = 0, kv_maps=None,
                   *, bucketed: bool = False):
    """(ids_T, positions_T, caches, meta, mesh) to prefill whole prompts in one ragged step into zeroed
    caches in the model's dtype laid out contiguously (`make_kv_caches`, `contiguous_metadata`).

    Exactly sized by default: row t of the model's output is token t (callers index hidden_TD[-1]).
    bucketed=True pads tokens, sequences, block-table width and cache blocks to powers of two as the
    engine pads a step (`_bucketed`), so a jitted caller compiles once per bucket, not per prompt length;
    rows past the prompts' tokens are padding, to be dropped."""
    prompts = _checked_prompts(prompts, model.config.vocab_size)
    lengths = [len(p) for p in prompts]
    ids_T, positions_T, meta, num_blocks = _prefill_layout(prompts, lengths, block_size, None, bucketed)
    dtype = model.embed_tokens.embedding[...].dtype
    mesh = parallel.mesh_of(model)
    caches = make_kv_caches(model.config, num_blocks, block_size, dtype, mesh, quant_policy, kv_maps)
    return ids_T, positions_T, caches, meta, mesh


def _checked_prompts(prompts, vocab: int) -> list[np.ndarray]:
    """Each prompt as int32 ids, or a ValueError naming the bad value: an empty prompt, a non-integer id (the
    device would truncate 5.7 to 5) or one outside [0, vocab) (the embedding lookup would clamp it)."""
    prompts = prompts.tolist() if hasattr(prompts, "tolist") else prompts
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token id lists, got {prompts!r:.100}")
    return [_checked_ids(f"prompts[{i}]", ids, vocab) for i, ids in enumerate(prompts)]


def _checked_ids(what: str, ids, vocab: int) -> np.ndarray:
    values = ids.tolist() if hasattr(ids, "tolist") else ids  # numpy / jax arrays: Python scalars
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"{what} must be a non-empty list of token ids, got {ids!r:.100}")
    not_int = [x for x in values if isinstance(x, (bool, np.bool_)) or not isinstance(x, Integral)]
    if not_int:
        raise ValueError(f"{what} must hold integer token ids, got {not_int[:5]!r:.100}")
    check_token_ids(f"{what} ids", values, vocab)
    return np.asarray(values, np.int32)


def _bucket(n: int, minimum: int = 1) -> int:
    """Next power of two >= max(n, minimum): one compilation per bucket, as the engine's steps."""
    return 1 << (max(n, minimum) - 1).bit_length()


def _token_bucket(n: int) -> int:
    """Powers of two (min 16) up to 256 tokens, then multiples of 128: a long text (a perplexity's 588 tokens)
    pads to 640, not 1024 (the padding would be most of the work); still one compilation per bucket."""
    return _bucket(n, 16) if n <= 256 else -(-n // 128) * 128


def _prefill_layout(prompts, lengths: list[int], block_size: int, capacity: list[int] | None, bucketed: bool):
    """(ids_T, positions_T, meta, num_blocks) of a contiguous prefill (`contiguous_metadata`), padded when
    `bucketed` (`_bucketed`)."""
    num_blocks = 1 + sum(-(-n // block_size) for n in (capacity or lengths))
    if bucketed:
        num_blocks = _bucket(num_blocks)
    meta = contiguous_metadata_host(lengths, block_size, num_blocks, capacity)
    ids_T = np.concatenate([np.asarray(p, np.int32) for p in prompts])
    positions_T = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    if bucketed:
        ids_T, positions_T, meta = _bucketed(ids_T, positions_T, meta)
    return jnp.asarray(ids_T), jnp.asarray(positions_T), jax.tree.map(jnp.asarray, meta), num_blocks


def _bucketed(ids_T, positions_T, meta: AttentionMetadata):
    """Inputs padded to bucketed tokens (`_token_bucket`), power-of-two sequences and block-table width, as
    lmjax.engine.model_runner.build_inputs pads a step: padding tokens (id 0, position 0) sit past
    cu_q_lens[-1], so they attend nothing, and their K/V goes to slot 0 of the sink block 0, which no
    sequence reads; padding sequences have kv_len 0 and a table of block 0. The prompts' rows are unchanged."""
    n, b = len(ids_T), len(meta.kv_lens_B)
    T, B, M = _token_bucket(n), _bucket(b), _bucket(meta.block_tables_BM.shape[1])

    def pad(x_N, size: int, value: int = 0):
        return np.concatenate([x_N, np.full(size - len(x_N), value, np.int32)])
    tables_BM = np.zeros((B, M), np.int32)
    tables_BM[:b, :meta.block_tables_BM.shape[1]] = meta.block_tables_BM
    padded = AttentionMetadata(
        slot_mapping_T=pad(meta.slot_mapping_T, T), seq_lens_T=pad(meta.seq_lens_T, T, 1),
        kv_lens_B=pad(meta.kv_lens_B, B), block_tables_BM=tables_BM, cu_q_lens_B1=pad(meta.cu_q_lens_B1, B + 1, n))
    return pad(ids_T, T), pad(positions_T, T), padded


def prompt_logits(model, prompts: list[list[int]], block_size: int = 16, quant_policy: int = 0,
                  kv_maps=None) -> list[np.ndarray]:
    """float32 logits [L, V] at every position of each prompt, all prompts in one ragged step
    (through a KV cache quantized by `quant_policy` 8 / 4 when set; int4 with `kv_maps`, see
    `make_kv_caches`). Inputs padded to power-of-two buckets: a new prompt length compiles only when it
    starts a new bucket."""
    ids_T, positions_T, caches, meta, mesh = prefill_inputs(model, prompts, block_size, quant_policy, kv_maps,
                                                            bucketed=True)
    with parallel.use_mesh(mesh):
        logits_TV, _ = _forward_all(model, ids_T, positions_T, caches, meta)
    lengths = [len(p) for p in prompts]
    logits_TV = parallel.host_array(logits_TV)[:sum(lengths)]
    return np.split(logits_TV, np.cumsum(lengths)[:-1])


def perplexity(model, ids: list[int], quant_policy: int = 0, kv_maps=None) -> float:
    """exp(mean next-token NLL) of `ids` under `model` (`prompt_logits`' KV cache options)."""
    if len(ids) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens (one to predict from), got {len(ids)}: "
                         f"{list(ids)!r:.100}")
    logits_LV = prompt_logits(model, [ids], quant_policy=quant_policy, kv_maps=kv_maps)[0][:-1].astype(np.float64)
    # numpy, not jnp: eager jnp ops would compile again for every prompt length
    shifted_LV = logits_LV - logits_LV.max(axis=-1, keepdims=True)
    logp_LV = shifted_LV - np.log(np.exp(shifted_LV).sum(axis=-1, keepdims=True))
    nll_L = -np.take_along_axis(logp_LV, np.asarray(ids[1:], np.int64)[:, None], axis=1)
    return float(np.exp(nll_L.mean()))


@nnx.jit
def _greedy_step(model, ids_T, positions_T, caches, meta, last_rows_B):
    hidden_TD, caches = model(ids_T, positions_T, caches, meta)
    logits_BV = model.compute_logits(hidden_TD[last_rows_B])
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), caches


def _decode_metadata(tables_BM: np.ndarray, kv_lens_B: np.ndarray, block_size: int) -> AttentionMetadata:
    """Metadata for one decode token per sequence at position kv_len - 1, in the prompt's block table.
    Padding sequences (kv_len 0, after the real ones) get a padding token: slot 0, past cu_q_lens[-1]."""
    live_B = kv_lens_B > 0
    pos_B = np.maximum(kv_lens_B - 1, 0)
    slots_B = tables_BM[np.arange(len(pos_B)), pos_B // block_size] * block_size + pos_B % block_size
    return AttentionMetadata(
        slot_mapping_T=jnp.asarray(np.where(live_B, slots_B, 0), jnp.int32),
        seq_lens_T=jnp.asarray(np.maximum(kv_lens_B, 1), jnp.int32),
        kv_lens_B=jnp.asarray(kv_lens_B, jnp.int32), block_tables_BM=jnp.asarray(tables_BM),
        cu_q_lens_B1=jnp.asarray(np.concatenate([[0], np.cumsum(live_B)]), jnp.int32))


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16,
                    quant_policy: int = 0) -> list[list[int]]:
    """Greedy tokens for each prompt: one prefill step, then incremental decode steps over the KV cache.

    No early stop on EOS: exactly `max_new_tokens` tokens each (like HF generate with min_new_tokens; 0 gives
    none). Steps padded to power-of-two buckets (`prefill_inputs(bucketed=True)`).
    """
    prompts = _checked_prompts(prompts, model.config.vocab_size)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    prompt_lens = [len(p) for p in prompts]
    lengths = [n + max_new_tokens for n in prompt_lens]
    ids_T, positions_T, prefill, num_blocks = _prefill_layout(prompts, prompt_lens, block_size, lengths, True)
    mesh = parallel.mesh_of(model)  # a model sharded by lmjax.parallel runs tensor-parallel
    caches = make_kv_caches(model.config, num_blocks, block_size, model.embed_tokens.embedding[...].dtype, mesh,
                            quant_policy)
    with parallel.use_mesh(mesh):
        out_BN = _greedy_loop(model, ids_T, positions_T, prefill, prompt_lens, max_new_tokens, block_size, caches)
    return out_BN[:len(prompts)].tolist()


def _greedy_loop(model, ids_T, positions_T, prefill: AttentionMetadata, prompt_lens: list[int],
                 max_new_tokens: int, block_size: int, caches) -> np.ndarray:
    """[B, max_new_tokens] tokens of every (padded) sequence of `prefill`; each owns blocks for its whole
    output from the start."""
    B = len(prefill.kv_lens_B)
    last_rows_B = np.zeros(B, np.int32)
    last_rows_B[:len(prompt_lens)] = np.cumsum(prompt_lens) - 1
    tokens_B, caches = _greedy_step(model, ids_T, positions_T, caches, prefill, jnp.asarray(last_rows_B))
    out = [np.asarray(tokens_B)]
    tables_BM, kv_lens_B = np.asarray(prefill.block_tables_BM), np.asarray(prefill.kv_lens_B)
    rows_B = jnp.arange(B, dtype=jnp.int32)
    for _ in range(max_new_tokens - 1):
        kv_lens_B = np.where(kv_lens_B > 0, kv_lens_B + 1, 0)
        meta = _decode_metadata(tables_BM, kv_lens_B, block_size)
        positions_B = jnp.asarray(np.maximum(kv_lens_B - 1, 0), jnp.int32)
        tokens_B, caches = _greedy_step(model, tokens_B, positions_B, caches, meta, rows_B)
        out.append(np.asarray(tokens_B))
    return np.stack(out, axis=1)
