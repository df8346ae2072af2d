"""Several decode steps per host round trip (num_scheduler_steps) give exactly the tokens, text, logprobs
and finish reasons of one step at a time: greedy and seeded sampling, stop tokens, stop strings, EOS,
max_tokens that end inside a K-step window."""
import jax
import numpy as np
import pytest

from conftest import continuation_text, write_tiny_llama
from lmjax import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


def _same(got, want):
    """Equal outputs; off CPU the logprob values to float32 rounding (programs compiled for K steps or for
    one fuse and round differently on a GPU; tokens, text and finish reasons stay exact)."""
    if jax.default_backend() == "cpu":
        assert got == want
        return
    strip = lambda outs: [o[:4] for o in outs]  # noqa: E731
    assert strip(got) == strip(want)
    for g, w in zip(got, want):
        assert (g[4] is None) == (w[4] is None)
        for g_pos, w_pos in zip(g[4] or (), w[4] or ()):
            assert [t for t, _ in g_pos] == [t for t, _ in w_pos]
            np.testing.assert_allclose([lp.logprob for _, lp in g_pos], [lp.logprob for _, lp in w_pos], atol=1e-4)


def _run(path, steps, prompts, params):
    llm = LLM(path, max_model_len=256, num_scheduler_steps=steps, block_size=16)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                  [sorted(e.items()) for e in c.logprobs] if c.logprobs else None)
                 for o in outs for c in o.outputs]


def test_multistep_equals_single_step(tiny):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 256, n).tolist() for n in (3, 17, 30, 5, 64, 9)]
    params = [SamplingParams(temperature=0, max_tokens=13),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=21),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[17, 99, 200]),
              SamplingParams(temperature=1.0, top_k=20, seed=9, max_tokens=7, logprobs=2, n=2),
              SamplingParams(temperature=0, max_tokens=30, stop=["t1", "t5"]),
              SamplingParams(temperature=0, max_tokens=33)]
    multi, got = _run(tiny, 8, prompts, params)
    single, want = _run(tiny, 1, prompts, params)
    _same(got, want)
    assert multi.llm_engine.num_decode_loops > 0 and single.llm_engine.num_decode_loops == 0
    engine = multi.llm_engine
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


def test_calls_dispatched_before_the_previous_is_read_change_nothing(tiny):
    """Long outputs: each K-step call is dispatched while the previous one's tokens are still on the
    device (positions, blocks and seeded-sampling steps run K ahead of what the host has read); tokens,
    logprobs and finish reasons equal one step at a time, EOS and stop strings ending mid-chain."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(4, 256, n).tolist() for n in (5, 40, 21, 11)]
    params = [SamplingParams(temperature=0, max_tokens=70, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=30, seed=3, max_tokens=61, logprobs=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=66, stop_token_ids=[7, 50, 123]),
              SamplingParams(temperature=1.0, seed=11, max_tokens=75, stop=["t9"])]
    multi, got = _run(tiny, 4, prompts, params)
    _, want = _run(tiny, 1, prompts, params)
    _same(got, want)
    assert multi.llm_engine.num_chained_loops > 0
    engine = multi.llm_engine
    assert engine._pending is None and engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


@pytest.mark.parametrize("steps", [8, 1])
def test_warmup_compiles_every_decode_bucket_up_front(tiny, steps, caplog, monkeypatch):
    """LLM(enforce_eager=False) compiles each decode batch bucket at start-up, so a batch that shrinks
    as its requests finish compiles no decode step; the warm-up's padding-only steps leave the cache
    (and so the tokens) unchanged. (The tiled attention on any backend: one block-table width.)"""
    monkeypatch.setenv("LMJAX_ATTENTION_IMPL", "tiled")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, 256, 12).tolist() for _ in range(9)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 5, 9, 14, 20, 26, 31, 40, 50)]
    warm = LLM(tiny, max_model_len=256, num_scheduler_steps=steps, block_size=16, max_num_seqs=16,
               enforce_eager=False)
    engine = warm.llm_engine
    assert engine.runner.fixed_M
    floor = engine.runner.min_decode_B if steps > 1 else 4  # 4 on CPU; 1 on GPU for one-row GEMV layers
    assert engine.runner.num_compilations == len([b for b in (1, 2, 4, 8, 16) if b >= floor])
    assert engine.warmup(max_batch_size=16)["compilations"] == 0  # all cached
    with caplog.at_level("INFO", logger="lmjax.engine"):
        got = warm.generate(prompts, params, use_tqdm=False)
    decode_compiles = [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()
                       and ("step decode" in r.getMessage() or " T=16 " in r.getMessage())]
    assert decode_compiles == []
    lazy = LLM(tiny, max_model_len=256, num_scheduler_steps=steps, block_size=16, max_num_seqs=16)
    want = lazy.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [len(o.outputs[0].token_ids) for o in got] == [p.max_tokens for p in params]


def test_gpu_decode_floor_of_one_row_gives_the_same_tokens(tiny, monkeypatch, caplog):
    """With int4 weights on GPU the multi-step decode call pads a batch to 1, 2, 4, ... rows (not 4 at
    least): a batch-1 step runs one row. Forced here on CPU: same greedy tokens as the 4-row floor, decode compiled at
    B=1 and B=2, and the warm-up covers those buckets too. (The tiled attention: one block-table width.)"""
    monkeypatch.setenv("LMJAX_ATTENTION_IMPL", "tiled")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(4, 256, n).tolist() for n in (7, 19)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 30)]
    _, want = _run(tiny, 8, prompts, params)
    monkeypatch.setenv("LMJAX_DECODE_BATCH_FLOOR", "1")
    with caplog.at_level("INFO", logger="lmjax.engine"):
        llm, got = _run(tiny, 8, prompts, params)
    assert got == want and llm.llm_engine.runner.min_decode_B == 1
    batches = {r.getMessage().split("B=")[1].split()[0] for r in caplog.records if "step decode" in r.getMessage()}
    assert batches == {"1", "2"}  # both rows, then the longer one alone
    runner = llm.llm_engine.runner
    before = runner.num_compilations
    assert llm.llm_engine.warmup(max_batch_size=4)["compilations"] == runner.num_compilations - before
    assert runner.fixed_M and runner.num_compilations - before == 3 - len(batches)  # buckets 1, 2, 4: 1, 2 cached
    monkeypatch.setenv("LMJAX_DECODE_BATCH_FLOOR", "3")
    with pytest.raises(ValueError, match="LMJAX_DECODE_BATCH_FLOOR=3"):
        LLM(tiny, max_model_len=256)


def test_multistep_while_requests_wait(tiny):
    """With more requests than max_num_seqs, the full batch still decodes K steps per round trip (K
    stopping at the first max_tokens, so waiting requests join as soon as a slot frees), with
    the tokens of one step at a time."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(4, 256, int(n)).tolist() for n in rng.integers(3, 40, 12)]
    params = [SamplingParams(temperature=0, max_tokens=33 if i < 8 else int(m), ignore_eos=i % 3 != 0)
              for i, m in enumerate(rng.integers(5, 40, 12))]

    def run(steps):
        llm = LLM(tiny, max_model_len=256, num_scheduler_steps=steps, block_size=16, max_num_seqs=4)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return llm.llm_engine, [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]

    multi, got = run(8)
    _, want = run(1)
    assert got == want
    # The first two waves of 4 (33 tokens each, 8 requests waiting, then 4) decode 4 loops of 8 steps
    # each; without multi-step while requests wait, only the last wave could.
    assert multi.num_decode_loops >= 8


