"""New combinations of sampling features never compile the model step again while serving: the step fuses
only basic sampling (greedy, plain temperature) and samples any other variant apart, and a multi-step decode
variant compiles on a worker thread while its batch steps one token at a time. Tokens stay those of one step at
a time (num_scheduler_steps=1)."""
import logging

import jax
import numpy as np
import pytest

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams
from lmjax.engine import background_compile

PROMPTS = [[5, 9, 12, 30, 41], [7, 8, 9, 10, 11]]
VARIANTS = [dict(temperature=0, logprobs=1), dict(temperature=0, logprobs=3), dict(temperature=0.9, top_k=5, seed=1),
            dict(temperature=0.7, top_p=0.8, seed=2), dict(temperature=0, presence_penalty=1.5),
            dict(temperature=1.0, seed=3, logit_bias={17: 3.0}), dict(temperature=0, bad_token_ids=[1, 2, 4])]


@pytest.fixture(autouse=True)
def _worker_on(monkeypatch):
    monkeypatch.setenv("LMJAX_BACKGROUND_COMPILE", "1")  # the default (tests/conftest.py turns it off)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


def _outputs(llm, variant, max_tokens=12):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **variant)
    return [(c.token_ids, [sorted((t, lp.logprob) for t, lp in e.items()) for e in c.logprobs or ()])
            for o in llm.generate(PROMPTS, params, use_tqdm=False) for c in o.outputs]


def _same(got, want):
    """Same tokens and logprob ids; logprob values equal on CPU, to float32 rounding on a GPU (a K-step
    program and a one-step one fuse and round differently there)."""
    for (g_ids, g_lps), (w_ids, w_lps) in zip(got, want, strict=True):
        assert g_ids == w_ids and [[t for t, _ in e] for e in g_lps] == [[t for t, _ in e] for e in w_lps]
        g_values, w_values = [v for e in g_lps for _, v in e], [v for e in w_lps for _, v in e]
        if jax.default_backend() == "cpu":
            assert g_values == w_values
        else:
            np.testing.assert_allclose(g_values, w_values, rtol=1e-4, atol=1e-4)


def _step_compiles(records) -> int:
    return sum("compiling step" in r.getMessage() for r in records)


def test_sampling_variants_share_one_model_step(tiny, caplog):
    """Each variant after the first compiles no model step (the prompts' and the decode steps' shapes are
    the same); before, each compiled the step at every token / batch bucket it met."""
    llm = LLM(tiny, max_model_len=128, num_scheduler_steps=1, block_size=8, enable_prefix_caching=False)
    with caplog.at_level(logging.INFO, logger="lmjax.engine"):
        _outputs(llm, VARIANTS[0])
        first = _step_compiles(caplog.records)
        for variant in VARIANTS[1:]:
            _outputs(llm, variant)
    assert first > 0 and _step_compiles(caplog.records) == first


def test_decode_variants_compile_in_the_background(tiny, caplog, monkeypatch):
    """A sampled multi-step variant is handed to the worker (no decode compilation on the engine's thread): its
    batch steps once at a time until it is ready, then decodes K steps per call; tokens as one step at a time.
    (The tiled attention: one block-table width, so one variant per feature set.)"""
    monkeypatch.setenv("LMJAX_ATTENTION_IMPL", "tiled")
    want = [_outputs(LLM(tiny, max_model_len=128, num_scheduler_steps=1, block_size=8), v, 24) for v in VARIANTS]
    llm = LLM(tiny, max_model_len=128, num_scheduler_steps=4, block_size=8)
    engine = llm.llm_engine
    assert engine.runner._decode.enabled
    with caplog.at_level(logging.INFO, logger="lmjax.engine"):
        got = [_outputs(llm, v, 24) for v in VARIANTS]
        engine.runner.wait_for_compiles()
        loops = engine.num_decode_loops
        again = [_outputs(llm, v, 24) for v in VARIANTS]
    for got_v, again_v, want_v in zip(got, again, want, strict=True):
        _same(got_v, want_v)
        _same(again_v, want_v)
    # one background compilation per multi-step variant (penalties step on the host: no multi-step call)
    assert engine.runner._decode.num_background == len(VARIANTS) - 1
    assert sum("in the background" in r.getMessage() for r in caplog.records) == len(VARIANTS) - 1
    assert engine.num_decode_loops >= loops + len(VARIANTS) - 1  # every multi-step variant ran K-step calls


