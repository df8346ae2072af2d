"""Several decode steps per host round trip (vLLM's "multi-step scheduling").

On the GPU machines the host, not the device, bounds a decode step: reading each step's tokens back and
preparing the next costs more than the step itself at small batch. When every scheduled sequence is
decoding and nothing needs the host between steps, the engine runs K steps in one jitted call: each
step's sampled tokens feed the next on the device, positions and cache slots are computed there from
the block tables (which already hold blocks for all K tokens), and the host reads K tokens per
sequence at once. It then applies EOS, stop strings and max_tokens token by token, dropping whatever a
finished sequence generated past its end (that KV sits in blocks it is about to free).

Shape letters: B sequences (padded; each has one query per step), M blocks per sequence, K steps,
V vocab, L top logprobs.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lmjax import parallel
from lmjax.layers.attention import AttentionMetadata
from lmjax.layers.sampler import SamplerOutput, SamplingMetadata, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeInputs:
    ids_B: jax.Array  # int32 the pending token of each sequence (0 for padding rows)
    positions_B: jax.Array  # int32 its position (= tokens already in the cache)
    block_tables_BM: jax.Array  # int32, with blocks for positions up to positions_B + K - 1
    num_valid: jax.Array  # int32 scalar: rows [0, num_valid) are real sequences


@dataclasses.dataclass
class PendingDecode:
    """A multi-step decode call on the device whose results the host has not read yet."""

    out: SamplerOutput  # device arrays with a leading K axis
    num_items: int  # real rows (the rest is padding)
    num_steps: int  # K


@functools.partial(jax.jit, static_argnames="rows")
def pending_ids(token_ids, *, rows: int) -> jax.Array:
    """Each item's newest sampled token, still on the device, as `rows` decode rows: the last step's of a
    K-step call ([K, B]) or a one-step call's ([B'], its batch bucketed otherwise: cut or zero-padded).
    Jitted: indexing a device array eagerly costs the host ~0.5 ms a call, this ~0.05."""
    ids = token_ids[-1] if token_ids.ndim == 2 else token_ids
    return ids[:rows] if ids.shape[0] >= rows else jnp.pad(ids, (0, rows - ids.shape[0]))


def _step_metadata(inp: DecodeInputs, k, block_size: int) -> tuple[jax.Array, AttentionMetadata]:
    B = inp.ids_B.shape[0]
    valid_B = jnp.arange(B) < inp.num_valid
    pos_B = jnp.where(valid_B, inp.positions_B + k, 0)
    block_B = jnp.take_along_axis(inp.block_tables_BM, (pos_B // block_size)[:, None], axis=1)[:, 0]
    slots_B = jnp.where(valid_B, block_B * block_size + pos_B % block_size, 0)  # padding -> sink block 0
    kv_lens_B = jnp.where(valid_B, pos_B + 1, 0)
    cu_B1 = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(valid_B.astype(jnp.int32))])
    meta = AttentionMetadata(slot_mapping_T=slots_B, seq_lens_T=jnp.maximum(kv_lens_B, 1), kv_lens_B=kv_lens_B,
                             block_tables_BM=inp.block_tables_BM, cu_q_lens_B1=cu_B1)
    return pos_B, meta


def decode_steps(model, logits_fn, caches, inp: DecodeInputs, smeta: SamplingMetadata, *, num_steps: int,
                 block_size: int, flags) -> tuple[SamplerOutput, list]:
    """K decode steps; returns SamplerOutput with a leading K axis and the updated caches."""
    B = inp.ids_B.shape[0]
    L = flags.num_logprobs

    def body(k, carry):
        caches, ids_B, out = carry
        pos_B, meta = _step_metadata(inp, k, block_size)
        hidden_BD, caches = model(ids_B, pos_B, caches, meta)
        step_meta = dataclasses.replace(smeta, steps_B=smeta.steps_B + k)
        res = sample(logits_fn(model, hidden_BD), step_meta, **flags._asdict())
        out = SamplerOutput(*(acc.at[k].set(v) for acc, v in zip(out, res)))
        return caches, res.token_ids_B, out

    out = SamplerOutput(jnp.zeros((num_steps, B), jnp.int32), jnp.zeros((num_steps, B), jnp.float32),
                        jnp.zeros((num_steps, B, L), jnp.int32), jnp.zeros((num_steps, B, L), jnp.float32),
                        jnp.zeros((num_steps, B), jnp.int32))
    caches, _, out = jax.lax.fori_loop(0, num_steps, body, (caches, inp.ids_B, out))
    return out, caches


def padding_decode_args(runner, B: int, M: int, smeta: SamplingMetadata) -> tuple:
    """(DecodeInputs, smeta) of a decode call of B rows and table width M holding no sequence (every KV write to
    the sink block 0), as the engine passes them (ModelRunner.decode_ids; replicated over its mesh, if any):
    warm-up runs such calls, the idle prefetch compiles them."""
    zeros_B = np.zeros(B, np.int32)
    inputs = DecodeInputs(runner.decode_ids(zeros_B), zeros_B, np.zeros((B, M), np.int32), np.int32(0))
    return parallel.replicate((inputs, smeta), runner.mesh) if runner.mesh is not None else (inputs, smeta)
