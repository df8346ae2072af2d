"""The engine on real SmolLM2 weights: greedy tokens (batched, chunked prefill) and logprobs equal
transformers' own on the whole model; on its pruned copy (conftest.write_smollm2_pruned: same tokenizer,
six of the 30 layers, a fifth of the compile time) batching, preemption and prefix caching never change
greedy tokens, and seeded sampling, stop words and n > 1 behave."""
import numpy as np
import pytest
import torch

from conftest import SMOLLM2_CHATS, SMOLLM2_PROMPTS
from lmjax import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)
LONG_TEXT = ("JAX is a Python library for accelerator-oriented array computation and program transformation, "
             "designed for high-performance numerical computing and large-scale machine learning. ")


def _mixed_prompts(tokenizer):
    """16 prompts from 3 to ~350 tokens: plain, chat-templated, and long ones that need chunked prefill."""
    plain = [tokenizer(p)["input_ids"] for p in SMOLLM2_PROMPTS]
    chats = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)
             ["input_ids"] for m in SMOLLM2_CHATS]
    longs = [tokenizer(LONG_TEXT * k + f" Question {k}: what is JAX?")["input_ids"] for k in (1, 3, 6, 10)]
    rng = np.random.default_rng(0)
    randoms = [rng.integers(100, 40000, n).tolist() for n in (7, 64, 65, 129)]
    return plain + chats + longs + randoms


