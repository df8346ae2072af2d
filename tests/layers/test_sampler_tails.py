"""The sampler's numerical edges (review 34): a token far below the top one is drawn at its rate (the Gumbel
noise reaches ~22.9, was capped at 15.9 by float32's uniform grid: a confident step's long tail was drawn
~5x too rarely), huge logits (a logit_bias of 1e9) still sample among themselves (float32's step there
dwarfed the noise: the lowest id won every time), and a tiny temperature picks among the best logits only
(the scaled logits overflowed to +-inf: token 0 every time)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.config import SamplingParams
from lmjax.layers.sampler import SamplingRow, build_sampling_metadata, sample

ROWS = 250


def _draws(logits_V, params: SamplingParams, seeds: range) -> np.ndarray:
    """The token each seed samples from `logits_V` (ROWS rows a call)."""
    meta, flags = build_sampling_metadata([SamplingRow(params, seed=0)] * ROWS, pad_to=ROWS)
    meta = jax.tree_util.tree_map(jnp.asarray, meta)
    run = jax.jit(lambda logits_BV, m: sample(logits_BV, m, **flags._asdict()).token_ids_B)
    logits_BV = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (ROWS, len(logits_V)))
    out = [np.asarray(run(logits_BV, dataclasses.replace(meta, seeds_B=jnp.arange(s, s + ROWS, dtype=jnp.uint32))))
           for s in seeds[::ROWS]]
    return np.concatenate(out)


def test_a_long_tail_far_below_the_top_token_is_drawn_at_its_rate():
    tail, gap, n = 100_000, 17.0, 6000
    logits_V = np.concatenate([[0.0], np.full(tail, -gap)])
    expected = n * tail * np.exp(-gap) / (1 + tail * np.exp(-gap))  # 24.7
    drawn = int((_draws(logits_V, SamplingParams(temperature=1.0), range(n)) > 0).sum())
    assert 12 <= drawn <= 45, (drawn, expected)  # (Poisson 24.7: both bounds ~0.2% apart; the old noise drew 4)


def test_huge_logits_still_sample_among_themselves():
    params = SamplingParams(temperature=1.0, logit_bias={3: 1e9, 7: 1e9})
    meta, flags = build_sampling_metadata([SamplingRow(params, seed=s, prompt_ids=[1]) for s in range(ROWS)],
                                          pad_to=ROWS)
    logits_BV = jnp.zeros((ROWS, 16), jnp.float32)
    tokens = np.asarray(jax.jit(lambda l, m: sample(l, m, **flags._asdict()).token_ids_B)(
        logits_BV, jax.tree_util.tree_map(jnp.asarray, meta)))
    assert set(tokens) == {3, 7} and 0.35 < np.mean(tokens == 3) < 0.65


def test_a_tiny_temperature_samples_among_the_best_logits_only():
    for logits_V, best in (([5.0, 3.0, 10.0, 2.0], {2}), ([-10.0, -9.0, -7.0, -8.0], {2}), ([1.0, 5.0, 5.0, 2.0], {1, 2})):
        tokens = _draws(logits_V, SamplingParams(temperature=1.2e-38), range(ROWS))
        assert set(tokens) == best, (logits_V, np.unique(tokens))
