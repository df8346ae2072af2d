"""The engine loads its tokenizer on a thread while the weights load: the result is the tokenizer that
load_tokenizer gives (the `tokenizer=` path when one is given), the two loads really run at the same time,
and a tokenizer that can not load fails the engine's constructor with an error naming the path (after the
weights, never hanging, and never hiding a weights error)."""
import os
import shutil
import sys
import threading

import pytest

from lmjax.config import EngineConfig
from lmjax.engine import engine as engine_module
from lmjax.engine.engine import LLMEngine
from lmjax.loader.tokenizer import TokenizerLoadError, load_tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from random_model import write_random_checkpoint, write_tokenizer  # noqa: E402

TEXT = "t5 t77 t1000 t1023 word"
RENDEZVOUS_S = 60  # a guard against a hang when the loads do not overlap, not a timing assert


def _config() -> EngineConfig:
    return EngineConfig(dtype="float32", session_len=64, block_size=16, num_gpu_blocks=16, max_batch_size=4,
                        max_prefill_token_num=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_random_checkpoint("tiny", str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def weights_only(tiny, tmp_path) -> str:
    """The tiny checkpoint's weights and config without any tokenizer file."""
    out = tmp_path / "weights_only"
    out.mkdir()
    for name in os.listdir(tiny):
        if name.endswith(".safetensors") or name in ("config.json", "generation_config.json"):
            shutil.copy(os.path.join(tiny, name), out / name)
    return str(out)


def test_engine_tokenizer_is_the_one_load_tokenizer_gives(tiny):
    from transformers import AutoTokenizer

    engine = LLMEngine(tiny, _config())
    assert engine.tokenizer is load_tokenizer(tiny)  # load_tokenizer caches per path: the same object
    fresh = AutoTokenizer.from_pretrained(tiny)
    assert engine.tokenizer.encode(TEXT) == fresh.encode(TEXT)
    assert engine.tokenizer.decode(fresh.encode(TEXT)) == fresh.decode(fresh.encode(TEXT))
    assert 0 in engine.eos_token_ids  # the tokenizer's EOS (t0) reaches the engine


def test_tokenizer_path_given_apart_is_the_one_loaded(tiny, tmp_path):
    write_tokenizer(40, str(tmp_path))  # a different vocabulary: t40.. are unknown (t2) here
    engine = LLMEngine(tiny, _config(), tokenizer=str(tmp_path))
    assert engine.tokenizer is load_tokenizer(str(tmp_path))
    assert engine.tokenizer.encode("t5 t77") == [5, 2]


def test_tokenizer_loads_while_the_weights_load(tiny, monkeypatch):
    """Each load waits, inside itself, for the other to have started: done one after the other, the
    first would wait in vain (and record it) before the second could start."""
    tokenizer_started, weights_started = threading.Event(), threading.Event()
    seen, load_model = {}, engine_module.load_model

    def tokenizer_loader(*args, **kwargs):
        tokenizer_started.set()
        seen["weights_running_during_tokenizer"] = weights_started.wait(RENDEZVOUS_S)
        seen["tokenizer_thread"] = threading.current_thread().name
        return load_tokenizer(*args, **kwargs)

    def weights_loader(*args, **kwargs):
        weights_started.set()
        seen["tokenizer_running_during_weights"] = tokenizer_started.wait(RENDEZVOUS_S)
        seen["weights_thread"] = threading.current_thread().name
        return load_model(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_tokenizer", tokenizer_loader)
    monkeypatch.setattr(engine_module, "load_model", weights_loader)
    engine = LLMEngine(tiny, _config())
    assert seen["weights_running_during_tokenizer"] and seen["tokenizer_running_during_weights"]
    assert seen["tokenizer_thread"] != seen["weights_thread"]
    assert engine.tokenizer is load_tokenizer(tiny)


def test_missing_tokenizer_path_fails_the_constructor_naming_it(tiny, tmp_path):
    missing = str(tmp_path / "no_such_tokenizer")
    with pytest.raises(FileNotFoundError, match=missing):
        LLMEngine(tiny, _config(), tokenizer=missing)


def test_checkpoint_without_tokenizer_fails_before_the_weights_load(weights_only, monkeypatch):
    """No tokenizer file and no .gguf: the constructor fails at once naming the path, without loading
    the weights first (an 8B checkpoint takes seconds to minutes)."""
    monkeypatch.setattr(engine_module, "load_model", lambda *a, **kw: pytest.fail("weights loaded first"))
    with pytest.raises(TokenizerLoadError, match=f"could not load a tokenizer from {weights_only}: no tokenizer"):
        LLMEngine(weights_only, _config())


def test_unreadable_tokenizer_fails_the_constructor_naming_it(weights_only):
    """A tokenizer file that exists but does not parse is found by the load itself (on its thread)."""
    with open(os.path.join(weights_only, "tokenizer.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(TokenizerLoadError, match=f"could not load a tokenizer from {weights_only}"):
        LLMEngine(weights_only, _config())


def test_weights_error_is_not_hidden_by_the_tokenizer_thread(weights_only, monkeypatch):
    """Both loads fail: the constructor raises the weights' error (the tokenizer thread is waited for,
    not leaked; its error is the lesser news)."""
    def broken_weights(path, *args, **kwargs):
        raise ValueError(f"no weights in {path}")

    with open(os.path.join(weights_only, "tokenizer.json"), "w") as f:
        f.write("{not json")
    monkeypatch.setattr(engine_module, "load_model", broken_weights)
    with pytest.raises(ValueError, match=f"no weights in {weights_only}"):
        LLMEngine(weights_only, _config())
    assert not [t for t in threading.enumerate() if t.name.startswith("lmjax-tokenizer")]
