"""LLM.beam_search (lmjax.api.beam_search) against a beam search written out here in numpy over transformers'
float32 next-token log-probabilities on the same weights.

The reference is vLLM's algorithm (LLM.beam_search), not transformers' generate(num_beams=...): vLLM keeps
every EOS-finished candidate of every step and ranks them with the live beams only at the end, while
transformers keeps at most num_beams finished hypotheses and may stop early, so the two can disagree.

The tiny model (conftest.write_tiny_llama, initializer_range=0.2 for peaked distributions) ends on EOS_ID,
which after PROMPT_IDS it ranks second: EOS-finished beams then compete with the live ones, so
length_penalty changes the ranking. Its word-level tokenizer decodes id 51 as "t51"; "t0" (id 0) is the
tokenizer's own EOS, which the engine stops on too.
"""
import functools

import numpy as np
import pytest
import torch
import transformers

from conftest import write_tiny_llama
from lmjax import LLM, BeamSearchParams, SamplingParams
from lmjax.api import beam_search as beam_search_module
from lmjax.api.beam_search import get_beam_search_score

EOS_ID = 51
PROMPT_IDS = [1, 5, 9, 12]
OTHER_IDS = [1, 20, 30, 40, 50]
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=EOS_ID, initializer_range=0.2)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=16, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def next_logprobs(tiny):
    """tokens -> log_softmax of transformers' last logits (float32 model, float64 numpy), memoised."""
    model = transformers.LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()

    @functools.lru_cache(maxsize=None)
    def logprobs_V(tokens: tuple[int, ...]) -> np.ndarray:
        with torch.no_grad():
            logits_V = model(torch.tensor([tokens])).logits[0, -1]
        return torch.log_softmax(logits_V.double(), -1).numpy()

    return lambda tokens: logprobs_V(tuple(tokens))


def reference_beam_search(next_logprobs, prompt, width, max_tokens, eos_ids, length_penalty=1.0,
                          ignore_eos=False, include_stop=False):
    """vLLM's beam search, explicitly: each step every live beam's 2 * width most likely next tokens are
    candidates; an EOS one is finished (its EOS kept in the tokens only with include_stop), the best
    `width` others by score live on; at the end finished + live ranked by score. A beam is
    (tokens, cum_logprob, finish_reason, stop_reason)."""
    def score(beam):
        tokens, cum = beam[:2]
        return cum / (len(tokens) - (tokens[-1] in eos_ids)) ** length_penalty

    live, finished = [(list(prompt), 0.0, None, None)], []
    for _ in range(max_tokens):
        children = []
        for tokens, cum, _, _ in live:
            logprobs_V = next_logprobs(tokens)
            for token in np.argsort(-logprobs_V)[:2 * width].tolist():
                if token in eos_ids and not ignore_eos:
                    finished.append((tokens + [token] * include_stop, cum + logprobs_V[token], "stop", token))
                else:
                    children.append((tokens + [token], cum + logprobs_V[token], "length", None))
        live = sorted(children, key=score, reverse=True)[:width]
    return sorted(finished + live, key=score, reverse=True)[:width]


def assert_same_beams(ours, reference, prompt, tokenizer):
    assert [s.tokens for s in ours.sequences] == [beam[0] for beam in reference]
    assert [(s.finish_reason, s.stop_reason) for s in ours.sequences] == [beam[2:] for beam in reference]
    np.testing.assert_allclose([s.cum_logprob for s in ours.sequences], [beam[1] for beam in reference],
                               rtol=1e-4, atol=1e-4)
    for s in ours.sequences:
        assert s.text == tokenizer.decode(s.tokens)
        # one logprobs dict per step (an EOS left out of tokens included), holding that step's token
        step_tokens = s.tokens[len(prompt):]
        if s.finish_reason == "stop" and step_tokens[-1:] != [s.stop_reason]:
            step_tokens.append(s.stop_reason)
        assert len(s.logprobs) == len(step_tokens)
        total = sum(entry[token].logprob for entry, token in zip(s.logprobs, step_tokens))
        assert total == pytest.approx(s.cum_logprob, abs=1e-5)


@pytest.fixture
def engine_batches(monkeypatch):
    """The number of requests of each batch beam search hands the engine, in order."""
    batches, submit_all = [], beam_search_module.submit_all

    def recording_submit_all(engine, prompts, params):
        batches.append(len(prompts))
        return submit_all(engine, prompts, params)

    monkeypatch.setattr(beam_search_module, "submit_all", recording_submit_all)
    return batches


