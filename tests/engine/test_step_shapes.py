"""After warm-up, a one-step call whose shape is not compiled yet runs at a larger compiled shape while its own
compiles on a worker thread (lmjax.engine.step_shapes): no step compiles on the engine's thread (it traces them),
and the tokens and logprobs are those of the engine compiling each shape when met."""
import logging
import time

import jax
import numpy as np
import pytest

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams
from lmjax.engine.model_runner import StepInputs
from lmjax.engine.step_shapes import CompiledShapes, StepDims, pad_step_inputs, pad_to_compiled_enabled, step_dims
from lmjax.engine.warmup import large_step_dims
from lmjax.layers.attention import AttentionMetadata

# (prompts, prompt length, sampling): batch sizes, prompt buckets and sampling variants a server meets
WORKLOAD = [(1, 20, dict(temperature=0)), (3, 45, dict(temperature=0)), (5, 13, dict(temperature=0.8, seed=1)),
            (2, 70, dict(temperature=0.7, top_p=0.9, seed=2)), (6, 9, dict(temperature=0, logprobs=2)),
            (8, 30, dict(temperature=0))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


def _llm(tiny, monkeypatch, pad: str) -> LLM:
    monkeypatch.setenv("LMJAX_BACKGROUND_COMPILE", "1")
    monkeypatch.setenv("LMJAX_PAD_TO_COMPILED", pad)
    return LLM(tiny, max_model_len=128, block_size=8, enforce_eager=False, enable_prefix_caching=False,
               max_num_seqs=8, max_num_batched_tokens=256)


def _run(llm) -> list:
    rng = np.random.default_rng(0)
    out = []
    for n, length, sampling in WORKLOAD:
        prompts = [{"prompt_token_ids": rng.integers(4, 100, length).tolist()} for _ in range(n)]
        params = SamplingParams(max_tokens=14, ignore_eos=True, **sampling)
        out += [(c.token_ids, [sorted((t, lp.logprob) for t, lp in e.items()) for e in c.logprobs or ()])
                for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
    return out


def _same(got, want):
    """Same tokens and logprob ids; logprob values equal on the CPU, to float32 rounding on a GPU (where another
    shape's program may round differently: lmjax.engine.step_shapes)."""
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert [[[t for t, _ in e] for e in lps] for _, lps in got] == [[[t for t, _ in e] for e in lps] for _, lps in want]
    got_values = [v for _, lps in got for e in lps for _, v in e]
    want_values = [v for _, lps in want for e in lps for _, v in e]
    if jax.default_backend() == "cpu":
        assert got_values == want_values
    else:
        np.testing.assert_allclose(got_values, want_values, rtol=1e-4, atol=1e-4)


def test_padded_steps_match_and_never_compile_on_the_engine_thread(tiny, monkeypatch, caplog):
    want = _run(_llm(tiny, monkeypatch, "0"))
    llm = _llm(tiny, monkeypatch, "1")
    runner = llm.llm_engine.runner
    assert runner.pad_to_compiled and runner.pad_warmed
    warm_steps, warm_decodes = set(runner._steps._in_jit), set(runner._decode._in_jit)
    with caplog.at_level(logging.INFO, logger="lmjax.engine"):
        got = _run(llm)
    _same(got, want)
    assert runner.num_padded_steps > 0
    # Every step and decode program after warm-up was compiled by the workers, none by the engine's jit.
    assert runner._steps._in_jit == warm_steps and runner._decode._in_jit == warm_decodes
    assert runner._steps.num_background > 0 and runner._decode.num_background > 0
    compiled = [r for r in caplog.records if r.getMessage().startswith("compiled a step variant in the background")]
    assert compiled and all(r.threadName.startswith("lmjax-compile") for r in compiled)
    # Once the worker is done, each step runs at its own shape.
    runner.wait_for_compiles()
    padded = runner.num_padded_steps
    _same(_run(llm), want)
    assert runner.num_padded_steps == padded


def test_warmup_compiles_the_large_shapes_fused_and_apart(tiny, monkeypatch):
    runner = _llm(tiny, monkeypatch, "1").llm_engine.runner
    dims = large_step_dims(runner)
    assert dims[-1] == StepDims(runner.max_T, runner.max_B, runner.max_B, runner.max_M) and dims[0].T == 16
    families = [f for f, held in runner._shapes._dims.items() if set(dims) <= held]
    assert len(families) == 2  # greedy fused, and the shared step every other variant samples apart
    assert not _llm(tiny, monkeypatch, "0").llm_engine.runner._shapes._dims


def test_switch(monkeypatch):
    monkeypatch.setenv("LMJAX_BACKGROUND_COMPILE", "1")
    monkeypatch.setenv("LMJAX_PAD_TO_COMPILED", "auto")
    # auto: GPU only (on a CPU running a larger shape costs about what compiling does)
    assert pad_to_compiled_enabled() == (jax.default_backend() == "gpu")
    monkeypatch.setenv("LMJAX_PAD_TO_COMPILED", "1")
    assert pad_to_compiled_enabled()
    monkeypatch.setenv("LMJAX_BACKGROUND_COMPILE", "0")  # runs that must repeat bit for bit: off too
    assert not pad_to_compiled_enabled()
    monkeypatch.setenv("LMJAX_PAD_TO_COMPILED", "yes")
    with pytest.raises(ValueError, match="LMJAX_PAD_TO_COMPILED='yes'"):
        pad_to_compiled_enabled()


def test_smallest_holding():
    shapes, family = CompiledShapes(), ("f",)
    for dims in [StepDims(16, 16, 16, 8), StepDims(1024, 16, 16, 8), StepDims(64, 4, 4, 8), StepDims(64, 8, 8, 4)]:
        shapes.add(family, dims)
    assert shapes.smallest_holding(family, StepDims(32, 4, 4, 8)) == StepDims(64, 4, 4, 8)
    assert shapes.smallest_holding(family, StepDims(32, 8, 8, 8)) == StepDims(1024, 16, 16, 8)
    assert shapes.smallest_holding(family, StepDims(16, 4, 4, 2)) == StepDims(16, 16, 16, 8)
    assert shapes.smallest_holding(family, StepDims(16, 32, 32, 8)) is None  # no B that large
    assert shapes.smallest_holding(("g",), StepDims(16, 4, 4, 8)) is None  # another family
    shapes = CompiledShapes()
    shapes.add(family, StepDims(4096, 16, 16, 8))
    assert shapes.smallest_holding(family, StepDims(16, 4, 4, 8)) is None  # 256x its tokens: compile instead


def test_pad_step_inputs():
    attn = AttentionMetadata(slot_mapping_T=np.array([9, 10, 17], np.int32), seq_lens_T=np.array([2, 2, 5], np.int32),
                             kv_lens_B=np.array([2, 5], np.int32), block_tables_BM=np.array([[1], [2]], np.int32),
                             cu_q_lens_B1=np.array([0, 2, 3], np.int32))
    inputs = StepInputs(ids_T=np.array([5, 6, 7], np.int32), positions_T=np.array([0, 1, 4], np.int32), attn=attn,
                        last_rows_B=np.array([1, 2], np.int32), next_ids_T=np.array([6, -1, -1], np.int32))
    padded = pad_step_inputs(inputs, StepDims(6, 4, 3, 2))
    assert step_dims(padded) == StepDims(6, 4, 3, 2)
    a = padded.attn
    assert padded.ids_T.tolist() == [5, 6, 7, 0, 0, 0] and padded.positions_T.tolist() == [0, 1, 4, 0, 0, 0]
    assert a.slot_mapping_T.tolist() == [9, 10, 17, 0, 0, 0] and a.seq_lens_T.tolist() == [2, 2, 5, 1, 1, 1]
    assert a.kv_lens_B.tolist() == [2, 5, 0, 0] and a.block_tables_BM.tolist() == [[1, 0], [2, 0], [0, 0], [0, 0]]
    assert a.cu_q_lens_B1.tolist() == [0, 2, 3, 3, 3] and padded.last_rows_B.tolist() == [1, 2, 0]
    assert padded.next_ids_T.tolist() == [6, -1, -1, -1, -1, -1]
    assert all(x.dtype == np.int32 for x in (padded.ids_T, a.cu_q_lens_B1, a.block_tables_BM, padded.last_rows_B))


def test_a_new_shape_is_traced_at_the_next_step_not_the_one_that_met_it(tiny, monkeypatch):
    """The step that meets a new one-step shape runs padded and returns its token before that shape is traced
    for the worker (~0.9 s of the engine's thread on the 1B shape: it was a new server's first token's wait)."""
    llm = _llm(tiny, monkeypatch, "1")
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    traced = []
    lower = runner._steps._lower
    monkeypatch.setattr(runner._steps, "_lower", lambda *args: traced.append(args) or lower(*args))
    req = engine.add_request(list(range(4, 24)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.step()  # its prefill: a shape warm-up did not compile
    assert runner.num_padded_steps == 1 and len(req.completions[0].token_ids) == 1 and not traced
    engine.step()  # traces it first
    assert len(traced) == 1 and not runner._steps._deferred
    runner.wait_for_compiles()
    assert runner._steps.num_background == 1 and len(traced) == 1
    while not req.finished:
        engine.step()
    want = LLM(tiny, max_model_len=128, block_size=8, enable_prefix_caching=False).generate(
        [{"prompt_token_ids": list(range(4, 24))}], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    assert req.completions[0].token_ids == want


def test_the_engine_thread_traces_new_shapes_when_idle(tiny, monkeypatch):
    """Served through the engine thread, a new shape met by the last request is traced once the engine is idle,
    not in the next request's first step."""
    import asyncio

    from lmjax.api.async_engine import AsyncEngine
    from lmjax.config import GenerationConfig

    llm = _llm(tiny, monkeypatch, "1")
    runner = llm.llm_engine.runner
    served = AsyncEngine.over(llm.llm_engine)

    async def one():
        return [o async for o in served.generate(None, 1, GenerationConfig(max_new_tokens=4), input_ids=list(range(4, 24)))]

    try:
        assert asyncio.run(one()) and runner.num_padded_steps == 1
        for _ in range(200):  # the engine thread, idle now, lowers it for the worker
            if not runner._steps._deferred and runner._steps._compiling:
                break
            time.sleep(0.05)
        assert not runner._steps._deferred and runner._steps.num_background == 1
    finally:
        served.close()
