"""Warm-up lowers its programs on the engine's thread and compiles them on a pool (lmjax.engine.parallel_compile);
the runs that follow find them compiled: each whole-model program is compiled once, on the pool."""
import logging

import jax
import pytest

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams
from lmjax.engine.parallel_compile import Precompiler


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


class _Compiles(logging.Handler):
    """jax's "Finished XLA compilation of jit(name)" records (jax_log_compiles), with their thread."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Finished XLA compilation of jit("):
            self.seen.append((message.split("jit(")[1].split(")")[0], record.threadName))


@pytest.fixture
def compiles(monkeypatch):
    handler = _Compiles()
    logging.getLogger("jax").addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    yield handler
    jax.config.update("jax_log_compiles", False)
    logging.getLogger("jax").removeHandler(handler)


@pytest.mark.parametrize("threads", ["3", "1"])
def test_warmup_compiles_each_program_once(tiny, compiles, monkeypatch, threads):
    monkeypatch.setenv("LMJAX_COMPILE_THREADS", threads)
    monkeypatch.setenv("LMJAX_BACKGROUND_COMPILE", "1")
    monkeypatch.setenv("LMJAX_PAD_TO_COMPILED", "1")  # the large one-step shapes too
    llm = LLM(tiny, max_model_len=128, block_size=8, enforce_eager=False, max_num_seqs=8, num_scheduler_steps=4,
              max_num_batched_tokens=256)
    runner = llm.llm_engine.runner
    warm = [(name, thread) for name, thread in compiles.seen if not thread.startswith("lmjax-compile")]
    decode = [thread for name, thread in warm if name == "_decode_fn"]
    steps = [thread for name, thread in warm if name == "_step_fn"]
    # batch buckets 4 and 8 (and 1, 2 on a GPU) x the block-table widths (one on the CPU): each compiled once
    assert len(decode) == runner._decode.jitted._cache_size() >= 2
    assert len(steps) == runner._step._cache_size() == 4  # 2 large shapes x (fused, sampled apart)
    pooled = {thread.startswith("lmjax-precompile") for thread in decode + steps}
    assert pooled == ({True} if threads != "1" else {False})
    before = len(compiles.seen)
    out = llm.generate([[5, 9, 12, 30, 41]] * 3, SamplingParams(max_tokens=9, ignore_eos=True, temperature=0),
                       use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [9] * 3
    assert [(name, thread) for name, thread in compiles.seen[before:] if name == "_decode_fn"] == []
    runner.wait_for_compiles()  # (new step shapes compile on the background worker: not into the next test)


def test_precompiler_logs_a_failed_lowering_and_goes_on(caplog):
    def bad():
        raise ValueError("no such shape 7")

    good = jax.jit(lambda x: x + 1)
    precompiler = Precompiler(threads=2)
    with caplog.at_level("WARNING", logger="lmjax.engine"):
        precompiler.add(bad)
        precompiler.add(lambda: good.lower(jax.ShapeDtypeStruct((3,), "float32")))
        stats = precompiler.wait()
    assert stats["programs"] == 1 and stats["failed"] == 0
    assert "no such shape 7" in caplog.text
    assert Precompiler(threads=1).wait()["programs"] == 0  # one thread: the calls compile as they are made


def test_paused_gc_restores_what_was():
    import gc

    from lmjax.engine.parallel_compile import paused_gc

    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # a caller's own pause is left alone
    finally:
        gc.enable()


def test_paused_gc_from_two_threads_leaves_gc_enabled():
    """Two engines' threads may pause at once: the one that read `disabled` inside the other's pause must not
    leave GC off for good (review 30)."""
    import gc
    import sys
    import threading

    from lmjax.engine.parallel_compile import paused_gc

    assert gc.isenabled()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def work():
            for _ in range(50000):
                with paused_gc():
                    pass

        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stuck = not gc.isenabled()
    finally:
        sys.setswitchinterval(old)
        gc.enable()
    assert not stuck, "cyclic GC left disabled after every paused_gc() exited"