def test_matches_the_reference_for_a_batch_of_prompts(llm, next_logprobs, engine_batches):
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    outs = llm.beam_search([{"prompt_token_ids": PROMPT_IDS}, OTHER_IDS], params)
    eos_ids = set(llm.llm_engine.eos_token_ids)
    assert eos_ids == {0, EOS_ID}
    for out, prompt in zip(outs, (PROMPT_IDS, OTHER_IDS)):
        assert_same_beams(out, reference_beam_search(next_logprobs, prompt, 3, 4, eos_ids), prompt,
                          llm.get_tokenizer())
    assert any(s.finish_reason == "stop" for s in outs[0].sequences)  # the EOS path is exercised
    # one engine batch per step, holding every live beam of both prompts
    assert engine_batches == [2, 6, 6, 6]
    assert not llm.llm_engine.has_unfinished()


def test_concurrency_limit_searches_prompts_in_turn(llm, engine_batches):
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    together = llm.beam_search([PROMPT_IDS, OTHER_IDS], params)
    assert engine_batches == [2, 4]
    in_turn = llm.beam_search([PROMPT_IDS, OTHER_IDS], params, concurrency_limit=1)
    assert engine_batches[2:] == [1, 2, 1, 2]
    assert [[s.tokens for s in out.sequences] for out in in_turn] == \
        [[s.tokens for s in out.sequences] for out in together]


def test_length_penalty_changes_the_ranking(llm, next_logprobs):
    eos_ids = set(llm.llm_engine.eos_token_ids)
    best = {}
    for length_penalty in (0.0, 2.0):
        params = BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=length_penalty)
        out = llm.beam_search(PROMPT_IDS, params)[0]
        reference = reference_beam_search(next_logprobs, PROMPT_IDS, 2, 4, eos_ids, length_penalty)
        assert_same_beams(out, reference, PROMPT_IDS, llm.get_tokenizer())
        best[length_penalty] = out.sequences[0]
    # 0: the plain sum wins, an early EOS beam (few negative terms); 2: long beams are divided more
    assert best[0.0].finish_reason == "stop" and len(best[0.0].tokens) == len(PROMPT_IDS)
    assert best[2.0].finish_reason == "length" and len(best[2.0].tokens) == len(PROMPT_IDS) + 4


def test_include_stop_str_in_output_keeps_the_eos(llm, next_logprobs):
    eos_ids = set(llm.llm_engine.eos_token_ids)
    kept, dropped = (llm.beam_search(PROMPT_IDS, BeamSearchParams(beam_width=2, max_tokens=3,
                                                                  include_stop_str_in_output=include))[0]
                     for include in (True, False))
    reference = reference_beam_search(next_logprobs, PROMPT_IDS, 2, 3, eos_ids, include_stop=True)
    assert_same_beams(kept, reference, PROMPT_IDS, llm.get_tokenizer())
    stopped = kept.sequences[0]
    assert stopped.tokens == PROMPT_IDS + [EOS_ID] and stopped.text.endswith(f"t{EOS_ID}")
    # the kept EOS does not count in the length: the same ranking, the same scores
    assert [s.tokens[:len(s.tokens) - (s.finish_reason == "stop")] for s in kept.sequences] == \
        [s.tokens for s in dropped.sequences]
    assert [s.cum_logprob for s in kept.sequences] == [s.cum_logprob for s in dropped.sequences]


def test_score_is_vllms():
    assert get_beam_search_score([1, 2, 3, 4], -6.0, EOS_ID) == -1.5
    assert get_beam_search_score([1, 2, EOS_ID], -6.0, EOS_ID) == -3.0  # a final EOS is not counted
    assert get_beam_search_score([1, 2, 0], -6.0, {0, EOS_ID}, length_penalty=2.0) == -1.5
    assert get_beam_search_score([1, 2, 3], -6.0, None, length_penalty=0.0) == -6.0


def test_ignore_eos_runs_every_beam_to_max_tokens(llm, next_logprobs):
    eos_ids = set(llm.llm_engine.eos_token_ids)
    out = llm.beam_search(PROMPT_IDS, BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))[0]
    reference = reference_beam_search(next_logprobs, PROMPT_IDS, 2, 3, eos_ids, ignore_eos=True)
    assert_same_beams(out, reference, PROMPT_IDS, llm.get_tokenizer())
    assert all(len(s.tokens) == len(PROMPT_IDS) + 3 and s.finish_reason == "length" for s in out.sequences)


