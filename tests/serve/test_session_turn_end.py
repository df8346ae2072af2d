"""AsyncEngine sessions: a later turn (sequence_start=False) after a reply that ended with the model's
end-of-turn token must not repeat that token. Before the fix lmjax dropped the leading end-of-turn marker of
the next turn's template text only when it was `tokenizer.eos_token` (or a role-marker template's eoa); in
Llama-3-Instruct as first released (tokenizer eos_token <|end_of_text|>, eos_token_id [<|end_of_text|>,
<|eot_id|>]) a turn ends with <|eot_id|>, an EOS id to the engine but not tokenizer.eos_token, so the next
turn began with a second one. Reproduced with the SmolLM2 checkpoint (ChatML) re-labelled the same way:
tokenizer eos_token <|endoftext|> (id 0), config eos_token_id [0, 2], the turn ending with <|im_end|> (id 2)."""
import asyncio
import json
import os
import shutil

import pytest

from conftest import write_smollm2_pruned
from lmjax.config import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from lmjax.api.async_engine import AsyncEngine
    from lmjax.lmdeploy_config import TurbomindEngineConfig

    path = str(tmp_path_factory.mktemp("eot") / "smol-eot")
    write_smollm2_pruned(path, layers=(0, 29))
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        tok = json.load(f)
    tok["eos_token"] = "<|endoftext|>"
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tok, f)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = [0, 2]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    e = AsyncEngine(path, backend_config=TurbomindEngineConfig(session_len=512, dtype="float32",
                                                                cache_max_entry_count=16))
    yield e
    e.close()
    shutil.rmtree(path, ignore_errors=True)


def test_second_turn_does_not_repeat_the_end_of_turn_token(engine):
    end_of_turn = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert engine.tokenizer.eos_token == "<|endoftext|>" and end_of_turn in engine.engine.eos_token_ids
    ends_now = SamplingParams(max_tokens=4, temperature=0, logit_bias={end_of_turn: 100})  # reply = <|im_end|>

    async def main():
        outs = [o async for o in engine.generate("Hi", 1, ends_now, sequence_end=False)]
        assert outs[-1].finish_reason == "stop" and outs[-1].token_ids[-1] == end_of_turn
        text, ids = engine.encode("And now?", sequence_start=False, session_id=1)
        await engine.end_session(1)
        return text, ids
    text, ids = asyncio.run(main())
    assert not text.startswith("<|im_end|>"), f"the next turn repeats the end-of-turn marker: {text!r}"
