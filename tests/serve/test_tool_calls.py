"""Tool calling: the parsers of lmjax.serve.tool_parsers on hand-written replies, the request checks, and one
`lmjax serve api_server --tool-call-parser hermes` process driven by the official openai client.

The served model is a successor table written here: a one-layer Llama whose attention and MLP write nothing
(o_proj and down_proj are zero), so the next token depends on the current token alone; orthonormal
embeddings and one lm_head row per successor make it follow the chains in CHAINS whatever the sampling. Its
hermes-style chat template ends the generation prompt on "assistant", which starts a reply with a tool call;
a conversation continued (`continue_final_message`) from "plain" or "broken" gets plain text or a malformed
call."""
import json
import os

import numpy as np
import pytest

import openai
from lmjax.serve.tool_parsers import PARSERS, get_tool_parser
from lmjax.serve.tool_stream import ToolStream
from server_process import api_server

CHAINS = [
    ["assistant", "Let", "me", "check.", "<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":',
     '"Paris"}}', "</tool_call>", "<eos>"],
    ["plain", "Hello", "there!", "<eos>"],
    ["broken", "Sure,", "<tool_call>{oops", "</tool_call>"],  # then <eos>, as above
]
WORDS = ["<eos>", "<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "Tools:", "get_weather", "<tool_response>",
         "</tool_response>", "22", "degrees",
         # the only spellings of a forced call to get_time (guided decoding: one allowed token a step)
         '[{"name":', '"get_time",', '"parameters":', "{}}]", "{}", "get_time"]
TEMPLATE = (
    "{% if tools %}<|im_start|> system Tools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|> "
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|> user <tool_response> {{ m.content }} </tool_response> <|im_end|> "
    "{% elif m.tool_calls %}<|im_start|> assistant {% for c in m.tool_calls %}<tool_call> "
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }} </tool_call> {% endfor %}<|im_end|> "
    "{% else %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant{% endif %}")
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": CITY}}]
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>'


# --- the parsers ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "Let me look.",
     [("f", {"x": 1})]),
    ("qwen", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": '
             '{"y": "é"}}</tool_call>', None, [("f", {}), ("g", {"y": "é"})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}}', None, [("f", {"x": 1})]),  # ended at EOS
    ("hermes", "no call here", "no call here", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": </tool_call>', None, []),  # bad JSON: content
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', None, []),  # no name: content
    ("llama3", '{"name": "f", "parameters": {"x": 1}}', None, [("f", {"x": 1})]),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"z": [1]}}', None,
     [("f", {}), ("g", {"z": [1]})]),
    ("llama3_json", 'Sure. <|python_tag|>{"name": "f", "arguments": {}}', "Sure.", [("f", {})]),
    ("llama3", 'The answer is {"name": "f"}', None, []),  # JSON inside prose is not a call
    ("llama3", '{"name": "f", "parameters": {}} and more', None, []),
    ("internlm", 'Checking.<|action_start|><|plugin|>\n{"name": "f", "parameters": {"q": "a"}}<|action_end|>\n',
     "Checking.", [("f", {"q": "a"})]),
    ("internlm", "<|action_start|><|interpreter|>print(1)<|action_end|>", None, []),  # code, not a plugin call
])
def test_parsers(name, text, content, calls):
    got_content, got = get_tool_parser(name).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_content == (content if calls else text)
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


def test_unknown_parser_is_named_and_the_cli_offers_every_parser():
    from lmjax.cli import TOOL_CALL_PARSERS

    with pytest.raises(ValueError, match="'mistral'.*hermes"):
        get_tool_parser("mistral")
    assert TOOL_CALL_PARSERS == tuple(sorted(PARSERS))


@pytest.mark.parametrize("name, text", [
    ("hermes", 'I will call it.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'),
    ("hermes", "plain text < with a less-than and <tool_ca but no call"),
    ("hermes", '<tool_call>{"name": broken}</tool_call>'),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {}}'),
    ("llama3", "<|python is not the tag"),
    ("internlm", 'Ok <|action_start|><|plugin|>{"name": "f", "parameters": {}}<|action_end|>'),
])
def test_stream_sends_the_content_and_holds_back_the_calls(name, text):
    parser = get_tool_parser(name)
    stream, sent = ToolStream(parser), []
    for i in range(0, len(text), 3):  # three characters a piece: markers arrive split
        sent.append(stream.feed(text[i:i + 3]))
    rest, calls = stream.finish()
    content, want = parser.parse(text)
    assert "".join(sent) + rest == (content or "") and [c.name for c in calls] == [c.name for c in want]
    assert not any(m in "".join(sent) for m in ("<tool_call>", "<|python_tag|>", "<|action_start|>")) or not want