def _llm(path: str) -> LLM:
    # A small token budget per step forces chunked prefill of the long prompts.
    return LLM(path, dtype="float32", max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    return _llm(smollm2_gguf)


@pytest.fixture(scope="module")
def pruned(smollm2_pruned):
    return _llm(smollm2_pruned)


@pytest.fixture(scope="module")
def prompts(llm):
    return _mixed_prompts(llm.get_tokenizer())


def _greedy(llm, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def batched(llm, prompts):
    return _greedy(llm, prompts)


@pytest.fixture(scope="module")
def pruned_batched(pruned, prompts):
    batched = _greedy(pruned, prompts)
    assert len({tuple(t) for t in batched}) == len(prompts)  # prompt-dependent tokens: the checks can fail
    return batched


def _hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_batched_greedy_equals_transformers(batched, prompts, smollm2_hf_model):
    assert len(prompts) == 16 and max(map(len, prompts)) > 256
    for ids, got in zip(prompts, batched):
        assert got == _hf_greedy(smollm2_hf_model, ids, GREEDY.max_tokens)


def test_batched_greedy_equals_alone(pruned, pruned_batched, prompts):
    # One prompt of each kind (plain English and Chinese, chat, the longest chunked one, 65 random ids)
    # against the full batch of 16.
    for i in (0, 4, 5, 11, 14):
        alone = pruned.generate([prompts[i]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert alone == pruned_batched[i], i


def test_compilations_are_bounded_and_counted(llm):
    runner = llm.llm_engine.runner
    assert 0 < runner.num_compilations <= 40


def test_preemption_keeps_tokens(smollm2_pruned, prompts, pruned_batched):
    # 12 usable blocks of 16 tokens; the 8 requests need ~24 at their longest: preemption must happen.
    small = LLM(smollm2_pruned, dtype="float32", max_model_len=1024, max_num_seqs=8, block_size=16,
                num_gpu_blocks_override=13, max_num_batched_tokens=128)
    chosen = [i for i, p in enumerate(prompts) if len(p) <= 70][:8]
    outs = small.generate([prompts[i] for i in chosen], GREEDY, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [pruned_batched[i] for i in chosen]
    assert small.llm_engine.blocks.num_free_blocks == small.llm_engine.blocks.num_usable_blocks


def test_prefix_caching_same_tokens_and_hits(smollm2_pruned, pruned):
    tok = pruned.get_tokenizer()
    system = LONG_TEXT * 3
    prompts = [tok(system + q)["input_ids"] for q in (" Who made JAX?", " Is JAX fast?", " Name a JAX library.")]
    cached = LLM(smollm2_pruned, dtype="float32", max_model_len=1024, enable_prefix_caching=True, block_size=16)
    first = cached.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = cached.generate(prompts[1:], GREEDY, use_tqdm=False)
    reference = pruned.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in reference]
    assert cached.llm_engine.stats()["prefix_cache_hits"] > 0
    assert all(o.num_cached_tokens >= 16 * 4 for o in rest)
    # prompt logprobs need every prompt position's logits: such a request computes its whole prompt
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    again = cached.generate(prompts[:1], scored, use_tqdm=False)[0]
    want = pruned.generate(prompts[:1], scored, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.prompt_logprobs[0] is None
    assert [e[t].logprob for t, e in zip(prompts[0][1:], again.prompt_logprobs[1:])] == \
        pytest.approx([e[t].logprob for t, e in zip(prompts[0][1:], want.prompt_logprobs[1:])], abs=1e-4)


def test_seeded_sampling_independent_of_batch(pruned, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16)
    alone = pruned.generate([prompts[2]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16)
    mixed = pruned.generate([prompts[0], prompts[1], prompts[2], prompts[3]], [others, others, params, others],
                         use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=16)
    assert pruned.generate([prompts[2]], different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_completions_are_seeded_and_distinct(pruned, prompts):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    first = pruned.generate([prompts[5]], params, use_tqdm=False)[0].outputs
    again = pruned.generate([prompts[5]], params, use_tqdm=False)[0].outputs
    assert [c.index for c in first] == [0, 1, 2]
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) > 1
    # vLLM's seeds for n > 1: completion i is the single request with seed + i
    single = SamplingParams(n=1, temperature=1.0, seed=9, max_tokens=12)
    assert pruned.generate([prompts[5]], single, use_tqdm=False)[0].outputs[0].token_ids == first[2].token_ids


def test_stop_token_text_is_left_out_and_min_tokens_holds_stop_strings(pruned, prompts):
    """As vLLM: the text leaves out the token that stopped the request (token_ids keep it) unless
    include_stop_str_in_output; stop strings are not looked for before min_tokens tokens."""
    tok = pruned.get_tokenizer()
    full = pruned.generate([prompts[1]], GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[5]
    pieces = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    cut = pruned.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
                          use_tqdm=False)[0].outputs[0]
    end = cut.token_ids.index(stop_id) + 1
    assert cut.token_ids == full.token_ids[:end] and cut.stop_reason == stop_id
    assert cut.text == pieces[end - 1]
    kept = pruned.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id],
                                                        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == pieces[end]
    stop = tok.decode(full.token_ids[1:3]).strip()  # text of the 2nd and 3rd tokens
    early = pruned.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    late = pruned.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=24, stop=[stop], min_tokens=6),
                           use_tqdm=False)[0].outputs[0]
    assert len(early.token_ids) <= 3 and early.finish_reason == "stop"
    assert len(late.token_ids) >= 6 and late.text.startswith(full.text[:full.text.index(stop) + len(stop)])


def test_byte_level_text_is_the_output_decoded_alone(pruned):
    """The text continues the prompt (vLLM's); byte-level BPE tokens carry their own spaces, so that is
    still the output decoded alone: plain, Chinese and chat-templated prompts."""
    tok = pruned.get_tokenizer()
    for out in pruned.generate(_mixed_prompts(tok)[:8], GREEDY, use_tqdm=False):
        c = out.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True,
                                    clean_up_tokenization_spaces=False).rstrip("\ufffd")


def test_stop_string_split_across_tokens(pruned, prompts):
    tok = pruned.get_tokenizer()
    full = pruned.generate([prompts[1]], GREEDY, use_tqdm=False)[0].outputs[0]
    pieces = [tok.decode([t]) for t in full.token_ids]
    # A stop string made of the end of one token and the start of the next.
    i = next(i for i in range(2, len(pieces) - 1) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 1)
    stop = pieces[i][-2:] + pieces[i + 1][:1]
    expected = full.text[: full.text.index(stop)]
    out = pruned.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)
    assert out[0].outputs[0].text == expected
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == stop


def test_logprobs_match_reference_log_softmax(llm, prompts, smollm2_hf_model):
    ids = prompts[0]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    with torch.no_grad():
        logits = smollm2_hf_model(torch.tensor([ids + gen])).logits[0]
    ref = torch.log_softmax(logits.double(), dim=-1).numpy()
    for step, (token, entry) in enumerate(zip(gen, out.outputs[0].logprobs)):
        row = ref[len(ids) - 1 + step]
        assert set(np.argsort(-row)[:3]) | {token} == set(entry)
        for tid, lp in entry.items():
            assert abs(lp.logprob - row[tid]) < 1e-3
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert abs(out.prompt_logprobs[pos][ids[pos]].logprob - ref[pos - 1][ids[pos]]) < 1e-3

    def true_rank(row, tid):  # vLLM's rank: 1 + tokens more likely, give or take near-ties
        return 1 + np.sum(row > row[tid] + 1e-3), 1 + np.sum(row > row[tid] - 1e-3)
    ranks = [(out.prompt_logprobs[pos][ids[pos]].rank, *true_rank(ref[pos - 1], ids[pos])) for pos in range(1, len(ids))]
    ranks += [(e[t].rank, *true_rank(ref[len(ids) - 1 + i], t)) for i, (t, e) in enumerate(zip(gen, out.outputs[0].logprobs))]
    assert all(lo <= rank <= hi for rank, lo, hi in ranks), ranks
    assert max(rank for rank, _, _ in ranks) > 3  # prompt tokens outside the top-k: counted, not k + 1


def test_stream_never_emits_broken_utf8(smollm2_gguf):
    from lmjax import GenerationConfig, pipeline

    pipe = pipeline(smollm2_gguf, log_level="ERROR")
    pieces = list(pipe.stream_infer(["请用中文介绍一下上海。"], GenerationConfig(max_new_tokens=24)))
    # Mid-stream, a character split across tokens is held back until complete. Only the final flush may
    # carry U+FFFD: when generation stops inside a character, as tokenizer.decode shows it too.
    assert pieces and all("\ufffd" not in p.text for p in pieces[:-1])
    whole = pipe("请用中文介绍一下上海。", GenerationConfig(max_new_tokens=24))
    assert "".join(p.text for p in pieces) == whole.text
    assert pieces[-1].finish_reason in ("stop", "length")
