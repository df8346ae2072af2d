"""(Probe 26.) vLLM exports its speculative-decoding counters on /metrics (vllm/v1/spec_decode/metrics.py:
vllm:spec_decode_num_drafts, vllm:spec_decode_num_draft_tokens, vllm:spec_decode_num_accepted_tokens, counters,
so `_total` in the exposition); dashboards read the acceptance rate from them. lmjax counts drafted and
accepted tokens (LLMEngine.stats(): num_draft_tokens, num_accepted_tokens); its /metrics
(lmjax/serve/metrics.py _METRICS / _VLLM_NAMES) exported neither."""
import pytest
from fastapi.testclient import TestClient

from tiny_llama import write_tiny_llama
from lmjax import EngineConfig
from lmjax.api.async_engine import AsyncEngine
from lmjax.serve.openai_server import create_app

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    engine = AsyncEngine(path, model_name="tiny", backend_config=EngineConfig(
        session_len=256, block_size=16, num_scheduler_steps=1, speculative_config=SPEC))
    try:
        with TestClient(create_app(engine), raise_server_exceptions=False) as client:
            yield engine, client
    finally:
        engine.close()


def test_metrics_export_the_draft_and_accepted_token_counters(served):
    engine, client = served
    r = client.post("/v1/completions", json=dict(model="tiny", prompt="t5 t9 t32 t30 t5 t9 t32 t30 t5 t9",
                                                 max_tokens=40, temperature=0, ignore_eos=True))
    assert r.status_code == 200
    stats = engine.stats()
    assert stats["num_accepted_tokens"] > 0  # speculation ran and the engine counted it
    text = client.get("/metrics").text
    values = {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line and not line.startswith("#")}
    assert values.get("vllm:spec_decode_num_draft_tokens_total") == stats["num_draft_tokens"], \
        sorted(k for k in values if k.startswith("vllm:"))
    assert values.get("vllm:spec_decode_num_accepted_tokens_total") == stats["num_accepted_tokens"]
