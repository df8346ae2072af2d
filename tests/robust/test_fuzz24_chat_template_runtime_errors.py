"""A chat template that fails with anything but a jinja2.TemplateError escapes as that exception.

render_chat (lmjax/loader/tokenizer.py:132) turns only jinja2.TemplateError into the ValueError "the chat template
could not render these messages: ...". A template's own arithmetic or the sandbox's limits raise other
exceptions: `{{ 1/0 }}` ZeroDivisionError, `range(10**9)` the sandbox's OverflowError ("Range too big"). The
server's api_errors maps only ValueError / TypeError / RuntimeError, so a per-request `chat_template` (vLLM's
field, which lmjax takes) answers a bare text/plain "Internal Server Error" 500 on /v1/chat/completions,
/tokenize and chat-form /v1/embeddings, and LLM.chat raises ZeroDivisionError / OverflowError naming nothing.
Expected: the ValueError (400 OpenAI body) that a raise_exception() in the same template already gets.

A template can also amplify a tiny request without limit: `{{ 'x' * 100000000 }}` renders 100 MB that the
tokenizer then turns into several GB (under a 12 GB cap the in-process server aborted in
tokenizers' NormalizedString::from: "memory allocation of 536870912 bytes failed"). Expected: the rendered
prompt refused (its length far past what session_len can hold) before it is tokenized."""
import os
import subprocess
import sys
import textwrap

import pytest

from tiny_server_fixtures import http, served, tiny  # noqa: F401 (pytest fixtures)


USER = [{"role": "user", "content": "t5 t6"}]
FAILING = ["{{ 1/0 }}", "{% for i in range(10**9) %}x{% endfor %}"]


@pytest.mark.parametrize("template", FAILING)
@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 2}),
    ("/tokenize", {"messages": USER}),
    ("/v1/embeddings", {"model": "tiny", "messages": USER}),
])
def test_a_failing_request_template_is_a_400_body(http, route, body, template):
    got = http.post(route, json={**body, "chat_template": template})
    assert got.status_code == 400, f"{got.status_code} {got.headers.get('content-type')}: {got.text[:200]}"
    assert "chat template" in got.json()["error"]["message"], got.text
    ok = http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 9], "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


@pytest.mark.parametrize("template", FAILING)
def test_llm_chat_names_a_failing_template(tiny, template):
    from lmjax import LLM, SamplingParams

    llm = LLM(tiny, max_model_len=128, block_size=16)
    with pytest.raises(ValueError, match="chat template"):
        llm.chat(USER, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=template)


CHILD = textwrap.dedent("""
    import os, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    from lmjax.api.batch import encode_chat
    from lmjax.config import ChatTemplateConfig
    from lmjax.loader.tokenizer import load_tokenizer
    try:
        encode_chat(load_tokenizer(sys.argv[1]), [{"role": "user", "content": "t5"}], ChatTemplateConfig(),
                    chat_template="{{ 'x' * 100000000 }}", add_generation_prompt=True)
        print("RESULT rendered")
    except ValueError as e:
        print("RESULT ValueError", str(e)[:200])
""")


def test_a_template_cannot_amplify_a_request_into_gigabytes(tiny):
    """The server's chat_prompt path (encode_chat), in a child capped at 4 GiB of address space."""
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, tiny], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
    except subprocess.TimeoutExpired:
        pytest.fail("rendering and tokenizing a 100M-character template output ran past 60 s")
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines and lines[0].startswith("RESULT ValueError"), \
        f"rc={done.returncode} {lines} {done.stderr.strip().splitlines()[:1]}"