def test_block_table_width_is_fixed_only_when_attention_follows_context(tiny, monkeypatch):
    """Off GPU the tiled attention loops over real blocks, so every step pads its block table to one
    width (one compilation per batch bucket); the reference scans the whole width: width buckets."""
    from lmjax.layers.attention import cost_follows_context

    assert cost_follows_context("tiled") and not cost_follows_context("reference")
    monkeypatch.setenv("LMJAX_ATTENTION_IMPL", "tiled")  # CPU's default; explicit for GPU runs
    runner = LLM(tiny, max_model_len=256, block_size=16).llm_engine.runner
    assert runner.fixed_M and {runner.table_width(n) for n in (1, 3, 9)} == {runner.max_M}
    monkeypatch.setenv("LMJAX_ATTENTION_IMPL", "reference")
    runner = LLM(tiny, max_model_len=256, block_size=16).llm_engine.runner
    assert not runner.fixed_M and [runner.table_width(n) for n in (1, 3, 9)] == [1, 4, 16]


def test_text_without_stop_strings_is_decoded_when_read(tiny, monkeypatch):
    """Requests without stop strings keep detokenization off the engine's per-token path: generate
    decodes each output twice, its tokens so far while the device runs the call that reaches max_tokens
    (off the request's critical path) and that call's tokens at the end; the text is what eager
    decoding gives."""
    from lmjax.engine import detokenizer

    calls = []
    step = detokenizer.IncrementalDetokenizer.step
    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "step",
                        lambda self, ids: calls.append(len(ids)) or step(self, ids))
    llm = LLM(tiny, max_model_len=256, block_size=16)
    prompts = [{"prompt_token_ids": list(range(4, 20))}, {"prompt_token_ids": list(range(30, 37))}]
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert len(calls) == 4 and sum(calls) == 40  # two catch-ups per request, none per token
    tok = llm.get_tokenizer()
    # a continuation of the prompt, as vLLM's: " t103 t50 ..." (the word-level decoder joins words with spaces)
    assert [o.outputs[0].text for o in out] == [continuation_text(tok, o.prompt_token_ids, o.outputs[0].token_ids)
                                                for o in out]


def test_first_decode_call_goes_out_behind_the_prefill(tiny):
    """A prefill step whose every item samples is followed by its first K-step call before its tokens are
    read (the call takes them on the device): a call is in flight when the prefill step returns, and the
    tokens equal one step at a time; when the prefill's token ends the request, that call's tokens are
    dropped and its blocks freed; min_tokens (EOS and stop ids banned until then) keeps the host's step."""
    prompt = list(range(4, 40))
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    single = LLM(tiny, max_model_len=256, num_scheduler_steps=1, block_size=16)
    want = single.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine = LLM(tiny, max_model_len=256, num_scheduler_steps=4, block_size=16).llm_engine

    def run(params, pending_after_prefill):
        req = engine.add_request(prompt, params)
        engine.step()
        assert len(req.completions[0].token_ids) == 1 and (engine._pending is not None) == pending_after_prefill
        while engine.has_unfinished() or engine._pending is not None:
            engine.step()
        assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
        return req.completions[0]

    assert run(greedy, True).token_ids == want
    stopped = run(SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[want[0]]), True)
    assert (stopped.token_ids, stopped.finish_reason) == ([want[0]], "stop")
    held = run(SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[want[1]], min_tokens=1), False)
    assert (held.token_ids, held.finish_reason) == (want[:2], "stop")
