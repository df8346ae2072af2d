"""Sampler: greedy, seeded reproducibility, statistics, and parity with HF's logits processors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from lmjax.config import SamplingParams
from lmjax.engine.bans import row_banned_ids, tokenize_bad_words
from lmjax.layers.sampler import SamplingFlags, SamplingRow, apply_penalties, build_sampling_metadata, sample, warp

sample_jit = jax.jit(sample, static_argnames=SamplingFlags._fields)


def run(logits_BV, rows, pad_to=None):
    meta, flags = build_sampling_metadata(rows, pad_to or len(rows))
    return jax.device_get(sample_jit(jnp.asarray(logits_BV), meta, **flags._asdict()))


def rand_logits(B, V, seed=0, scale=3.0):
    return (np.random.default_rng(seed).standard_normal((B, V)) * scale).astype(np.float32)


def test_greedy_is_argmax():
    logits = rand_logits(6, 100)
    rows = [SamplingRow(SamplingParams(temperature=0.0), seed=i) for i in range(6)]
    out = run(logits, rows)
    np.testing.assert_array_equal(out.token_ids_B, logits.argmax(-1))
    # The same rows mixed with a sampling row take the non-greedy path: greedy rows still argmax.
    mixed = rows[:5] + [SamplingRow(SamplingParams(temperature=1.0, top_k=5), seed=1)]
    np.testing.assert_array_equal(run(logits, mixed).token_ids_B[:5], logits.argmax(-1)[:5])
    # top_k=1 is greedy too, whatever the temperature.
    assert run(logits[:1], [SamplingRow(SamplingParams(temperature=2.0, top_k=1), seed=0)]).token_ids_B[0] \
        == logits[0].argmax()


def test_seeded_sampling_independent_of_batch():
    logits = rand_logits(1, 64, scale=1.0)
    me = SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), seed=1234, output_ids=[1, 2, 3])
    alone = [run(logits, [me]).token_ids_B[0] for _ in range(2)]
    others = [SamplingRow(SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.3), seed=s,
                          prompt_ids=[5, 6], output_ids=[7]) for s in range(5)]
    batch = np.concatenate([rand_logits(3, 64, seed=9), logits, rand_logits(4, 64, seed=8)])
    in_batch = run(batch, others[:3] + [me] + others[3:], pad_to=8).token_ids_B[3]
    assert alone[0] == alone[1] == in_batch
    # A top-k request alone takes the lax.top_k path; next to a top_p-only row, the full sort.
    topk = SamplingRow(SamplingParams(temperature=1.0, top_k=20), seed=77, output_ids=[1])
    for seed in range(20):
        topk.seed = seed
        assert run(logits, [topk]).token_ids_B[0] == run(np.concatenate([logits, logits]), [me, topk]).token_ids_B[1]


def test_seed_and_step_change_the_draw():
    logits = np.zeros((1, 1000), np.float32)  # uniform: a collision is unlikely
    draw = lambda seed, step: run(logits, [SamplingRow(SamplingParams(), seed=seed, step=step)]).token_ids_B[0]  # noqa: E731
    assert len({draw(0, s) for s in range(8)}) > 4
    assert len({draw(s, 0) for s in range(8)}) > 4


def assert_close_frequencies(freq, probs, N):
    """Within 4.5 standard errors of a binomial proportion, per token (zero-probability tokens: never)."""
    tolerance = 4.5 * np.sqrt(probs * (1 - probs) / N)
    assert np.all(np.abs(freq - probs) <= tolerance), (freq, probs)


def test_frequencies_match_softmax():
    N, probs = 20000, np.array([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = np.tile(np.log(probs).astype(np.float32), (N, 1))
    rows = [SamplingRow(SamplingParams(temperature=1.0), seed=s) for s in range(N)]
    freq = np.bincount(run(logits, rows).token_ids_B, minlength=5) / N
    assert_close_frequencies(freq, probs, N)


def test_filtered_frequencies_match_hf_distribution():
    N, T = 20000, 0.7
    base = rand_logits(1, 12, seed=3, scale=1.0)
    params = SamplingParams(temperature=T, top_k=6, top_p=0.8, min_p=0.1)
    freq = np.bincount(run(np.tile(base, (N, 1)), [SamplingRow(params, seed=s) for s in range(N)]).token_ids_B,
                       minlength=12) / N
    expected = torch.softmax(hf_warp(torch.tensor(base), params), -1)[0].numpy()
    assert_close_frequencies(freq, expected, N)


def test_top_k_2_only_picks_top_2():
    logits = np.tile(rand_logits(1, 50, scale=0.3), (3000, 1))
    rows = [SamplingRow(SamplingParams(temperature=2.0, top_k=2), seed=s) for s in range(3000)]
    picked = set(run(logits, rows).token_ids_B.tolist())
    assert picked == set(np.argsort(-logits[0])[:2].tolist())


def test_small_top_p_picks_argmax():
    logits = np.tile(rand_logits(1, 50), (500, 1))
    rows = [SamplingRow(SamplingParams(temperature=1.5, top_p=1e-6), seed=s) for s in range(500)]
    assert set(run(logits, rows).token_ids_B.tolist()) == {int(logits[0].argmax())}


def test_banned_never_chosen():
    logits = rand_logits(1, 20)
    top3 = np.argsort(-logits[0])[:3].tolist()
    rows = [SamplingRow(SamplingParams(temperature=3.0), seed=s, banned_ids=top3) for s in range(2000)]
    assert not set(run(np.tile(logits, (2000, 1)), rows).token_ids_B.tolist()) & set(top3)
    greedy = run(logits, [SamplingRow(SamplingParams(temperature=0), seed=0, banned_ids=top3[:1])])
    assert greedy.token_ids_B[0] == top3[1]


def test_logprobs_are_raw_log_softmax():
    logits = rand_logits(4, 30)
    rows = [SamplingRow(SamplingParams(temperature=0.9, repetition_penalty=1.5, logprobs=3), seed=s,
                        prompt_ids=[0, 1, 2], output_ids=[3]) for s in range(3)]
    out = run(logits, rows, pad_to=4)
    ref = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose(out.logprobs_B, np.take_along_axis(ref, out.token_ids_B[:, None], -1)[:, 0],
                               rtol=1e-5, atol=1e-6)
    assert out.top_ids_BK.shape == (4, 4)  # 3 asked, bucketed to 4: the engine slices per row
    np.testing.assert_array_equal(out.top_ids_BK, np.argsort(-logits, -1)[:, :4])
    np.testing.assert_allclose(out.top_logprobs_BK, -np.sort(-ref, -1)[:, :4], rtol=1e-5, atol=1e-6)


def hf_warp(scores, p: SamplingParams):
    """HF's warpers for one request in vLLM's (V1) order: temperature, min-p, top-k, top-p."""
    if p.temperature != 1.0:
        scores = TemperatureLogitsWarper(p.temperature)(None, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(None, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    return scores


@functools.partial(jax.jit, static_argnames="max_top_k")
def lmjax_warp(logits_BV, meta, max_top_k):
    return warp(logits_BV, meta, True, max_top_k)


def test_min_p_filters_before_top_p_as_vllm():
    """probs .5 / .3 / .2, min_p=0.5 drops the .2; top_p=0.6 over what is left (.625 / .375) keeps only the
    first token (vLLM V1). Min_p last (V0) would keep two."""
    logits = np.tile(np.log(np.array([[0.5, 0.3, 0.2]], np.float32)), (2000, 1))
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_p=0.6, min_p=0.5), seed=s) for s in range(2000)]
    assert set(run(logits, rows).token_ids_B.tolist()) == {0}


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.5), dict(top_k=5), dict(top_k=1000), dict(top_p=0.3), dict(top_p=0.95, top_k=20),
    dict(min_p=0.2), dict(temperature=1.3, top_k=40, top_p=0.7, min_p=0.05), dict(top_p=1.0, top_k=0),
])
def test_warpers_match_hf(kwargs):
    params = SamplingParams(**kwargs)
    logits = rand_logits(5, 200, seed=7)
    meta, flags = build_sampling_metadata([SamplingRow(params, seed=0)] * 5, 5)
    assert flags.max_top_k == (0 if params.top_k <= 0 else 1 << (params.top_k - 1).bit_length())
    theirs = hf_warp(torch.tensor(logits), params).numpy()
    for max_top_k in {0, flags.max_top_k}:  # full sort, and lax.top_k head when every row has a top_k
        ours = np.asarray(lmjax_warp(jnp.asarray(logits), meta, max_top_k))
        np.testing.assert_array_equal(np.isinf(ours), np.isinf(theirs))
        np.testing.assert_allclose(ours[~np.isinf(ours)], theirs[~np.isinf(theirs)], rtol=1e-6)


def hf_warp_lmdeploy(scores, p: SamplingParams):
    """LMDeploy's order (both engines, probe 25): temperature, top-k, top-p, then min-p."""
    if p.temperature != 1.0:
        scores = TemperatureLogitsWarper(p.temperature)(None, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(None, scores)
    return scores


@pytest.mark.parametrize("kwargs", [dict(top_p=0.5, min_p=0.2), dict(temperature=1.3, top_k=40, top_p=0.7, min_p=0.3),
                                    dict(top_p=0.95, min_p=0.05)])
def test_lmdeploy_rows_filter_min_p_last_beside_vllm_rows(kwargs):
    """GenerationConfig's params take LMDeploy's order, SamplingParams' vLLM's, in one batch."""
    from lmjax.config import GenerationConfig

    lmdeploy = GenerationConfig(**{"top_k": 0, "temperature": 1.0, **kwargs}, do_sample=True).to_sampling_params()
    vllm = SamplingParams(**kwargs)
    assert lmdeploy.min_p_after_top_p and not vllm.min_p_after_top_p
    logits = rand_logits(6, 200, seed=11)
    meta, _ = build_sampling_metadata([SamplingRow(lmdeploy, seed=0), SamplingRow(vllm, seed=0)] * 3, 6)
    ours = np.asarray(lmjax_warp(jnp.asarray(logits), meta, 0))
    for b in range(6):
        warper, params = (hf_warp_lmdeploy, lmdeploy) if b % 2 == 0 else (hf_warp, vllm)
        theirs = warper(torch.tensor(logits[b:b + 1]), params).numpy()[0]
        np.testing.assert_array_equal(np.isinf(ours[b]), np.isinf(theirs))
        np.testing.assert_allclose(ours[b][~np.isinf(ours[b])], theirs[~np.isinf(theirs)], rtol=1e-6)
    if kwargs == dict(top_p=0.5, min_p=0.2):  # where the orders part: vLLM's renormalised top-p cuts harder
        assert np.isfinite(ours[0::2]).sum() > np.isfinite(ours[1::2]).sum()


def test_max_top_k_flag():
    rows = lambda *ks: [SamplingRow(SamplingParams(top_k=k), seed=0) for k in ks]  # noqa: E731
    assert build_sampling_metadata(rows(40, 3), 2)[1].max_top_k == 64
    assert build_sampling_metadata(rows(40, 0), 2)[1].max_top_k == 0  # one row needs the full sort
    assert build_sampling_metadata(rows(40, -1), 2)[1].max_top_k == 0
    assert build_sampling_metadata(rows(5000), 1)[1].max_top_k == 0  # past the limit: sort
    greedy_and_topk = [SamplingRow(SamplingParams(temperature=0), 0)] + rows(7)
    assert build_sampling_metadata(greedy_and_topk, 2)[1].max_top_k == 8


def test_repetition_penalty_matches_hf():
    logits = rand_logits(3, 40, seed=2)
    prompts, outputs = [[1, 2, 2, 30], [0, 5], [39]], [[3, 3, 7], [], [4, 39, 12]]
    penalties = [1.3, 0.8, 2.0]
    rows = [SamplingRow(SamplingParams(repetition_penalty=r), seed=0, prompt_ids=p, output_ids=o)
            for r, p, o in zip(penalties, prompts, outputs)]
    meta, flags = build_sampling_metadata(rows, 3)
    assert flags.use_penalties
    ours = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), meta))
    for b in range(3):
        ids = torch.tensor([prompts[b] + outputs[b]])
        theirs = RepetitionPenaltyLogitsProcessor(penalties[b])(ids, torch.tensor(logits[b:b + 1]))
        np.testing.assert_allclose(ours[b], theirs[0].numpy(), rtol=1e-6)


