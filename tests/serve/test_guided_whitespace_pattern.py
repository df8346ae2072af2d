"""The server's guided_whitespace_pattern applies to a guide from response_format (json_object, json_schema)
and to a forced tool_choice too, as vLLM applies it (probe 24: it was dropped there)."""
from lmjax.serve.protocol import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def test_response_format_json_object_keeps_the_whitespace_pattern():
    req = ChatCompletionRequest(model="m", messages=MESSAGES, response_format={"type": "json_object"},
                                guided_whitespace_pattern="[ ]?")
    guide = req.sampling_params().guided_decoding
    assert guide.json_object and guide.whitespace_pattern == "[ ]?", guide


def test_response_format_json_schema_keeps_the_whitespace_pattern():
    req = CompletionRequest(model="m", prompt="hi", guided_whitespace_pattern="",
                            response_format={"type": "json_schema",
                                             "json_schema": {"name": "x", "schema": {"type": "object"}}})
    guide = req.sampling_params().guided_decoding
    assert guide.json is not None and guide.whitespace_pattern == "", guide
