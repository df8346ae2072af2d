"""LMDeploy's GenerationConfig accepts top_p in [0, 1] (lmdeploy/messages.py GenerationConfig.__post_init__:
`assert self.top_p >= 0 and self.top_p <= 1  # [0, 1]`), and top_p=0 decodes greedily: the PyTorch engine's
_filter_topp_sorted_ masks every sorted token but the first (`mask = cum_scores > topp; mask[:, 0] = False`),
TurboMind's set_runtime_args turns top_k=0, top_p=0 into top_k=1. lmjax's GenerationConfig shared vLLM's
(0, 1] check (lmjax/config.py _check_sampling), so LMDeploy code passing top_p=0 failed with a ValueError (probe 25)."""
import pytest

import lmjax
from lmjax import GenerationConfig, PytorchEngineConfig
from tiny_llama import write_tiny_llama


def test_generation_config_accepts_top_p_zero():
    assert GenerationConfig(top_k=0, top_p=0.0, temperature=0.8).to_sampling_params().is_greedy  # LMDeploy: valid
    with pytest.raises(ValueError, match=r"top_p must be in \[0, 1\], got 1.5"):
        GenerationConfig(top_p=1.5)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return lmjax.pipeline(write_tiny_llama(tmp_path_factory.mktemp("tiny")),
                          backend_config=PytorchEngineConfig(session_len=64))


def test_top_p_zero_decodes_greedily_as_lmdeploy(pipe):
    greedy = pipe(["t5 t9 t7"], gen_config=GenerationConfig(max_new_tokens=6), do_preprocess=False)[0]
    out = pipe(["t5 t9 t7"], gen_config=GenerationConfig(max_new_tokens=6, top_k=0, top_p=0.0, temperature=1.0,
                                                         random_seed=1), do_preprocess=False)[0]
    assert out.token_ids == greedy.token_ids
