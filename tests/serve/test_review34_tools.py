"""Review 34's tool-call findings: a call's `arguments` is always JSON text, and the server takes it back
(the chat template gets the decoded value, as in vLLM); a call with duplicate argument (or name) keys
streams what the finished reply holds; streaming a long call, or many calls, costs what each piece adds
(it rescanned from the first call on every piece); LMDeploy's parser names."""
import json
import random
import sys

import pytest

from lmjax.loader.tokenizer import _with_dict_arguments
from lmjax.serve.json_scan import scan_object
from lmjax.serve.tool_parsers import (
    HermesParser,
    InternLMParser,
    SingleCall,
    get_tool_parser,
)
from lmjax.serve.tool_stream import ToolStream


def _stream(parser, text: str, sizes) -> tuple[str, list[tuple[str, str]], list]:
    """Feed `text` in pieces of the given sizes (cycled): (content, [(name, arguments)] as a client adds the
    deltas up, the finished reply's calls)."""
    stream, content, deltas, i, k = ToolStream(parser), "", [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        content += stream.feed(text[i:i + n])
        deltas += stream.take_call_deltas()
        i, k = i + n, k + 1
    rest, calls = stream.finish()
    deltas += stream.final_call_deltas(calls) if calls else stream.take_call_deltas()
    got: dict[int, list[str]] = {}
    for d in deltas:
        call = got.setdefault(d["index"], ["", ""])
        call[0] += d.get("function", {}).get("name") or ""
        call[1] += d.get("function", {}).get("arguments") or ""
    return content + rest, [tuple(got[j]) for j in sorted(got)], calls


def _hermes(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


@pytest.mark.parametrize("written, arguments", [
    ('"Paris"', '"Paris"'),  # was 'Paris': not JSON, a client's json.loads fails on it
    ("null", "null"),
    ('"[1, 2]"', '"[1, 2]"'),  # a string holding JSON that is not an object: the string, serialized
    ('"{\\"city\\": \\"Paris\\"}"', '{"city": "Paris"}'),  # arguments written as a JSON string: kept
    ("[1, 2]", "[1, 2]"),
    ("3", "3"),
])
def test_arguments_are_json_text_and_the_stream_sends_the_same(written, arguments):
    text = _hermes('{"name": "get_weather", "arguments": ' + written + "}")
    _, calls = HermesParser().parse(text)
    assert [c.arguments for c in calls] == [arguments]
    json.loads(arguments)
    for sizes in ([1], [3], [2, 5, 1]):
        assert _stream(HermesParser(), text, sizes)[1] == [("get_weather", arguments)]


@pytest.mark.parametrize("arguments, value", [
    ('"Paris"', "Paris"), ("null", None), ("[1]", [1]), ('{"a": 1}', {"a": 1}), ("", {}), (" ", {})])
def test_the_server_takes_back_the_arguments_it_returns(arguments, value):
    """The template gets what json.loads makes of them (vLLM's), not a refusal of the server's own reply."""
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}
    assert _with_dict_arguments(message, 1)["tool_calls"][0]["function"]["arguments"] == value


def test_a_reply_goes_back_whole():
    """What the parser made of a reply, as the server's message, renders back (was: 400 'JSON object')."""
    _, calls = HermesParser().parse(_hermes('{"name": "get_weather", "arguments": "Paris"}'))
    message = {"role": "assistant", "content": None, "tool_calls": [c.to_dict() for c in calls]}
    assert _with_dict_arguments(message, 1)["tool_calls"][0]["function"]["arguments"] == "Paris"


def test_arguments_that_are_not_json_are_refused_naming_them():
    message = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}
    with pytest.raises(ValueError, match=r"messages\[3\]\.tool_calls\[0\]\.function\.arguments .*'\{not json'"):
        _with_dict_arguments(message, 3)


@pytest.mark.parametrize("body, name, arguments", [
    ('{"name": "f", "arguments": {"a":1}, "parameters": {"b":2}}', "f", '{"a":1}'),  # was '{"b":2}'
    ('{"name": "f", "parameters": {"b":2}, "arguments": {"a":1}}', "f", '{"b":2}'),
    ('{"name": "f", "arguments": {"a":1}, "arguments": {"b":2}}', "f", '{"a":1}'),
    ('{"name": "f", "arguments": "x", "arguments": {"a":1}}', "f", '"x"'),
    ('{"name": "f", "name": "g", "arguments": {"a":1}}', "f", '{"a":1}'),
])
def test_duplicate_keys_the_stream_and_the_reply_take_the_first(body, name, arguments):
    """A stream sends the first it meets and cannot take it back: the finished reply takes the same."""
    text = _hermes(body)
    _, calls = HermesParser().parse(text)
    assert [(c.name, c.arguments) for c in calls] == [(name, arguments)]
    for sizes in ([1], [4], [3, 1, 7]):
        assert _stream(HermesParser(), text, sizes)[1] == [(name, arguments)]


