"""logit_bias in the sampler: a sparse per-row bias added to the raw logits before penalties, bans and the mask
(vLLM V1's order), seen by greedy and sampled rows alike, leaving unbiased rows of the same batch alone,
absent (no extra input, same compiled step) when no row has one; logprobs stay those of the raw logits."""
import jax
import numpy as np
import pytest

from lmjax.config import SamplingParams
from lmjax.layers.sampler import SamplingRow, build_sampling_metadata, pack_token_ids, sample

V = 40


def _sample(rows, logits_BV, pad_to=4):
    meta, flags = build_sampling_metadata(rows, pad_to=pad_to)
    out = jax.jit(sample, static_argnames=flags._fields)(logits_BV, meta, **flags._asdict())
    return meta, jax.device_get(out)


def _logits(B=4, seed=0):
    return np.random.default_rng(seed).normal(size=(B, V)).astype(np.float32)


def test_a_large_bias_forces_or_bans_a_token_greedy_and_sampled():
    logits_BV = _logits()
    top = int(logits_BV[0].argmax())
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={7: 100.0}), 0),
            SamplingRow(SamplingParams(temperature=1.0, logit_bias={7: 100.0, 9: -3.5}), 1),
            SamplingRow(SamplingParams(temperature=0, logit_bias={top: -100.0}), 0)]
    logits_BV[2] = logits_BV[0]
    meta, out = _sample(rows, logits_BV)
    assert meta.bias_ids_BN.shape == (4, 2) and meta.bias_ids_BN[3].tolist() == [-1, -1]
    assert meta.bias_ids_BN[0].tolist() == [7, -1] and meta.bias_values_BN[1].tolist() == [100.0, -3.5]
    assert out.token_ids_B[0] == 7 and out.token_ids_B[1] == 7
    assert out.token_ids_B[2] != top and out.token_ids_B[2] == np.argsort(logits_BV[2])[-2]
    for seed in range(6):  # sampling never draws a token biased by -100 (the argmax of a peaked row)
        peaked_BV = np.zeros((4, V), np.float32)
        peaked_BV[:, 5] = 8.0
        rows = [SamplingRow(SamplingParams(temperature=1.0, logit_bias={5: -100.0}), seed)]
        assert _sample(rows, peaked_BV)[1].token_ids_B[0] != 5


def test_unbiased_rows_are_unchanged_and_logprobs_stay_raw():
    logits_BV = _logits(seed=1)
    plain = SamplingRow(SamplingParams(temperature=0.8, seed=3), 3)
    alone = _sample([plain, plain], logits_BV)[1]
    biased = SamplingRow(SamplingParams(temperature=0, logprobs=1, logit_bias={11: 50.0}), 0)
    meta, mixed = _sample([plain, biased], logits_BV)
    assert mixed.token_ids_B[0] == alone.token_ids_B[0] and mixed.logprobs_B[0] == alone.logprobs_B[0]
    assert mixed.token_ids_B[1] == 11
    raw_logprobs_V = jax.nn.log_softmax(logits_BV[1])
    # vLLM V1 reports the raw model output's logprobs (logprobs_mode="raw_logprobs"), before the bias.
    np.testing.assert_allclose(mixed.logprobs_B[1], raw_logprobs_V[11], rtol=1e-5)
    assert mixed.top_ids_BK[1, 0] == int(np.argmax(logits_BV[1]))


def test_bias_comes_before_penalties_bans_and_the_mask():
    logits_BV = np.zeros((4, V), np.float32)
    logits_BV[0, 2], logits_BV[0, 3] = 1.0, 0.5
    # Repetition penalty 2 on token 3 (in the prompt): vLLM penalizes the biased logit, (0.5 + 1.0) / 2 = 0.75,
    # below token 2's 1.0; biasing after the penalty would give 0.25 + 1.0 = 1.25 and pick 3.
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={3: 1.0})
    assert _sample([SamplingRow(params, 0, prompt_ids=[3])], logits_BV)[1].token_ids_B[0] == 2
    # A ban or the mask wins over any bias.
    banned = SamplingRow(SamplingParams(temperature=0, logit_bias={4: 100.0}), 0, banned_ids=[4])
    masked = SamplingRow(SamplingParams(temperature=0, logit_bias={4: 100.0}), 0, allowed_W=pack_token_ids([2, 3], 2))
    meta, out = _sample([banned, masked], logits_BV)
    assert out.token_ids_B[0] != 4 and out.token_ids_B[1] == 2


def test_no_bias_inputs_when_no_row_has_one():
    meta, _ = build_sampling_metadata([SamplingRow(SamplingParams(temperature=0, logit_bias={}), 0)], pad_to=4)
    assert meta.bias_ids_BN is None and meta.bias_values_BN is None
    plain, _ = build_sampling_metadata([SamplingRow(SamplingParams(temperature=0), 0)], pad_to=4)
    assert jax.tree.structure(meta) == jax.tree.structure(plain)  # the same compiled step as before


def test_bias_width_is_bucketed():
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={i: 1.0 for i in range(5)}), 0)]
    meta, _ = build_sampling_metadata(rows, pad_to=4)
    assert meta.bias_ids_BN.shape == meta.bias_values_BN.shape == (4, 8)


@pytest.mark.parametrize("bias, named", [
    ({"42": 1.0}, r"keys must be int token ids, got \['42'\]"),
    ({True: 1.0}, r"keys must be int token ids, got \[True\]"),
    ({42: float("inf")}, r"values must be finite numbers, got \{42: inf\}"),
    ({42: "5"}, r"values must be finite numbers, got \{42: '5'\}"),
    ([42, 5], r"must be a dict"),
])
def test_sampling_params_validates_logit_bias(bias, named):
    with pytest.raises(ValueError, match=named):
        SamplingParams(logit_bias=bias)


def test_sampling_params_keeps_out_of_range_biases_as_vllm_does():
    assert SamplingParams(logit_bias={np.int64(3): 250, 4: -1}).logit_bias == {3: 250.0, 4: -1.0}
