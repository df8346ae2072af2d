"""vLLM's cache_salt, a request field of /v1/completions and /v1/chat/completions and a prompt dict field of
LLM.generate: prompts with other salts never share prefix-cache blocks ("to prevent an attacker to guess
prompts in multi-user environments"). The server dropped the field silently (a salted request hit another
tenant's blocks and said so in cached_tokens) and LLM.generate refused it (probe 25)."""
import pytest

from app_client import app_client
from lmjax import LLM, SamplingParams
from tiny_llama import write_tiny_llama

PROMPT = list(range(10, 50))  # 40 token ids: two full 16-token blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


@pytest.fixture(scope="module")
def http(tiny):
    with app_client(tiny, 256, enable_prefix_caching=True) as (_, client):
        yield client


def _cached(http, path, **extra) -> int:
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, **extra}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": " ".join(f"t{i}" for i in PROMPT)}]})
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_another_salt_does_not_hit_another_tenants_blocks(http, path):
    _cached(http, path)
    assert _cached(http, path) > 0  # unsalted, the second request hits
    assert _cached(http, path, cache_salt=f"tenant-a-{path}") == 0
    assert _cached(http, path, cache_salt=f"tenant-a-{path}") > 0  # a salt shares its own blocks
    assert http.post(path, json={"model": "tiny", "prompt": "t5", "messages": [], "cache_salt": ""}).status_code == 400


def test_llm_generate_takes_a_prompts_cache_salt(tiny):
    llm = LLM(tiny, max_model_len=128, block_size=4, enable_prefix_caching=True, num_scheduler_steps=1)
    sp = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate({"prompt_token_ids": PROMPT}, sp, use_tqdm=False)[0]
    salted = llm.generate({"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}, sp, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}, sp, use_tqdm=False)[0]
    assert (salted.num_cached_tokens, again.num_cached_tokens > 0) == (0, True)
    assert salted.outputs[0].token_ids == first.outputs[0].token_ids == again.outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt_token_ids": PROMPT, "cache_salt": ""}, sp, use_tqdm=False)