def _random_call(rng) -> tuple[str, str]:
    """A call object with its keys in random order, argument and name keys duplicated at random."""
    values = ['{"city": "Z\\u00fcrich \\"q\\" }{"}', "{}", '[1, {"b": "]["}]', '"Paris"', "null", "1.5e3",
              '"{\\"k\\": 2}"', '{ "x" : [ ] }']
    pairs = [(f'"{k}"', rng.choice(values)) for k in rng.sample(["arguments", "parameters"], rng.randint(1, 2))]
    pairs += [('"name"', f'"{rng.choice("fgh")}"') for _ in range(rng.choice([1, 1, 2]))]
    pairs += [(pairs[0][0], rng.choice(values))] if rng.random() < 0.4 else []
    pairs += [('"extra"', rng.choice(values))] if rng.random() < 0.3 else []
    rng.shuffle(pairs)
    return "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"


def test_duplicate_keys_fuzz_stream_equals_reply():
    rng = random.Random(34)
    for _ in range(150):
        objects = [_random_call(rng) for _ in range(rng.randint(1, 3))]
        for parser, text in ((HermesParser(), "Sure." + "".join(_hermes(o) for o in objects)),
                             (get_tool_parser("llama3"), "; ".join(objects)),
                             (InternLMParser(), "".join(f"<|action_start|><|plugin|>{o}<|action_end|>"
                                                        for o in objects))):
            content, calls = parser.parse(text)
            expected = [(c.name, c.arguments) for c in calls]
            if isinstance(parser, HermesParser) or any('"arguments"' in o or '"parameters"' in o for o in objects):
                assert len(calls) == len(objects), text
            for c in calls:
                json.loads(c.arguments)
            for wrap in (lambda p: p, SingleCall):
                sizes = [rng.randint(1, 6) for _ in range(5)]
                got_content, got, _ = _stream(wrap(parser), text, sizes)
                assert got == expected[:1 if wrap is SingleCall else None], (text, sizes)
                assert got_content == (content or ""), text


def _python_lines(work) -> int:
    """Lines of lmjax.serve run by `work()`: a count of the Python work, which timing could not bound
    without flaking."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    def calls(frame, event, arg):
        return local if "lmjax/serve/" in frame.f_code.co_filename.replace("\\", "/") else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        work()
    finally:
        sys.settrace(previous)
    return count


def _feed_all(parser, text: str, piece: int = 4):
    def work():
        stream = ToolStream(parser)
        for i in range(0, len(text), piece):
            stream.feed(text[i:i + piece])
            stream.take_call_deltas()
    return work


@pytest.mark.parametrize("make", [
    lambda n: _hermes('{"name": "write", "arguments": {"code": "' + 'x = [1, {2: 3}]\\n' * n + '", "n": ['
                      + "[1, 2], " * n + "0]}}"),  # one long call: strings, escapes, nesting
    lambda n: "".join(_hermes(f'{{"name": "f", "arguments": {{"i": {i}}}}}') for i in range(n)),  # many calls
])
def test_streaming_work_grows_linearly(make):
    """Twice the text, about twice the work (a rescan from the first call on every piece: four times)."""
    small, large = (_python_lines(_feed_all(HermesParser(), make(n))) for n in (40, 80))
    assert large < 2.5 * small, (small, large)


def test_the_incremental_scan_matches_a_whole_scan():
    from lmjax.serve.json_scan import CallScanner

    text = _hermes('{"name": "f", "arguments": {"s": "a\\\\\\"}{", "n": [1, {"a": 2}]}, "z": 12}') + \
        _hermes('{"arguments": "x", "name": "g"}')
    first = HermesParser.stream_opener.search(text).end()
    scanner = CallScanner(first, HermesParser.stream_gap)
    for cut in range(first + 1, len(text) + 1):
        scans = scanner.scan(text[:cut])
        assert scans[0] == scan_object(text[:cut], first)
    assert [s.name for s in scans] == ["f", "g"] and all(s.end is not None for s in scans)


@pytest.mark.parametrize("name, cls", [("qwen2d5", HermesParser), ("qwen3", HermesParser),
                                       ("intern-s1", InternLMParser)])
def test_lmdeploy_parser_names(name, cls):
    from lmjax.cli import build_parser

    assert type(get_tool_parser(name)) is cls
    args = build_parser().parse_args(["serve", "api_server", "m", "--tool-call-parser", name])
    assert args.tool_call_parser == name
