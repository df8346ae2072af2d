"""Tool-call parser fixes found by probing: a hermes call whose argument string holds "</tool_call>" is still
one call (the JSON is decoded, not cut at the first closing tag), and the llama3 parser takes a JSON reply
as a call only with "parameters" / "arguments" (a JSON answer such as {"name": "Alice", "age": 30} is
content, as in vLLM)."""
import json

from lmjax.serve.tool_parsers import get_tool_parser
from lmjax.serve.tool_stream import ToolStream


def test_hermes_argument_holding_the_closing_tag():
    text = 'Sure.\n<tool_call>{"name": "write", "arguments": {"s": "x </tool_call> y"}}</tool_call>\n' \
           '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    content, calls = get_tool_parser("hermes").parse(text)
    assert content == "Sure." and [c.name for c in calls] == ["write", "g"]
    assert json.loads(calls[0].arguments) == {"s": "x </tool_call> y"}
    stream = ToolStream(get_tool_parser("hermes"))
    sent = "".join(stream.feed(c) for c in text)
    rest, streamed = stream.finish()
    assert sent + rest == "Sure." and [c.arguments for c in streamed] == [c.arguments for c in calls]


def test_hermes_still_parses_unterminated_and_rejects_junk():
    parser = get_tool_parser("hermes")
    assert parser.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}')[1][0].arguments == '{"a": 1}'
    bad = '<tool_call>{"name": "f", "arguments": {}}} oops</tool_call>'
    assert parser.parse(bad) == (bad, [])


def test_llama3_json_answer_with_a_name_is_content():
    parser = get_tool_parser("llama3")
    answer = '{"name": "Alice", "age": 30}'
    assert parser.parse(answer) == (answer, [])
    (call,) = parser.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}')[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert [c.name for c in parser.parse('<|python_tag|>{"name": "f", "arguments": {}}; '
                                         '{"name": "g", "parameters": {}}')[1]] == ["f", "g"]


def test_vllm_grammar_and_structural_tag_fields_become_guides():
    """guided_grammar / structural_tag (a 400 naming them until lmjax had grammars) reach the engine as guides."""
    from lmjax.serve.protocol import ChatCompletionRequest, CompletionRequest

    tag = {"type": "structural_tag", "triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}]}
    assert CompletionRequest(model="m", prompt="x", guided_grammar='root ::= "a"').sampling_params(
    ).guided_decoding.grammar == 'root ::= "a"'
    assert json.loads(CompletionRequest(model="m", prompt="x", structural_tag=json.dumps(tag)).sampling_params(
    ).guided_decoding.structural_tag) == tag
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], response_format=tag)
    assert json.loads(chat.sampling_params().guided_decoding.structural_tag) == tag