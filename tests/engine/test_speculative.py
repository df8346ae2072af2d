"""N-gram speculative decoding (vLLM's speculative_config={"method": "ngram"}) on a tiny random float32 Llama:
the outputs are exactly the non-speculative ones (tokens, logprobs, stops, lengths), in fewer engine steps;
sampled neighbours are untouched; blocks filled by confirmed drafts serve the prefix cache correctly."""
import numpy as np
import pytest

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams
from lmjax.speculative_config import SpeculativeConfig
from lmjax.engine.speculative import accepted, propose

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Repetitive prompts: the tiny model's greedy outputs fall into loops, which the lookup then drafts
PROMPTS = ["t5 t9 t32 t30 t5 t9 t32 t30 t5 t9", "t7 t8 t7 t8 t7", "t40 t41 t42", "t60 t61 t60 t61 t60 t61"]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


@pytest.fixture(scope="module")
def llms(path):
    kw = dict(max_model_len=256, enable_prefix_caching=True, block_size=16, num_scheduler_steps=1)
    return LLM(path, **kw), LLM(path, **kw, speculative_config=SPEC)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, "ignore_eos": True, **kw})


def _steps(llm, prompts, params):
    engine = llm.llm_engine
    reqs = [engine.add_request(engine.tokenizer.encode(p), params) for p in prompts]
    steps = 0
    while not all(r.finished for r in reqs):
        engine.step()
        steps += 1
    return reqs, steps


def test_outputs_are_exactly_the_plain_ones_in_fewer_steps(llms):
    base, spec = llms
    params = _greedy(logprobs=2)
    plain, plain_steps = _steps(base, PROMPTS, params)
    drafted0, accepted0 = spec.llm_engine.num_draft_tokens, spec.llm_engine.num_accepted_tokens
    fast, fast_steps = _steps(spec, PROMPTS, params)
    for a, b in zip(plain, fast):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert a.completions[0].text == b.completions[0].text
        for x, y in zip(a.completions[0].logprobs, b.completions[0].logprobs):
            assert x.keys() == y.keys() and np.allclose(list(x.values()), list(y.values()), atol=1e-5)
    accepted_now = spec.llm_engine.num_accepted_tokens - accepted0
    assert accepted_now > 20 and spec.llm_engine.num_draft_tokens > drafted0
    assert fast_steps < plain_steps - 10, (fast_steps, plain_steps)


@pytest.mark.parametrize("cut", ["max_tokens", "stop_token", "stop_string"])
def test_a_request_ends_where_it_would_without_drafts(llms, cut):
    base, spec = llms
    full = base.generate(PROMPTS[:2], _greedy(), use_tqdm=False)
    for out in full:
        ids = out.outputs[0].token_ids
        k = next(i for i in range(7, 30) if ids[i] not in ids[:i])  # a first occurrence, well inside
        params = {"max_tokens": _greedy(max_tokens=k + 1), "stop_token": _greedy(stop_token_ids=[ids[k]]),
                  "stop_string": _greedy(stop=[f"t{ids[k]}"])}[cut]
        a = base.generate([out.prompt], params, use_tqdm=False)[0].outputs[0]
        b = spec.generate([out.prompt], params, use_tqdm=False)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert len(a.token_ids) == k + 1 if cut != "stop_string" else a.finish_reason == "stop"


def test_sampled_neighbours_and_cached_prefixes_are_untouched(llms):
    base, spec = llms
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, seed=7, ignore_eos=True)
    outs = [llm.generate(PROMPTS[:2], [_greedy(), sampled], use_tqdm=False) for llm in (base, spec)]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
    # A prompt extending a speculated output reuses its blocks (registered once confirmed): same answer
    follow = outs[1][0].prompt_token_ids + outs[1][0].outputs[0].token_ids[:33]
    a = base.generate([{"prompt_token_ids": follow}], _greedy(max_tokens=12), use_tqdm=False)[0]
    b = spec.generate([{"prompt_token_ids": follow}], _greedy(max_tokens=12), use_tqdm=False)[0]
    assert b.num_cached_tokens >= 32 and b.outputs[0].token_ids == a.outputs[0].token_ids


def test_lookup_and_acceptance_rules():
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1)
    ids = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2])
    assert propose(ids, cfg, limit=3) == [3, 5, 6]  # the most recent match of (1, 2) with 3 tokens after it
    assert propose(ids, cfg, limit=1) == [3]
    assert propose(np.array([7, 8, 9]), cfg, limit=3) == []
    assert propose(np.array([4, 4, 4]), cfg, limit=3) == [4]  # only the earliest match has a token after it
    assert accepted([3, 5, 6], np.array([3, 5, 7, 0])) == 2 and accepted([3], np.array([2, 0])) == 0
    assert SpeculativeConfig(prompt_lookup_max=4).prompt_lookup_min == 4
    with pytest.raises(ValueError, match="speculative method 'eagle' is not supported"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match=r"speculative_config keys \['model'\] are not supported"):
        SpeculativeConfig.of({"method": "ngram", "model": "x"})