def test_width_one_is_greedy(llm):
    greedy = llm.generate({"prompt_token_ids": OTHER_IDS}, SamplingParams(temperature=0, max_tokens=5, logprobs=0),
                          use_tqdm=False)[0].outputs[0]
    assert greedy.finish_reason == "length"  # no EOS on the way: beam search ranks an EOS finish differently
    beam = llm.beam_search({"prompt_token_ids": OTHER_IDS}, BeamSearchParams(beam_width=1, max_tokens=5))[0]
    assert [s.tokens for s in beam.sequences] == [OTHER_IDS + greedy.token_ids]
    assert beam.sequences[0].cum_logprob == pytest.approx(greedy.cumulative_logprob, abs=1e-5)


def test_temperature_adds_a_sampled_candidate_but_keeps_raw_logprobs(llm):
    """vLLM V1: the logprobs are the raw model's, so temperature does not rescale the scores; the step's
    sampled token (random now) joins the 2 * beam_width most likely as a candidate."""
    cold = llm.beam_search(PROMPT_IDS, BeamSearchParams(beam_width=2, max_tokens=1))[0].sequences[0].logprobs[0]
    for _ in range(3):
        hot = llm.beam_search(PROMPT_IDS, BeamSearchParams(beam_width=2, max_tokens=1, temperature=1.5))[0]
        entry = hot.sequences[0].logprobs[0]
        assert len(cold) == 4 and 4 <= len(entry) <= 5 and set(cold) <= set(entry)
        assert all(entry[t].logprob == pytest.approx(cold[t].logprob, abs=1e-6) for t in cold)


def test_prompt_forms_agree(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    text = "t1 t5 t9 t12"
    ids = llm.get_tokenizer()(text)["input_ids"]  # as generate encodes a str
    outs = llm.beam_search([text, {"prompt": text}, {"prompt_token_ids": ids}], params)
    assert [[s.tokens[:len(ids)] for s in out.sequences] for out in outs] == [[ids, ids]] * 3
    assert [[s.tokens for s in out.sequences] for out in outs] == [[s.tokens for s in outs[2].sequences]] * 3


def test_beams_stop_at_the_context(llm, next_logprobs):
    prompt = [1] + list(range(100, 100 + MAX_MODEL_LEN - 3))  # room for 2 tokens
    out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=2, max_tokens=6))[0]
    eos_ids = set(llm.llm_engine.eos_token_ids)
    assert_same_beams(out, reference_beam_search(next_logprobs, prompt, 2, 2, eos_ids), prompt, llm.get_tokenizer())
    assert max(len(s.tokens) for s in out.sequences) == MAX_MODEL_LEN


def test_bad_input_names_the_value(llm):
    for field in ("beam_width", "max_tokens"):
        with pytest.raises(ValueError, match=f"{field} must be an int >= 1, got 0"):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 2, field: 0})
    with pytest.raises(ValueError, match="temperature must be >= 0, got -1"):
        BeamSearchParams(beam_width=2, max_tokens=2, temperature=-1)
    with pytest.raises(ValueError, match="beam_width=11 needs 22 candidates a step, more than max_logprobs=20"):
        llm.beam_search(PROMPT_IDS, BeamSearchParams(beam_width=11, max_tokens=2))
    too_long = [5] * MAX_MODEL_LEN
    with pytest.raises(ValueError, match=f"prompt of {MAX_MODEL_LEN} tokens does not fit the context of "
                                         f"{MAX_MODEL_LEN} tokens"):
        llm.beam_search([PROMPT_IDS, {"prompt_token_ids": too_long}], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(TypeError, match="unknown field.*'beam_size': did you mean 'beam_width'"):
        BeamSearchParams(beam_size=2, max_tokens=2)
    with pytest.raises(TypeError, match="params must be a BeamSearchParams, got SamplingParams"):
        llm.beam_search(PROMPT_IDS, SamplingParams())
    with pytest.raises(NotImplementedError, match="lora_request"):
        llm.beam_search(PROMPT_IDS, BeamSearchParams(beam_width=2, max_tokens=2), lora_request=object())
    assert not llm.llm_engine.has_unfinished()  # nothing was queued