# --- the request and the prompt (no model) -------------------------------------------------------------------

def test_tool_choice_and_parser_rules():
    from lmjax.serve.protocol import ChatCompletionRequest

    from lmjax.serve.tool_parsers import ForcedToolParser

    def req(**kw):
        return ChatCompletionRequest(model="m", messages=ASK, tools=TOOLS + [TIME], **kw)
    hermes = get_tool_parser("hermes")
    assert req().tool_call_parser(hermes) is hermes and req(tool_choice="auto").tool_call_parser(hermes) is hermes
    assert req(tool_choice="none").tool_call_parser(None) is None  # rendered, not parsed: no parser needed
    assert req().sampling_params().guided_decoding is None
    with pytest.raises(ValueError, match="--tool-call-parser"):
        req().tool_call_parser(None)
    # forced: guided to the call's JSON, parsed by its own parser, no server parser needed (as vLLM)
    named = req(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert isinstance(named.tool_call_parser(None), ForcedToolParser)
    assert json.loads(named.sampling_params().guided_decoding.json) == CITY
    schema = json.loads(req(tool_choice="required").sampling_params().guided_decoding.json)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    for choice, message in ((("any", "tool_choice must be")), ({"type": "function", "function": {"name": "nope"}},
                                                                "'nope', which is not among the tools")):
        with pytest.raises(ValueError, match=message):
            req(tool_choice=choice).sampling_params()
    with pytest.raises(ValueError, match="cannot be combined with response_format"):
        req(tool_choice="required", response_format={"type": "json_object"}).sampling_params()
    with pytest.raises(ValueError, match="needs tools"):
        ChatCompletionRequest(model="m", messages=ASK, tool_choice="required").sampling_params()


@pytest.mark.parametrize("function, text, calls", [
    ("get_time", "{}", [("get_time", {})]),
    (None, '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]', [("f", {"x": 1}), ("g", {})]),
    (None, '[{"name": "f", "parameters": {"x"', []),  # cut short by max_tokens: plain content
])
def test_forced_tool_parser(function, text, calls):
    from lmjax.serve.tool_parsers import ForcedToolParser

    parser = ForcedToolParser(function)
    content, got = parser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls and content == (None if calls else text)
    assert parser.content_end(text) == 0
    assert parser.calls_finish_reason == ("tool_calls" if function is None else "stop")  # OpenAI's (review 32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return write_successor_model(str(tmp_path_factory.mktemp("tool-model")))


def _no_markers():
    from lmjax.config import ChatTemplateConfig

    return ChatTemplateConfig()


def test_tools_and_tool_messages_reach_the_template(model_dir):
    from lmjax.loader.tokenizer import load_tokenizer
    from lmjax.serve.openai_server import chat_prompt
    from lmjax.serve.protocol import ChatCompletionRequest

    engine = type("E", (), {"tokenizer": load_tokenizer(model_dir), "chat_template": _no_markers()})()
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"}]
    text, ids = chat_prompt(engine, ChatCompletionRequest(model="m", messages=history, tools=TOOLS))
    assert text.startswith("<|im_start|> system Tools: get_weather <|im_end|>")
    assert CALL in text  # the arguments rendered as a mapping, not as a quoted string
    assert "<tool_response> 22 degrees </tool_response>" in text and text.endswith("<|im_start|> assistant")
    assert len(ids) == len(text.split())
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        bad = [dict(history[1], tool_calls=[{"function": {"name": "f", "arguments": "{not json"}}])]
        chat_prompt(engine, ChatCompletionRequest(model="m", messages=ASK + bad))


def test_llm_chat_renders_tools(model_dir, monkeypatch):
    from lmjax.api.llm import LLM
    from lmjax.loader.tokenizer import load_tokenizer

    llm, seen = object.__new__(LLM), []  # no engine: only the rendering is under test
    llm.llm_engine = type("E", (), {"tokenizer": load_tokenizer(model_dir)})()
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, *args, **kwargs: seen.extend(prompts) or [])
    llm.chat(ASK, tools=TOOLS)
    llm.chat(ASK)
    assert [p["prompt"].startswith("<|im_start|> system Tools: get_weather") for p in seen] == [True, False]