def test_presence_frequency_penalties_apply_to_output_only():
    logits = rand_logits(1, 10)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    meta, _ = build_sampling_metadata([SamplingRow(params, 0, prompt_ids=[1, 2], output_ids=[2, 3, 3, 3])], 1)
    ours = np.asarray(apply_penalties(jnp.asarray(logits), meta))[0]
    expected = logits[0].copy()
    counts = np.bincount([2, 3, 3, 3], minlength=10)
    expected -= 0.25 * counts + 0.5 * (counts > 0)
    np.testing.assert_allclose(ours, expected, rtol=1e-6)


def test_builder_padding_buckets_and_flags():
    rows = [SamplingRow(SamplingParams(temperature=0), 1, prompt_ids=[1] * 5, output_ids=[2] * 3),
            SamplingRow(SamplingParams(top_p=0.9, presence_penalty=0.1, logprobs=5), 2 ** 40 + 7,
                        prompt_ids=[3] * 9, output_ids=[4] * 2, banned_ids=[1, 2, 3])]
    meta, flags = build_sampling_metadata(rows, pad_to=4)
    assert flags == (False, True, True, 8, 0, True)  # logprobs asked: ranks counted too
    assert meta.prompt_tokens_BL.shape == (4, 16) and meta.banned_BX.shape == (4, 4)
    assert (meta.prompt_tokens_BL[0] == -1).all()  # greedy row without penalties ships no tokens
    assert meta.seeds_B.tolist() == [1, 7, 0, 0] and meta.steps_B.tolist() == [3, 2, 0, 0]
    assert meta.temperature_B.tolist() == [0, 1, 0, 0]
    greedy_meta, greedy_flags = build_sampling_metadata(rows[:1], 2)
    assert greedy_flags == (True, False, False, 0, 0, False) and greedy_meta.prompt_tokens_BL.shape == (2, 1)
    with pytest.raises(ValueError, match="pad_to=1"):
        build_sampling_metadata(rows, 1)


