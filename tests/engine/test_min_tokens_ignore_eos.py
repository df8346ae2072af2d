"""vLLM bans every id of `all_stop_token_ids` until min_tokens are out, and the model's EOS is added to that set
whatever ignore_eos says (vllm/sampling_params.py update_from_generation_config: "Add the eos token id into the
sampling_params to support min_tokens processing", outside the `if not self.ignore_eos`; the V1
MinTokensLogitsProcessor in vllm/v1/sample/logits_processor/builtin.py bans params.all_stop_token_ids).
lmjax dropped the EOS ids from the min_tokens ban when ignore_eos was set (engine.py `_row`), so EOS was sampled
inside the first min_tokens tokens (probe 25)."""
import pytest

import lmjax
from tiny_llama import write_tiny_llama
from lmjax import SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return lmjax.LLM(write_tiny_llama(tmp_path_factory.mktemp("tiny")), max_model_len=64)


def test_min_tokens_bans_eos_even_with_ignore_eos(llm):
    eos = llm.get_tokenizer().eos_token_id
    out = llm.generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=5, min_tokens=3, ignore_eos=True,
                                                    logit_bias={eos: 100.0}), use_tqdm=False)[0].outputs[0]
    # vLLM: EOS is banned for the first 3 tokens, then (ignore_eos) sampled without stopping: [x, y, z, eos, eos]
    assert eos not in out.token_ids[:3], out.token_ids
    assert out.token_ids[3:] == [eos, eos]