def test_tools_without_a_parser_are_an_openai_400(model_dir):
    from fastapi.testclient import TestClient

    from lmjax.serve.openai_server import create_app

    engine = type("E", (), {"model_name": "m", "tokenizer": None})()  # refused before the engine is asked
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=TestClient(create_app(engine)),
                           max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser") as e:
        client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    assert e.value.body["type"] == "invalid_request_error" and e.value.status_code == 400


def test_enable_auto_tool_choice_needs_a_parser(capsys):
    from lmjax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "api_server", "no-such-model", "--enable-auto-tool-choice"])
    assert e.value.code == 2 and "--tool-call-parser" in capsys.readouterr().err


# --- one real server ---------------------------------------------------------------------------------------------

def write_successor_model(path: str) -> str:
    """config.json, safetensors and a word-level tokenizer (with TEMPLATE) of the successor-table model."""
    import transformers
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # printable ASCII last: guided decoding needs a vocabulary that can spell any JSON (outlines refuses one
    # that cannot), and a masked argmax over equal logits takes the lowest id, so WORDS' spellings win
    words = list(dict.fromkeys(WORDS + [w for chain in CHAINS for w in chain] + [chr(c) for c in range(32, 127)]))
    vocab, hidden = {w: i for i, w in enumerate(words)}, 64 * -(-len(words) // 64)  # orthonormal rows need V <= D
    cfg = transformers.LlamaConfig(vocab_size=len(words), hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                                   tie_word_embeddings=False, bos_token_id=None, eos_token_id=vocab["<eos>"],
                                   architectures=["LlamaForCausalLM"])
    rng = np.random.default_rng(0)
    embed = np.linalg.qr(rng.standard_normal((hidden, hidden)))[0][:len(words)].astype(np.float32)  # orthonormal
    head = np.zeros_like(embed)
    for chain in CHAINS:
        for cur, nxt in zip(chain, chain[1:]):
            head[vocab[nxt]] += 10 * embed[vocab[cur]]  # logit 10 sqrt(D) for the successor (RMSNorm), 0 else
    head[vocab["<eos>"]] += 10 * embed[vocab["</tool_call>"]]
    small = lambda *shape: (0.02 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    layer = "model.layers.0."
    ones = np.ones(hidden, np.float32)
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": ones,
               layer + "input_layernorm.weight": ones, layer + "post_attention_layernorm.weight": ones,
               layer + "self_attn.o_proj.weight": np.zeros((hidden, hidden), np.float32),
               layer + "mlp.down_proj.weight": np.zeros((hidden, 64), np.float32),
               layer + "mlp.gate_proj.weight": small(64, hidden), layer + "mlp.up_proj.weight": small(64, hidden)}
    weights.update({f"{layer}self_attn.{p}_proj.weight": small(hidden, hidden) for p in "qkv"})
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "model.safetensors"))
    cfg.to_json_file(os.path.join(path, "config.json"))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def client(model_dir):
    with api_server(model_dir, "--session-len", "256", "--dtype", "float32", "--max-batch-size", "4",
                    "--log-level", "WARNING", "--model-name", "m", "--tool-call-parser", "hermes",
                    "--enable-auto-tool-choice") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)


def _continued(word: str) -> dict:
    """A conversation the model goes on with from `word` (the first word of one of CHAINS)."""
    return dict(messages=ASK + [{"role": "assistant", "content": word}],
                extra_body={"add_generation_prompt": False, "continue_final_message": True})


def test_server_returns_tool_calls(client):
    got = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=20)
    choice = got.choices[0]
    # the reply continues the prompt "... assistant": the word-level decoder's space leads (vLLM's text too)
    assert choice.finish_reason == "tool_calls" and choice.message.content == " Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # tool_choice "none": the tools are in the prompt, the same reply is text; without tools it is not parsed
    prompt_tokens = []
    for kw in (dict(tools=TOOLS, tool_choice="none"), {}):
        got = client.chat.completions.create(model="m", messages=ASK, max_tokens=20, **kw)
        assert got.choices[0].message.content.strip() == f"Let me check. {CALL}"
        assert not got.choices[0].message.tool_calls and got.choices[0].finish_reason == "stop"
        prompt_tokens.append(got.usage.prompt_tokens)
    assert prompt_tokens[0] - prompt_tokens[1] == len("<|im_start|> system Tools: get_weather <|im_end|>".split())


