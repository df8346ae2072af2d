"""(Probe 26.) Bad n-gram speculative configs must be refused with the value the user gave (vLLM's
SpeculativeConfig.__post_init__, vllm/config/speculative.py: after filling a missing bound from the other,
`prompt_lookup_min < 1` -> ValueError("prompt_lookup_min=0 must be > 0"), likewise prompt_lookup_max).
lmjax filled a bound with `x or other`, so an explicit 0 was treated as "not given" and silently replaced."""
import pytest

from lmjax import EngineConfig
from lmjax.speculative_config import SpeculativeConfig


@pytest.mark.parametrize("cfg, name", [
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0, "prompt_lookup_max": 3},
     "prompt_lookup_min"),  # today: silently becomes prompt_lookup_min=3
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 0},
     "prompt_lookup_max"),  # today: silently becomes prompt_lookup_max=2
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0},
     "prompt_lookup_max"),  # today: refused, but the message says "got None"
])
def test_a_zero_lookup_bound_is_refused_naming_the_zero(cfg, name):
    with pytest.raises(ValueError, match=rf"{name}(=| .*got )0\b"):
        SpeculativeConfig.of(dict(cfg))
    with pytest.raises(ValueError, match=rf"{name}(=| .*got )0\b"):
        EngineConfig(speculative_config=dict(cfg))


def test_vllm_ngram_spellings_are_accepted():
    """vLLM unifies method "[ngram]" to "ngram" and takes {"model": "ngram"} (no method) as the ngram method
    (the pre-`method` spelling, vLLM's speculative_model="[ngram]"): same __post_init__."""
    assert SpeculativeConfig.of({"method": "[ngram]", "num_speculative_tokens": 3}).method == "ngram"
    assert SpeculativeConfig.of({"model": "ngram", "num_speculative_tokens": 3}).method == "ngram"


def test_a_bool_is_no_token_count():
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 1, got True"):
        SpeculativeConfig(num_speculative_tokens=True)
