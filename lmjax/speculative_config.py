"""vLLM's speculative_config for lmjax's n-gram speculative decoding (lmjax.engine.speculative)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from lmjax.validation import check as _check, is_int


@dataclass
class SpeculativeConfig:
    """vLLM's ngram speculative_config: when only one of prompt_lookup_min / max is given the other takes its
    value, when neither both are 5 (vLLM's rules: a bound given as 0 is refused, not replaced). vLLM's other
    spellings of the method, "[ngram]" and model="ngram" (its older speculative_model="[ngram]"), are taken."""
    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self):
        self.method = "ngram" if self.method == "[ngram]" else self.method
        _check(self.method == "ngram", f"speculative method {self.method!r} is not supported by lmjax (only 'ngram')")
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = 5
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            _check(is_int(value) and value >= 1, f"{name} must be an int >= 1, got {value!r}")
        _check(self.prompt_lookup_min <= self.prompt_lookup_max,
               f"prompt_lookup_min={self.prompt_lookup_min} must not exceed prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def of(cls, value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, or vLLM's dict form."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict or None, got {type(value).__name__}")
        method, model = value.get("method"), value.get("model")
        ngram = (None, "ngram", "[ngram]")  # (a draft model named beside method="ngram": the keys' error below)
        _check(method in ngram and (method is not None or model in ngram),
               f"speculative method {method or 'draft model'!r} (model={model!r}) is not supported by lmjax: "
               "only n-gram lookup, method='ngram'")
        if value.get("model") in ("ngram", "[ngram]") and value.get("method", "ngram") == "ngram":
            value = {k: v for k, v in value.items() if k != "model"}  # vLLM: model="ngram" names the method
        unknown = set(value) - {f.name for f in fields(cls)}
        _check(not unknown, f"speculative_config keys {sorted(unknown)} are not supported by lmjax (method='ngram': "
                            "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min)")
        return cls(**value)