def test_row_banned_ids():
    p = SamplingParams(min_tokens=2, stop_token_ids=[9], bad_token_ids=[5])
    assert row_banned_ids(p, [1], eos_token_ids=[0]) == [0, 5, 9]
    assert row_banned_ids(p, [1, 2], eos_token_ids=[0]) == [5]
    words = [[7], [3, 4, 8]]
    assert row_banned_ids(SamplingParams(), [1, 3, 4], [0], words) == [7, 8]
    assert row_banned_ids(SamplingParams(), [4], [0], words) == [7]


def test_tokenize_bad_words():
    """vLLM's variants: the word without leading spaces, and after one space when that is another first token
    and as many tokens (a leading space given with the word does not hide its bare form)."""
    class Bpe:  # a leading space joins the first character's token
        def encode(self, text, add_special_tokens):
            ids = [ord(c) for c in text.lstrip(" ")]
            return [ids[0] + 1000] + ids[1:] if text.startswith(" ") else ids

    class Chars:  # the spaced form is one token longer: only the bare one
        def encode(self, text, add_special_tokens):
            return [ord(c) for c in text]
    assert tokenize_bad_words(Bpe(), ["ab", " cd"]) == [[97, 98], [1097, 98], [99, 100], [1099, 100]]
    assert tokenize_bad_words(Chars(), [" ab"]) == [[97, 98]]


def test_token_rank_counts_ties_against_the_chosen_token_as_vllm():
    from lmjax.layers.sampler import token_rank
    logprobs = jnp.log(jnp.asarray([[0.4, 0.4, 0.2], [0.5, 0.3, 0.2]], jnp.float32))
    chosen = jnp.asarray([logprobs[0, 1], logprobs[1, 0]])
    assert token_rank(logprobs, chosen).tolist() == [2, 1]  # vLLM V1 counts >= (itself included)
