"""Two sampling conventions of the facades (session 26):
- LMDeploy draws a random seed for each request without `random_seed` (AsyncEngine.generate:
  `if gen_config.random_seed is None and sequence_start: gen_config.random_seed = random.getrandbits(64)`),
  so unseeded sampling differs from one pipeline to the next; lmjax's engine seed was 0 for every facade,
  so every pipeline run repeated the last one's "random" samples. vLLM's LLM keeps seed 0 (reproducible).
- vLLM's CompletionOutput.cumulative_logprob is None when the request asked for no logprobs
  (vllm/v1/engine/logprobs.py: `cumulative_logprob=(None if num_logprobs is None else 0.)`); lmjax gave a
  float there."""
import lmjax
from lmjax import GenerationConfig, PytorchEngineConfig, SamplingParams
from lmjax.config import EngineConfig
from tiny_llama import write_tiny_llama

SAMPLE = GenerationConfig(max_new_tokens=12, top_k=0, temperature=1.5, ignore_eos=True)


def test_pipelines_sample_differently_without_a_seed_and_alike_with_one(tmp_path):
    path = write_tiny_llama(tmp_path)
    runs, seeded = [], []
    for config in (None, PytorchEngineConfig(session_len=64)):
        pipe = lmjax.pipeline(path, backend_config=config)
        try:
            runs.append(pipe(["t5 t9 t7"], gen_config=SAMPLE, do_preprocess=False)[0].token_ids)
            seeded.append(pipe(["t5 t9 t7"], gen_config=GenerationConfig(**{**vars(SAMPLE), "random_seed": 7}),
                               do_preprocess=False)[0].token_ids)
        finally:
            pipe.close()
    assert runs[0] != runs[1]  # 12 tokens at temperature 1.5 over a 256-token vocabulary: never equal by chance
    assert seeded[0] == seeded[1]


def test_engine_config_seed_none_is_accepted_and_other_types_are_not():
    assert EngineConfig(seed=None).seed is None
    try:
        EngineConfig(seed="7")
    except ValueError as e:
        assert "seed must be None or an int, got '7'" in str(e)
    else:
        raise AssertionError("EngineConfig(seed='7') was accepted")


def test_llm_cumulative_logprob_only_with_logprobs(tmp_path):
    llm = lmjax.LLM(write_tiny_llama(tmp_path), max_model_len=64)
    plain = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4))[0]
    scored = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4, logprobs=0))[0]
    assert plain.outputs[0].cumulative_logprob is None
    lp = scored.outputs[0]
    assert lp.cumulative_logprob == sum(d[t].logprob for d, t in zip(lp.logprobs, lp.token_ids))
