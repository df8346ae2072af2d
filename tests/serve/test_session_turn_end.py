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


def _relabelled(tmp_path_factory, eos_ids: list[int]):
    """An AsyncEngine over pruned SmolLM2 whose tokenizer's eos_token is <|endoftext|> and config's EOS ids
    `eos_ids`; yields it."""
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
    cfg["eos_token_id"] = eos_ids
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    e = AsyncEngine(path, backend_config=TurbomindEngineConfig(session_len=512, dtype="float32",
                                                                cache_max_entry_count=16))
    yield e
    e.close()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    yield from _relabelled(tmp_path_factory, [0, 2])


@pytest.fixture(scope="module")
def base_engine(tmp_path_factory):
    """As a base model: <|im_end|> (2) is no EOS id, only the chat's end of turn."""
    yield from _relabelled(tmp_path_factory, [0])


def test_second_turn_does_not_repeat_the_end_of_turn_token(engine):
    end_of_turn = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert engine.tokenizer.eos_token == "<|endoftext|>" and end_of_turn in engine.engine.eos_token_ids
    ends_now = SamplingParams(max_tokens=4, temperature=0, logit_bias={end_of_turn: 100})  # reply = <|im_end|>

    async def main():
        outs = [o async for o in engine.generate("Hi", 1, ends_now, sequence_end=False)]
        assert outs[-1].finish_reason == "stop" and outs[-1].stop_token_id == end_of_turn
        text, ids = engine.encode("And now?", sequence_start=False, session_id=1)
        await engine.end_session(1)
        return text, ids
    text, ids = asyncio.run(main())
    assert not text.startswith("<|im_end|>"), f"the next turn repeats the end-of-turn marker: {text!r}"


@pytest.mark.parametrize("how", ["stop_token_ids", "template stop word"])
def test_a_reply_ended_by_a_special_stop_token_is_not_followed_by_it_again(base_engine, how):
    """Probe 24: a turn that ended on a stop id that is no EOS (stop_token_ids, or LMDeploy's template stop word
    <|im_end|>, a special token and so a stop id) was taken for one cut short: the next turn began with a
    second <|im_end|>. The session's ids now equal transformers' render of the whole conversation."""
    from lmjax.config import ChatTemplateConfig

    engine, tok = base_engine, base_engine.tokenizer
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn not in engine.engine.eos_token_ids
    ends_now = SamplingParams(max_tokens=4, temperature=0, logit_bias={end_of_turn: 100},
                              stop_token_ids=[end_of_turn] if how == "stop_token_ids" else [])
    kept = engine.chat_template
    if how != "stop_token_ids":
        engine.chat_template = ChatTemplateConfig(stop_words=["<|im_end|>"])

    async def main():
        outs = [o async for o in engine.generate("Hi", 2, ends_now, sequence_end=False)]
        text, ids = engine.encode("And now?", sequence_start=False, session_id=2)
        history = list(engine.engine.sessions[2].token_ids)
        await engine.end_session(2)
        return outs[-1], history + ids
    try:
        last, session_ids = asyncio.run(main())
    finally:
        engine.chat_template = kept
    assert last.stop_token_id == end_of_turn and last.finish_reason == "stop"  # (LMDeploy: not in token_ids)
    want = tok.apply_chat_template([{"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": tok.decode(last.token_ids)},
                                    {"role": "user", "content": "And now?"}], tokenize=False, add_generation_prompt=True)
    assert tok.decode(session_ids) == want
