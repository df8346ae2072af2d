"""AsyncEngine.generate with a per-call chat_template_config: the template renders the prompt and its stop words
stop the reply (they were the engine template's only), as batch_infer's and the pipeline's calls do."""
import asyncio

import pytest

from lmjax import ChatTemplateConfig, GenerationConfig, TurbomindEngineConfig, pipeline

GEN = GenerationConfig(max_new_tokens=8)


@pytest.fixture(scope="module")
def engine(smollm2_pruned):
    with pipeline(smollm2_pruned, backend_config=TurbomindEngineConfig(session_len=256,
                                                                       cache_max_entry_count=64)) as p:
        yield p._async()


def _reply(engine, session_id, template) -> tuple[str, str]:
    async def run():
        outs = [o async for o in engine.generate("Hi", session_id, GEN, chat_template_config=template,
                                                 stream_response=False)]
        return outs[-1].response, outs[-1].finish_reason
    return asyncio.run(run())


def test_generate_applies_the_calls_template_stop_words(engine):
    template = ChatTemplateConfig(user="<|im_start|>user\n", eoh="<|im_end|>\n", assistant="<|im_start|>assistant\n",
                                  eoa="<|im_end|>", separator="\n")
    free, _ = _reply(engine, 1, template)
    word = free.split()[1]  # a word the reply says after its first one
    template.stop_words = [word]
    cut, reason = _reply(engine, 2, template)
    assert reason == "stop" and word not in cut and free.startswith(cut)
    assert engine.batch_infer("Hi", GEN, chat_template_config=template).text == cut
