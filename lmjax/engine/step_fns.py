"""Device-side pieces of a step outside the model: prompt logprobs and the sampler programs the runner jits."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from lmjax.layers.sampler import SamplerOutput, SamplingFlags, sample, token_rank


def prompt_logprobs(logits_TV, next_ids_T, k: int):
    logprobs_TV = jax.nn.log_softmax(logits_TV, axis=-1)
    chosen_T = jnp.take_along_axis(logprobs_TV, jnp.maximum(next_ids_T, 0)[:, None], axis=-1)[:, 0]
    top_lp_TK, top_ids_TK = jax.lax.top_k(logprobs_TV, k) if k else (logprobs_TV[:, :0], logprobs_TV[:, :0])
    return chosen_T, top_ids_TK.astype(jnp.int32), top_lp_TK, token_rank(logprobs_TV, chosen_T)


def sample_fused(logits_BV, smeta, *, flags: SamplingFlags) -> SamplerOutput:
    return sample(logits_BV, smeta, **flags._asdict())


def sample_rows(raw_BV, idx_R, processed_RV, smeta, *, flags: SamplingFlags) -> SamplerOutput:
    """Sample from the raw logits with rows idx_R (out of bounds: padding) replaced by processed ones."""
    logits_BV = raw_BV.at[idx_R].set(processed_RV, mode="drop")
    return sample(logits_BV, smeta, **flags._asdict(), raw_BV=raw_BV)