def test_without_background_compiling_the_variant_compiles_when_met(tiny, monkeypatch):
    monkeypatch.setenv("LMJAX_BACKGROUND_COMPILE", "0")
    llm = LLM(tiny, max_model_len=128, num_scheduler_steps=4, block_size=8)
    _outputs(llm, VARIANTS[2], 24)
    assert not llm.llm_engine.runner._decode.enabled and llm.llm_engine.runner._decode.num_background == 0
    assert llm.llm_engine.num_decode_loops > 0
    monkeypatch.setenv("LMJAX_BACKGROUND_COMPILE", "yes")
    with pytest.raises(ValueError, match="LMJAX_BACKGROUND_COMPILE"):
        LLM(tiny, max_model_len=128)


def test_a_failed_background_compilation_leaves_single_steps(tiny, monkeypatch, caplog):
    monkeypatch.setenv("LMJAX_ATTENTION_IMPL", "tiled")
    def fail(lowered):
        raise RuntimeError("out of memory compiling")

    monkeypatch.setattr(background_compile, "_compile", fail)
    want = _outputs(LLM(tiny, max_model_len=128, num_scheduler_steps=1, block_size=8), VARIANTS[3], 24)
    llm = LLM(tiny, max_model_len=128, num_scheduler_steps=4, block_size=8)
    with caplog.at_level(logging.WARNING, logger="lmjax.engine"):
        _same(_outputs(llm, VARIANTS[3], 24), want)
        llm.llm_engine.runner.wait_for_compiles()
        loops = llm.llm_engine.num_decode_loops
        _same(_outputs(llm, VARIANTS[3], 24), want)
    assert llm.llm_engine.num_decode_loops == loops  # single steps, and no second attempt
    assert llm.llm_engine.runner._decode.num_background == 1
    assert any("out of memory compiling" in r.getMessage() for r in caplog.records)


def test_host_sampled_steps_compile_the_model_step_once(tiny, caplog):
    """A logits processor (the host samples) with a presence penalty, whose token lists widen as the output grows,
    compiles the model step no more often than one without a penalty (before: once per penalty-width bucket)."""
    def keep(output_ids, logits):
        return logits

    def step_compiles(**penalty):
        llm = LLM(tiny, max_model_len=128, num_scheduler_steps=1, block_size=8)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lmjax.engine"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0,
                                                      logits_processors=[keep], **penalty), use_tqdm=False)
        return _step_compiles(caplog.records)

    assert step_compiles(presence_penalty=0.5) == step_compiles()


def test_a_dropped_engine_cancels_its_queued_compilations(tiny, monkeypatch):
    """The worker holds no reference to the engine: dropping it frees its parameters and cache while a variant
    compiles, and the variants queued behind that one never compile."""
    import gc
    import threading
    import weakref

    monkeypatch.setenv("LMJAX_ATTENTION_IMPL", "tiled")
    entered, release, compiled = threading.Event(), threading.Event(), []

    def slow_compile(lowered):
        entered.set()
        release.wait(60)
        compiled.append(lowered)
        return lowered.compile()

    monkeypatch.setattr(background_compile, "_compile", slow_compile)
    llm = LLM(tiny, max_model_len=128, num_scheduler_steps=4, block_size=8)
    for variant in VARIANTS[1:4]:  # three multi-step variants queued, the first compiling
        _outputs(llm, variant, 16)
    runner = llm.llm_engine.runner
    assert entered.wait(60) and runner._decode.num_background == 3
    pool, alive = runner._decode._pool, weakref.ref(runner)
    del llm, runner
    gc.collect()
    assert alive() is None  # while the first variant is still compiling
    release.set()
    pool.shutdown(wait=True)
    assert len(compiled) == 1


def test_interpreter_exit_skips_queued_compilations(tiny):
    """At exit, only the compilation in flight finishes (the interpreter runs a worker's queued jobs before it
    joins it, unless they are skipped). (Probe 27: four ran, 9 s.)"""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import atexit, time
        from lmjax import LLM, SamplingParams
        from lmjax.engine import background_compile as bc
        real, started = bc._compile, []
        def slow(lowered):
            started.append(1); time.sleep(2.0); return real(lowered)
        bc._compile = slow
        llm = LLM({tiny!r}, max_model_len=128, num_scheduler_steps=4, block_size=8)
        for variant in {VARIANTS[1:5]!r}:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True, **variant), use_tqdm=False)
        atexit.register(lambda: print("STARTED", len(started), flush=True))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "LMJAX_BACKGROUND_COMPILE": "1"})
    started = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("STARTED")]
    assert out.returncode == 0 and started == ["1"], (out.stdout, out.stderr[-2000:])
