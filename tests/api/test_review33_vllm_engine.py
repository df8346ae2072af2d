"""Review 33 of vLLM's engine-level API and the entry points beside LLM.generate: a prompt dict's cache_salt
keeps LLMEngine.add_request, LLM.beam_search and LLM.embed off other salts' cached blocks (as generate); an
auto request id never takes one a caller chose; a request another caller's stepping finished (LLM.generate on
the same engine) gets its final output from the next LLMEngine.step(); request ids are str (vLLM's)."""
import itertools

import pytest

from lmjax import BeamSearchParams, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from tiny_llama import write_tiny_llama

LONG = " ".join(f"t{5 + i}" for i in range(40))  # full blocks of 16 to share
GREEDY = SamplingParams(temperature=0, max_tokens=2)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    return LLMEngine.from_engine_args(EngineArgs(path, max_model_len=128, num_scheduler_steps=1, max_num_seqs=4,
                                                 block_size=16))


def _hits(engine, run) -> int:
    before = engine.llm.llm_engine.stats()["prefix_cache_hits"]
    run()
    return engine.llm.llm_engine.stats()["prefix_cache_hits"] - before


def _drain(engine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_a_salted_prompt_shares_no_unsalted_block(engine):
    llm = engine.llm
    assert _hits(engine, lambda: llm.generate(LONG, GREEDY, use_tqdm=False)) == 0
    shared = _hits(engine, lambda: llm.generate(LONG, GREEDY, use_tqdm=False))
    assert shared >= 32  # (the cache works: whole blocks of the prompt)
    engine.add_request("salted", {"prompt": LONG, "cache_salt": "a"}, GREEDY)
    assert _drain(engine)[-1].num_cached_tokens == 0
    beam = BeamSearchParams(beam_width=1, max_tokens=1)
    assert _hits(engine, lambda: llm.beam_search({"prompt": LONG, "cache_salt": "b"}, beam)) == 0
    assert _hits(engine, lambda: llm.embed({"prompt": LONG, "cache_salt": "c"}, use_tqdm=False)) == 0
    assert _hits(engine, lambda: llm.embed({"prompt": LONG}, use_tqdm=False)) == shared  # unsalted shares
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("bad-salt", {"prompt": LONG, "cache_salt": ""}, GREEDY)


def test_auto_ids_leave_a_chosen_one_alone(engine, monkeypatch):
    import lmjax.engine.request as request

    monkeypatch.setattr(request, "_request_ids", itertools.count(1000))
    inner = engine.llm.llm_engine
    engine.add_request("1000", "t5 t9 t12", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.step()
    out = engine.llm.generate("t7 t8", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.request_id != "1000" and "1000" in inner.requests
    engine.abort_request("1000")
    assert not engine.has_unfinished_requests() and not inner.has_unfinished()
    assert inner.blocks.num_free_blocks == inner.blocks.num_usable_blocks


def test_a_request_finished_by_another_callers_steps_gets_its_final_output(engine):
    params = SamplingParams(temperature=0, max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("live", "t5 t9", params)
    alone = engine.llm.generate("t5 t9", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    engine.llm.generate("t7 t8", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)  # finishes "live"
    outs = engine.step()
    assert [o.request_id for o in outs] == ["live"] and outs[0].finished
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert not engine.has_unfinished_requests()


def test_request_ids_are_str(engine):
    with pytest.raises(TypeError, match="request_id must be a str, got int 5"):
        engine.add_request(5, "t5", GREEDY)
    with pytest.raises(TypeError, match="request ids are str"):
        engine.abort_request(5)
    assert not engine.has_unfinished_requests()