def test_after_every_step_the_cache_holds_exactly_the_real_tokens(llms):
    """Invariants a wrong draft must not break: a decoding sequence has only its newest token left to compute
    (confirmed drafts count as computed, none is recomputed) and its registered block hashes are those of its
    real tokens (a rejected draft's KV never enters the prefix cache)."""
    _, spec = llms
    engine = spec.llm_engine
    reqs = [engine.add_request(engine.tokenizer.encode(p), _greedy(max_tokens=60)) for p in PROMPTS]
    rejected0 = engine.num_draft_tokens - engine.num_accepted_tokens
    while not all(r.finished for r in reqs):
        engine.step()
        for r in reqs:
            seq = r.completions[0].seq
            if not seq.is_finished and seq.output_token_ids:
                assert seq.num_uncomputed == 1 and not seq.draft_token_ids
                ids, bs, parent = seq.token_ids, engine.config.block_size, seq.cache_salt
                for i, h in enumerate(seq.block_hashes):
                    parent = hash((parent, tuple(ids[i * bs:(i + 1) * bs])))
                    assert h == parent, f"block {i} of seq {seq.seq_id} hashed with tokens it does not hold"
    assert engine.num_draft_tokens - engine.num_accepted_tokens > rejected0  # some drafts were rejected


def test_preemption_and_a_small_cache_keep_the_outputs(path):
    """Drafts never take blocks another sequence needs, and a preempted sequence recomputes only real tokens:
    with a cache too small for all requests at once, the outputs are still the plain ones."""
    kw = dict(max_model_len=128, block_size=16, num_scheduler_steps=1, num_gpu_blocks_override=12)
    plain = LLM(path, **kw).generate(PROMPTS, _greedy(max_tokens=48), use_tqdm=False)
    spec = LLM(path, **kw, speculative_config=SPEC)
    fast = spec.generate(PROMPTS, _greedy(max_tokens=48), use_tqdm=False)
    assert spec.llm_engine.scheduler.num_preemptions > 0 and spec.llm_engine.num_accepted_tokens > 0
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]


def test_seeded_sampled_requests_draw_the_same_tokens_with_drafts(llms):
    """A sampled request speculates too: position j of a verified draft draws the noise plain decoding draws for
    that token, and keeping the draft while the samples equal it is speculative sampling's rule for a fixed
    draft, so a seeded request's tokens are the plain ones. (The tiny random model's distributions are nearly
    flat: only near-greedy temperatures repeat enough to draft.)"""
    base, spec = llms
    params = [SamplingParams(temperature=t, top_k=k, max_tokens=40, seed=s, ignore_eos=True, logprobs=1)
              for t, k, s in ((0.02, 0, 3), (0.05, 2, 11), (0.5, 0, 5), (1.0, 4, 7))]
    accepted0 = spec.llm_engine.num_accepted_tokens
    plain = base.generate(PROMPTS, params, use_tqdm=False)
    fast = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert spec.llm_engine.num_accepted_tokens - accepted0 > 10


def _propose_brute_force(ids: list[int], cfg: SpeculativeConfig, limit: int) -> list[int]:
    """The lookup's definition, written plainly: the largest n whose tail occurs earlier; the most recent such
    match with k tokens after it, else the earliest."""
    k, L = min(limit, cfg.num_speculative_tokens), len(ids)
    for n in range(min(cfg.prompt_lookup_max, L - 1), cfg.prompt_lookup_min - 1, -1):
        starts = [w + n for w in range(L - n) if ids[w:w + n] == ids[L - n:]]
        if starts and k > 0:
            full = [s for s in starts if s + k <= L]
            start = full[-1] if full else starts[0]
            return ids[start:start + k]
    return []


def test_lookup_matches_its_definition_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(500):
        ids = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40))).tolist()
        top = int(rng.integers(1, 5))
        cfg = SpeculativeConfig(num_speculative_tokens=int(rng.integers(1, 6)), prompt_lookup_max=top,
                                prompt_lookup_min=int(rng.integers(1, top + 1)))
        limit = int(rng.integers(0, 7))
        assert propose(np.array(ids), cfg, limit) == _propose_brute_force(ids, cfg, limit), (ids, cfg, limit)
