"""vLLM's engine-level API (lmjax.LLMEngine / EngineArgs, RequestOutputKind) on a tiny random Llama: the
step-by-step outputs add up to what LLM.generate returns, per output kind; abort, duplicate ids and bad
params behave as in vLLM."""
import pytest

from conftest import write_tiny_llama
from lmjax import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams

PROMPTS = ["t5 t9 t12 t30", "t7 t8"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    return LLMEngine.from_engine_args(EngineArgs(path, max_model_len=128, num_scheduler_steps=4, max_num_seqs=4))


def _params(kind, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, output_kind=kind, **kw)


def _run(engine, params_list) -> dict[str, list]:
    for i, (prompt, params) in enumerate(zip(PROMPTS, params_list)):
        engine.add_request(f"r{i}", prompt, params)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_each_output_kind_adds_up_to_generate(engine):
    final = engine.llm.generate(PROMPTS, _params(RequestOutputKind.CUMULATIVE, prompt_logprobs=1), use_tqdm=False)
    kinds = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA]
    seen = _run(engine, [_params(k, prompt_logprobs=1) for k in kinds])
    cumulative, delta = seen["r0"], seen["r1"]
    ids = [o.outputs[0].token_ids for o in cumulative]
    assert all(a == b[:len(a)] for a, b in zip(ids, ids[1:])) and len(ids) > 1  # each holds all so far
    assert cumulative[-1].outputs[0].token_ids == final[0].outputs[0].token_ids
    assert cumulative[-1].outputs[0].text == final[0].outputs[0].text and cumulative[-1].finished
    assert [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]
    assert sum((o.outputs[0].token_ids for o in delta), []) == final[1].outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in delta) == final[1].outputs[0].text
    assert sum((o.outputs[0].logprobs for o in delta), []) == final[1].outputs[0].logprobs
    assert delta[0].prompt_logprobs == final[1].prompt_logprobs and all(o.prompt_logprobs is None for o in delta[1:])
    seen = _run(engine, [_params(RequestOutputKind.FINAL_ONLY)] * 2)
    assert [len(seen["r0"]), len(seen["r1"])] == [1, 1] and seen["r1"][0].finished
    assert seen["r1"][0].outputs[0].token_ids == final[1].outputs[0].token_ids


def test_abort_duplicates_and_bad_params(engine):
    engine.add_request("a", PROMPTS[0], _params(RequestOutputKind.CUMULATIVE), arrival_time=1.0)
    engine.add_request("b", PROMPTS[1], _params(RequestOutputKind.CUMULATIVE))
    with pytest.raises(ValueError, match="request id 'a' is already in use"):
        engine.add_request("a", PROMPTS[1], _params(RequestOutputKind.CUMULATIVE))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("c", [5, 999], _params(RequestOutputKind.CUMULATIVE))
    assert engine.get_num_unfinished_requests() == 2
    first = engine.step()
    engine.abort_request(["a", "unknown"])
    rest = []
    while engine.has_unfinished_requests():
        rest += engine.step()
    assert {o.request_id for o in rest} == {"b"} and rest[-1].finished
    assert next(o for o in first if o.request_id == "a").metrics.arrival_time == 1.0
    with pytest.raises(TypeError, match="params must be SamplingParams"):
        engine.add_request("d", PROMPTS[0], {"max_tokens": 3})


def test_delta_sends_each_completion_when_it_moves_and_vllm_habits_are_named(engine):
    """DELTA with n > 1: a completion appears when it has new tokens, and once more only to say it finished;
    the vLLM facades refuse LMDeploy's row outputs (RequestOutput has no place for them); lmjax's own engine
    names vLLM's add_request form; an n above max_num_seqs runs in waves."""
    stops = SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=12, min_tokens=1, stop_token_ids=[50, 60, 70],
                           output_kind=RequestOutputKind.DELTA)
    engine.add_request("n3", PROMPTS[0], stops)
    seen = []
    while engine.has_unfinished_requests():
        seen += [c for out in engine.step() for c in out.outputs]
    for i in range(3):
        mine = [c for c in seen if c.index == i]
        assert all(c.token_ids or c.finish_reason for c in mine)
        assert [c.finish_reason is not None for c in mine].count(True) == 1 and mine[-1].finish_reason
    with pytest.raises(ValueError, match="output_logits='all' is LMDeploy's"):
        engine.add_request("rows", PROMPTS[0], SamplingParams(output_logits="all"))
    with pytest.raises(ValueError, match="output_last_hidden_state='generation' is LMDeploy's"):
        engine.llm.generate(PROMPTS[0], SamplingParams(output_last_hidden_state="generation"), use_tqdm=False)
    with pytest.raises(TypeError, match="vLLM's add_request\\(request_id, prompt, params\\) is lmjax.LLMEngine's"):
        engine.llm.llm_engine.add_request("7", "t5 t9", SamplingParams())
    wide = engine.llm.generate(PROMPTS[1], SamplingParams(n=6, max_tokens=3, seed=0), use_tqdm=False)[0]
    assert len(wide.outputs) == 6 and all(len(c.token_ids) == 3 for c in wide.outputs)
