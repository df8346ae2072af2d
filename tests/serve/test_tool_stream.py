"""Tool calls stream as the model writes them (OpenAI's and vLLM's streaming: a call's index, id, type and
name once its name is complete, then pieces of its arguments), adding up to the finished reply's calls;
JSON that only looks like a call (llama3) or arguments written as a string go out when the reply is done."""
import json

import pytest

from lmjax.serve.json_scan import scan_object
from lmjax.serve.tool_parsers import ForcedToolParser, get_tool_parser
from lmjax.serve.tool_stream import ToolStream

HERMES_TWO = ('I will call it.\n<tool_call>\n{"name": "f", "arguments": {"x": 1, "s": "a}b\\"c"}}\n</tool_call>\n'
              '<tool_call>{"arguments": {"y": [1, 2]}, "name": "g"}</tool_call>')


def _stream(parser, text: str, piece: int = 3):
    """Feed `text` a few characters at a time: (content, [tool_call deltas per piece], calls)."""
    stream, content, pieces = ToolStream(parser), "", []
    for i in range(0, len(text), piece):
        content += stream.feed(text[i:i + piece])
        pieces.append(stream.take_call_deltas())
    rest, calls = stream.finish()
    pieces.append(stream.final_call_deltas(calls) if calls else stream.take_call_deltas())
    return content + rest, pieces, calls


def _accumulated(pieces) -> dict:
    """What an OpenAI client makes of the deltas: index -> (id, name, arguments)."""
    calls = {}
    for delta in (d for p in pieces for d in p):
        call = calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
        call["id"] = delta.get("id", call["id"])
        call["name"] = delta.get("function", {}).get("name", call["name"])
        call["arguments"] += delta.get("function", {}).get("arguments", "")
    return calls


@pytest.mark.parametrize("name, text, calls", [
    ("hermes", HERMES_TWO, [("f", {"x": 1, "s": 'a}b"c'}), ("g", {"y": [1, 2]})]),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
     [("f", {"a": 1}), ("g", {})]),
    ("internlm", 'Ok <|action_start|><|plugin|>\n{"name": "f", "parameters": {"q": "a"}}<|action_end|>',
     [("f", {"q": "a"})]),
])
def test_calls_stream_as_written_and_add_up_to_the_reply(name, text, calls):
    parser = get_tool_parser(name)
    content, pieces, final = _stream(parser, text)
    got = _accumulated(pieces)
    assert [(got[j]["name"], json.loads(got[j]["arguments"])) for j in sorted(got)] == calls
    assert [got[j]["arguments"] for j in sorted(got)] == [c.arguments for c in final]  # the text the model wrote
    assert content == (parser.parse(text)[0] or "") and all(got[j]["id"].startswith("call_") for j in got)
    first_named = next(i for i, p in enumerate(pieces) if p)
    assert first_named < len(pieces) - 1  # the first call began before the reply was complete
    assert sum(1 for p in pieces[:-1] for d in p if "arguments" in d.get("function", {})) > 2  # in pieces


def test_json_answers_and_string_arguments_wait_for_the_end():
    _, pieces, calls = _stream(get_tool_parser("llama3"), '{"name": "Alice", "age": 30}')
    assert not any(pieces) and not calls  # an answer that has a "name": content, never a call
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    _, pieces, calls = _stream(get_tool_parser("hermes"), text)
    got = _accumulated(pieces)
    assert got[0]["name"] == "f" and got[0]["arguments"] == calls[0].arguments == '{"x": 1}'
    assert all("arguments" not in d["function"] or not d["function"]["arguments"] for d in pieces[0] + pieces[-2])


def test_a_forced_function_streams_its_reply_as_the_arguments():
    reply = '{"city": "Paris", "days": [1, 2]}'
    _, pieces, calls = _stream(ForcedToolParser("get_weather"), reply, piece=4)
    got = _accumulated(pieces)
    assert got[0]["name"] == "get_weather" and got[0]["arguments"] == reply == calls[0].arguments
    assert len([p for p in pieces if p]) > 3
    _, pieces, calls = _stream(ForcedToolParser(None), '[{"name": "f", "parameters": {}}]')
    assert not any(pieces[:-1]) and _accumulated(pieces)[0]["name"] == "f"  # "required": whole at the end


def test_the_scan_reads_prefixes_and_marks_what_is_complete():
    text = '{"name": "f", "arguments": {"s": "}{", "n": [1, {"a": 2}]}, "z": 1}'
    whole = scan_object(text, 0)
    assert whole.name == "f" and whole.end == len(text) and text[whole.args[0]:whole.args[1]] == \
        '{"s": "}{", "n": [1, {"a": 2}]}'
    for cut in range(1, len(text)):
        part = scan_object(text[:cut], 0)
        assert part.end is None and (part.name is None or part.name == "f")
        assert part.args is None or part.args[1] is None or part.args[1] == whole.args[1]
    with pytest.raises(ValueError):
        scan_object('{"name" "f"}', 0)


def test_parallel_tool_calls_false_keeps_the_first_call():
    """OpenAI's parallel_tool_calls=false: one call at most (vLLM keeps the first), streamed or not (review 32)."""
    from lmjax.serve.protocol import ChatCompletionRequest
    from lmjax.serve.tool_parsers import forced_tool_schema

    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in "fg"]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    one = ChatCompletionRequest(**body, parallel_tool_calls=False).tool_call_parser(get_tool_parser("hermes"))
    content, calls = one.parse(HERMES_TWO)
    assert [c.name for c in calls] == ["f"] and content == "I will call it."
    _, pieces, streamed = _stream(one, HERMES_TWO)
    assert list(_accumulated(pieces)) == [0] and _accumulated(pieces)[0]["name"] == "f"
    both = ChatCompletionRequest(**body).tool_call_parser(get_tool_parser("hermes"))
    assert [c.name for c in both.parse(HERMES_TWO)[1]] == ["f", "g"]
    assert forced_tool_schema(tools, None, single=True)["maxItems"] == 1 and "maxItems" not in forced_tool_schema(tools, None)


@pytest.mark.parametrize("finish, want", [("stop", "tool_calls"), ("length", "length")])
def test_a_reply_with_calls_cut_by_max_tokens_finishes_length(finish, want):
    """vLLM: "tool_calls" only when the model ended the reply itself; cut short, a call may be missing."""
    from lmjax.api.engine_thread import GenOut
    from lmjax.serve.responses import chat_message, tool_delta

    parser = get_tool_parser("hermes")
    assert chat_message(HERMES_TWO, finish, parser)[1] == want
    stream = ToolStream(parser)
    out = GenOut(HERMES_TWO, 0, 5, 20, finish, [], None, 0)
    assert tool_delta(stream, out)[1] == want
