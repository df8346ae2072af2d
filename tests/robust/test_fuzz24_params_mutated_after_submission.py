"""The engines keep the caller's SamplingParams object: changing it after add_request changes the request
already running, and a change the checks would have refused escapes engine.step() in a multi-step decode.

lmjax.LLMEngine.add_request (vLLM's engine API, lmjax/api/vllm_engine.py:62) and llm.llm_engine.add_request
(lmjax/engine/engine.py:102-125) store `params` itself on the Request (only in_vocab_terms sometimes replaces it).
vLLM clones the params at submission (SamplingParams.clone(), "defensive copy"), so the common loop "add a
request, tweak the shared params, add the next" leaves the first request alone there. Here the first request
changes mid-run: temperature/seed, logit_bias or repetition_penalty set after its first step change the tokens
it samples from then on.

Second, a row that cannot be packed (what _inputs_failed, lmjax/engine/engine.py:287, handles: the request
fails alone with "error", tests/robust/test_robust_llm_inputs.py) is handled only where a step is first
dispatched. In a chained multi-step decode (MultiStepMixin._finish_pending, lmjax/engine/multistep.py:86-88, and
_decode_after, multistep.py:27-29) dispatch_decode's StepInputError is not caught: engine.step() raises it to the
caller's loop (under AsyncEngine, EngineThread._step would fail every live request with "engine step failed")."""

import pytest

from lmjax import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from tiny_server_fixtures import tiny  # noqa: F401 (pytest fixtures)


def _greedy(**kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **kw})


def _run(engine):
    finished = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
    return finished


@pytest.mark.parametrize("change", [dict(temperature=1.0, seed=3), dict(logit_bias={7: 50.0}),
                                    dict(repetition_penalty=1.5)])
def test_changing_the_params_after_submission_leaves_the_running_request_alone(tiny, change):
    engine = LLMEngine.from_engine_args(EngineArgs(tiny, max_model_len=128, block_size=16))
    engine.add_request("alone", [7, 8], _greedy())
    alone = _run(engine)["alone"]
    params = _greedy()
    engine.add_request("a", [7, 8], params)
    engine.step()
    for name, value in change.items():  # e.g. to submit the next request with other settings
        setattr(params, name, value)
    assert _run(engine)["a"] == alone
