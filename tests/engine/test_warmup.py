"""Warm-up compiles what serving runs: a warmed engine's decode calls, chained or not, reuse warm-up's programs."""
import pytest

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


def test_chained_decode_calls_reuse_the_warmed_programs(tiny):
    """A chained call's input tokens are a device array (the previous call's output); warm-up's and unchained
    calls' were numpy, which jit compiles as another program: each batch bucket's first chained call compiled the
    whole decode loop again in the middle of serving (~4 s on the CPU, seconds on a GPU)."""
    llm = LLM(tiny, max_model_len=128, block_size=8, enforce_eager=False, max_num_seqs=8, num_scheduler_steps=4)
    runner = llm.llm_engine.runner
    warmed = runner._decode.jitted._cache_size()
    loops = llm.llm_engine.num_decode_loops
    greedy = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)  # the variant warm-up compiles
    for n in (1, 3, 6):
        llm.generate([[5, 9, 12, 30, 41 + i] for i in range(n)], greedy, use_tqdm=False)
    assert llm.llm_engine.num_decode_loops >= loops + 6  # chained K-step calls ran
    assert runner._decode.jitted._cache_size() == warmed


def test_warmup_compiles_the_chaining_programs(tiny, monkeypatch):
    """With padded steps (forced here), warm-up also compiles the tiny programs that pass a call's tokens to a
    chained decode call (pending_ids: a one-step call's R rows, padded or not, and a K-step call's [K, B])."""
    from lmjax.engine.decode_loop import pending_ids

    monkeypatch.setenv("LMJAX_BACKGROUND_COMPILE", "1")
    monkeypatch.setenv("LMJAX_PAD_TO_COMPILED", "1")
    llm = LLM(tiny, max_model_len=128, block_size=8, enforce_eager=False, max_num_seqs=8, num_scheduler_steps=4,
              max_num_batched_tokens=256)
    warmed = pending_ids._cache_size()
    greedy = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    for n in (1, 3, 6, 8):
        llm.generate([[5, 9, 12, 30, 41 + i] * 3 for i in range(n)], greedy, use_tqdm=False)
    assert llm.llm_engine.num_chained_loops > 0 and pending_ids._cache_size() == warmed


def test_warmup_lowers_and_compiles_each_program_once(tiny, monkeypatch):
    """Warm-up rows that share a program (same sampling flags; or any non-basic variant, whose step is the one
    sampled apart) lower and compile it once: each row added the sampled-apart step programs again, compiled
    twice on the pool."""
    from lmjax.engine.warmup import large_step_dims

    monkeypatch.setenv("LMJAX_BACKGROUND_COMPILE", "1")
    monkeypatch.setenv("LMJAX_PAD_TO_COMPILED", "1")
    llm = LLM(tiny, max_model_len=64, block_size=8, enforce_eager=False, max_num_seqs=4, num_scheduler_steps=4,
              max_num_batched_tokens=64)
    engine = llm.llm_engine
    steps = 2 * len(large_step_dims(engine.runner))  # greedy fused and sampled apart, per shape
    decodes = engine.warmup_stats["programs"] - steps
    assert decodes > 0 and steps > 0
    rows = [SamplingParams(temperature=0), SamplingParams(temperature=0, seed=7), SamplingParams(top_p=0.5)]
    stats = engine.warmup(rows)
    assert stats["programs"] == 2 * decodes + steps  # top-p adds its decode calls only
    assert stats["failed"] == 0
