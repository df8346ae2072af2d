"""Review 29's findings on padded steps and warm-up, each failing before its fix: a shape whose background
compilation failed is compiled when met (it was padded for the engine's life); compilations queued on the
engine-thread-traced path are skipped at interpreter exit (all ran first); under tp a warmed engine's decode calls
reuse warm-up's programs (the fresh KV cache's sharding was spelled P(.., 'tp', None), a step's output cache
P(.., 'tp'): jit compiled warm-up's first program again in the middle of serving)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams
from lmjax.engine import background_compile

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


def test_a_failed_background_compile_stops_padding(tiny, monkeypatch):
    monkeypatch.setenv("LMJAX_BACKGROUND_COMPILE", "1")
    monkeypatch.setenv("LMJAX_PAD_TO_COMPILED", "1")
    llm = LLM(tiny, max_model_len=128, block_size=8, enforce_eager=False, enable_prefix_caching=False,
              max_num_seqs=8, max_num_batched_tokens=256)
    runner = llm.llm_engine.runner

    def fail(lowered):
        raise RuntimeError("compile failed (say, out of memory while autotuning)")

    monkeypatch.setattr(background_compile, "_compile", fail)
    prompts = [list(range(5 + i, 25 + i)) for i in range(3)]
    greedy = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert runner.num_padded_steps > 0
    runner.wait_for_compiles()
    assert runner._steps._failed
    padded = runner.num_padded_steps
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert runner.num_padded_steps == padded and again == first


EXIT_SCRIPT = textwrap.dedent("""
    import sys, time
    import jax, jax.numpy as jnp
    from lmjax.engine import background_compile as bc

    log_path = sys.argv[1]
    real = bc._compile

    def slow(lowered):
        time.sleep(1.0)
        with open(log_path, "a") as f:
            f.write("compiled\\n")
        return real(lowered)

    bc._compile = slow
    compiler = bc.BackgroundCompiler(jax.jit(lambda x: x + 1), enabled=True, name="step", lower_here=True)
    for n in range(1, 6):  # five variants queued on the one worker
        args = (jax.ShapeDtypeStruct((n,), jnp.float32),)
        compiler.compile_later(bc.variant_key(args, {}), args, {})
    compiler.lower_deferred()  # (as the engine's next step does)
    time.sleep(0.2)  # the first is compiling, four are queued: the interpreter exits now
""")


def test_queued_compilations_traced_here_are_skipped_at_exit(tmp_path):
    log = tmp_path / "log"
    subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(log)], check=True, timeout=120,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert len(log.read_text().splitlines()) <= 1


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_calls_reuse_warmed_programs_under_tp(tiny, tp):
    done = subprocess.run([sys.executable, os.path.join(TESTS, "parallel", "warmup_reuse_driver.py"), tiny, str(tp)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["chained"] > 0 and result["after"] == [result["warmed"]] * 3, result
