"""The compiled-guide LRU under threads: the server and AsyncEngine compile new guides off the engine thread
while the engine thread looks guides up. Many threads compiling and reading (more specs than the LRU holds)
get each guide right, never a torn cache, and the LRU stays bounded."""
import threading

import pytest

from conftest import write_tiny_llama
from lmjax import GuidedDecodingParams
from lmjax.engine import guided
from lmjax.engine.guided import GuidedDecoding
from lmjax.loader.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def decoding(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)
    return GuidedDecoding(load_tokenizer(path), 256, [3])


def test_threads_compiling_and_reading_guides_share_one_bounded_cache(decoding, monkeypatch):
    monkeypatch.setattr(guided, "INDEX_CACHE_SIZE", 4)
    specs = [GuidedDecodingParams(regex=f"(t{4 + i % 5}){{1,{2 + i}}}t9") for i in range(8)]
    errors, seen = [], {}

    def work(offset):
        try:
            for j in range(40):
                spec = specs[(offset + j) % len(specs)]
                index = decoding.index(spec)
                seen.setdefault(spec.spec, set()).add(_first_tokens(decoding, index))
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(decoding._indexes) <= 4
    # every spec's compiled guide allows the same first tokens however often it was recompiled or shared
    assert all(len(firsts) == 1 for firsts in seen.values()) and len(seen) == len(specs)


def _first_tokens(decoding, index) -> frozenset:
    state = guided.GuideState(decoding, index, None, ignore_eos=False)
    mask = state.mask_W()
    return frozenset(i for i in range(256) if mask[i // 32] >> (i % 32) & 1)
