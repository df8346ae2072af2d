"""The persistent compilation cache: a second engine start on the same model compiles nothing.

Each start runs in its own Python process (JAX's in-memory caches would hide the disk cache otherwise),
with LMJAX_COMPILATION_CACHE_DIR pointing at a temporary directory. The signal is JAX's own
jax.monitoring events (cache lookups and hits), read through lmjax.engine.compile_cache.compile_stats().
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import write_tiny_llama

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

START = """
import json, sys, time
from lmjax import LLM, SamplingParams
from lmjax.engine import compile_cache
llm = LLM(sys.argv[1], max_model_len=128, block_size=16, max_num_seqs=4)
t0 = time.perf_counter()
out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
print(json.dumps({**compile_cache.compile_stats(), "first_generate_s": time.perf_counter() - t0,
                  "engine_cache_dir": llm.llm_engine.compilation_cache_dir,
                  "tokens": out[0].outputs[0].token_ids}))
"""

ENABLE_ONLY = """
import json
from lmjax.engine.compile_cache import enable_compilation_cache
print(json.dumps({"dir": enable_compilation_cache(), "again": enable_compilation_cache()}))
"""


def _python(code: str, env_updates: dict, *args: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.update(env_updates)
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=180, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_second_start_compiles_nothing(tiny, tmp_path):
    cache = str(tmp_path / "cache")
    first = _python(START, {"LMJAX_COMPILATION_CACHE_DIR": cache}, tiny)
    assert first["engine_cache_dir"] == cache and first["cache_dir"] == cache
    assert first["cache_misses"] > 0 and first["cache_hits"] == 0  # an empty cache: everything compiled
    entries = os.listdir(cache)
    assert len(entries) >= first["cache_misses"] - 1  # each compilation written (one may be too small to matter)

    second = _python(START, {"LMJAX_COMPILATION_CACHE_DIR": cache}, tiny)
    assert second["cache_misses"] == 0, second  # nothing compiled on the second start
    assert second["cache_hits"] == first["cache_misses"]  # every executable came from disk
    assert second["tokens"] == first["tokens"]  # and the cached executables compute the same thing
    assert sorted(os.listdir(cache)) == sorted(entries)


def test_disabled_by_env_and_user_dir_respected(tmp_path):
    off = _python(ENABLE_ONLY, {"LMJAX_COMPILATION_CACHE_DIR": "0"})
    assert off == {"dir": None, "again": None}
    mine = str(tmp_path / "users_own")
    kept = _python(ENABLE_ONLY, {"LMJAX_COMPILATION_CACHE_DIR": str(tmp_path / "lmjax"),
                                 "JAX_COMPILATION_CACHE_DIR": mine})
    assert kept == {"dir": mine, "again": mine}
    assert not os.path.exists(tmp_path / "lmjax")