def test_server_streams_tool_calls(client):
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state, pieces = ChatCompletionStreamState(), []
    for chunk in client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=20, stream=True):
        state.handle_chunk(chunk)
        pieces += [c.delta.content for c in chunk.choices if c.delta.content]
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and "".join(pieces) == final.message.content == " Let me check."
    (call,) = final.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    stream = client.chat.completions.create(model="m", tools=TOOLS, max_tokens=20, stream=True, **_continued("plain"))
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " Hello there!"
    assert chunks[-1].choices[0].finish_reason == "stop" and not any(c.choices[0].delta.tool_calls for c in chunks)


def test_server_malformed_call_is_content_and_bad_choices_are_400(client):
    for stream in (False, True):
        got = client.chat.completions.create(model="m", tools=TOOLS, max_tokens=20, stream=stream,
                                             **_continued("broken"))
        if stream:
            got = list(got)
            text, finish = "".join(c.choices[0].delta.content or "" for c in got), got[-1].choices[0].finish_reason
        else:
            text, finish = got.choices[0].message.content, got.choices[0].finish_reason
            assert got.choices[0].message.tool_calls is None
        assert (text, finish) == (" Sure, <tool_call>{oops </tool_call>", "stop")
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    with pytest.raises(openai.BadRequestError, match="arguments must be JSON text"):
        client.chat.completions.create(model="m", messages=ASK + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}]}], tools=TOOLS)
    # a conversation with a call and its result is served, its prompt as the template renders it
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"}]
    got = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=20)
    rendered = "<|im_start|> system Tools: get_weather <|im_end|> <|im_start|> user Weather in Paris? <|im_end|> " \
               f"<|im_start|> assistant {CALL} <|im_end|> <|im_start|> user <tool_response> 22 degrees " \
               "</tool_response> <|im_end|> <|im_start|> assistant"
    assert got.usage.prompt_tokens == len(rendered.split()) and got.choices[0].message.tool_calls


def test_server_forced_tool_choice_and_structured_outputs(client):
    """tool_choice "required" or named: the reply is guided to the call's JSON (the model would say "Let me
    check." unguided) and comes back as a call with finish_reason "tool_calls" ("required") or "stop" (named:
    OpenAI's and vLLM's); response_format and
    vLLM's guided_choice constrain plain replies. Greedy: the allowed tokens' logits tie (the lowest id, a
    WORDS spelling, wins), and sampling would spell the JSON from single characters at random."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, tools in (("required", [TIME]), (named, TOOLS + [TIME])):
        for stream in (False, True):
            got = client.chat.completions.create(model="m", messages=ASK, tools=tools, tool_choice=choice,
                                                 max_tokens=20, stream=stream, temperature=0)
            if stream:
                state = ChatCompletionStreamState()
                for chunk in got:
                    assert not any(c.delta.content for c in chunk.choices)  # no content streams: it is the call
                    state.handle_chunk(chunk)
                got = state.get_final_completion()
            choice_out = got.choices[0]
            (call,) = choice_out.message.tool_calls
            assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {}), choice
            assert choice_out.finish_reason == ("tool_calls" if choice == "required" else "stop"), choice
            assert not choice_out.message.content
    empty = {"type": "json_schema", "json_schema": {"name": "empty", "schema": {"type": "object", "properties": {}}}}
    got = client.chat.completions.create(model="m", messages=ASK, response_format=empty, max_tokens=20, temperature=0)
    assert json.loads(got.choices[0].message.content) == {} and got.choices[0].finish_reason == "stop"
    got = client.completions.create(model="m", prompt="plain", max_tokens=5, temperature=0,
                                    extra_body={"guided_choice": ["check."]})
    # the guide sees tokens ("check." is one), the text continues "plain" (vLLM's); unguided: " Hello there!"
    assert got.choices[0].text == " check." and got.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(model="m", prompt="plain", max_tokens=5, extra_body={"guided_regex": "(unclosed"})
    with pytest.raises(openai.BadRequestError, match="Rule 'clause' not found"):  # compiled at submission: a 400
        client.completions.create(model="m", prompt="plain", max_tokens=5,
                                  extra_body={"guided_grammar": 'root ::= "a" clause'})
