"""LLM's max_num_seqs / max_num_batched_tokens defaults follow vLLM's by device."""
import types

import jax
import pytest

from lmjax.api.llm import batch_defaults


class FakeDevice:
    def __init__(self, platform, kind, bytes_limit):
        self.platform, self.device_kind, self._limit = platform, kind, bytes_limit

    def memory_stats(self):
        return {"bytes_limit": self._limit, "bytes_in_use": 0}


GiB = 2**30


@pytest.mark.parametrize("kind, total_gib, expected", [
    ("NVIDIA H200", 141, (1024, 16384)),
    ("NVIDIA H100 80GB HBM3", 80, (1024, 16384)),
    ("NVIDIA A100-SXM4-80GB", 80, (256, 8192)),  # vLLM measured the large defaults slower on A100s
    ("NVIDIA L4", 24, (256, 8192)),
])
def test_gpu_defaults_follow_device_memory_and_kind(kind, total_gib, expected, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert batch_defaults(FakeDevice("gpu", kind, int(0.75 * total_gib * GiB))) == expected


def test_mem_fraction_is_taken_into_account(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert batch_defaults(FakeDevice("gpu", "NVIDIA H100 80GB HBM3", 40 * GiB)) == (1024, 16384)


def test_cpu_gets_the_small_defaults():
    assert batch_defaults(jax.devices("cpu")[0]) == (256, 8192)


def test_llm_takes_the_device_defaults_unless_given(monkeypatch):
    import lmjax.api.llm as llm_mod

    seen = []
    monkeypatch.setattr(llm_mod, "batch_defaults", lambda: (7, 333))
    stub = types.SimpleNamespace(model_config=types.SimpleNamespace(context_len=4096), sampling_defaults={})
    monkeypatch.setattr(llm_mod, "LLMEngine", lambda model, config, tokenizer: seen.append(config) or stub)
    llm_mod.LLM("unused")
    llm_mod.LLM("unused", max_num_seqs=5, max_num_batched_tokens=64)
    assert [(c.max_batch_size, c.max_prefill_token_num) for c in seen] == [(7, 333), (5, 64)]
