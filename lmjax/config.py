"""User-facing configuration: plain dataclasses, validated when they are created.

Two families of names reach one engine:
- per request: LMDeploy's `GenerationConfig` and vLLM's `SamplingParams`. The engine works on
  `SamplingParams` only; `GenerationConfig.to_sampling_params()` maps one onto the other.
- per engine: lmjax's own `EngineConfig`; LMDeploy's `TurbomindEngineConfig` / `PytorchEngineConfig`
  (lmjax/lmdeploy_config.py) lower onto it with `to_engine_config()`. A field lmjax cannot honour yet
  raises `NotImplementedError` when set to anything but its default: it is never silently ignored.

`ChatTemplateConfig` (lmjax.chat_template, re-exported here) turns chat messages into a prompt string.

Errors name the offending value: `ValueError("top_p must be in (0, 1], got 0")`; an unknown
keyword is a `TypeError` that lists it and suggests the nearest valid field.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmjax.chat_template import ChatTemplateConfig  # noqa: F401  (re-exported: lmjax.config's name too)
from lmjax.guided_params import GuidedDecodingParams, as_guided, from_response_format
from lmjax.request_fields import AllIds, RequestOutputKind, check_output_kinds, check_processors
from lmjax.speculative_config import SpeculativeConfig  # noqa: F401  (re-exported: lmjax.config's name too)
from lmjax.validation import FLOAT32_MAX, FLOAT32_TINY, as_list as _as_list, check as _check, check_logit_bias
from lmjax.validation import check_numbers as _check_numbers, is_int as _is_int, strict_fields as _strict_fields
from lmjax.validation import check_bools, check_defaults_only, warn_no_effect  # noqa: F401  (re-exported, used here too)

DTYPES = ("auto", "bfloat16", "float16", "float32")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's --dtype spellings


def dtype_name(dtype) -> str:
    """One of DTYPES for a dtype as vLLM takes it: a name, "half" / "float", or a torch / numpy / JAX dtype;
    a ValueError naming anything else."""
    if isinstance(dtype, str):  # (vLLM lower-cases the name)
        name = DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    elif str(dtype).startswith("torch."):
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            name = np.dtype(dtype).name if dtype is not None else None
        except TypeError:
            name = None
    _check(name in DTYPES, f"dtype must be one of {DTYPES + tuple(DTYPE_ALIASES)} or a torch / JAX dtype of "
                           f"those, got {dtype!r}")
    return name


def _check_defaults_only(obj, defaults: dict) -> None:
    """check_defaults_only for a dataclass's fields."""
    check_defaults_only(type(obj).__name__, {name: getattr(obj, name) for name in defaults}, defaults)


SAMPLING_NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty")


def _check_sampling(temperature, top_p, top_k, min_p, repetition_penalty, n, logprobs, top_p_zero=False) -> None:
    """Checks shared by GenerationConfig and SamplingParams (`top_p_zero`: LMDeploy's [0, 1] range)."""
    _check(temperature >= 0, f"temperature must be >= 0, got {temperature}")
    # The sampler divides logits by it in float32: past float32's range it becomes inf, and -inf / inf (a
    # banned token's logit) is NaN
    _check(temperature <= FLOAT32_MAX, f"temperature must be at most {FLOAT32_MAX:.6g} (float32's largest), "
                                       f"got {temperature}")
    _check(0 < top_p <= 1 or (top_p_zero and top_p == 0), f"top_p must be in {'[' if top_p_zero else '('}0, 1], "
                                                           f"got {top_p}")
    _check(isinstance(top_k, int) and top_k >= -1, f"top_k must be an int >= -1, got {top_k!r}")
    _check(0 <= min_p <= 1, f"min_p must be in [0, 1], got {min_p}")
    _check(repetition_penalty > 0, f"repetition_penalty must be > 0, got {repetition_penalty}")
    # ... and multiplies or divides a seen token's logit by it: both it and 1 / it must stay finite in float32
    _check(FLOAT32_TINY <= repetition_penalty <= FLOAT32_MAX,
           f"repetition_penalty must be in [{FLOAT32_TINY:.6g}, {FLOAT32_MAX:.6g}] (float32's range, for it and "
           f"its inverse), got {repetition_penalty}")
    _check(isinstance(n, int) and n >= 1, f"n must be an int >= 1, got {n!r}")
    _check(logprobs is None or (isinstance(logprobs, int) and logprobs >= -1),
           f"logprobs must be None, -1 (the whole vocabulary) or an int >= 0, got {logprobs!r}")


# SamplingParams' list fields (flat lists of ints or strings, or of shared logits processors): clone copies each.
_LIST_FIELDS = ("stop", "stop_token_ids", "bad_words", "bad_token_ids", "allowed_token_ids", "logits_processors")


def check_cache_salt(salt) -> None:
    """vLLM's cache_salt: None or a non-empty string (SamplingParams' field, a prompt dict's key)."""
    _check(salt is None or (isinstance(salt, str) and salt != ""),
           f"cache_salt must be a non-empty string, got {salt!r}")


@_strict_fields
@dataclass
class SamplingParams:
    """Per-request sampling parameters (vLLM names and defaults); the engine's internal form.

    temperature 0 (or top_k 1) means greedy. top_k 0 or -1 disables top-k. `max_tokens=None`
    means "up to the session length": the engine caps it at session_len - prompt length.
    `stop` strings are matched on the detokenized text (lmjax.engine.stop); `stop_token_ids`
    on sampled ids. `bad_token_ids` is an lmjax extension (from LMDeploy): ids never sampled.
    `allowed_token_ids`: the only ids that may be sampled (EOS only if listed, as vLLM). `guided_decoding`
    (alias `structured_outputs`, vLLM >= 0.11's name): a JSON schema, regex or choice (lmjax.engine.guided).
    `logit_bias` {token id: bias}: added to those ids' raw logits before anything else (lmjax.layers.sampler).
    `seed=None` lets the engine pick one (see `EngineConfig.seed`).
    """
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = field(default_factory=list)  # None -> [] as vLLM normalises both
    stop_token_ids: list[int] | None = field(default_factory=list)
    bad_words: list[str] | None = None
    bad_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (vLLM; -1: the model's limit)
    allowed_token_ids: list[int] | None = None
    guided_decoding: GuidedDecodingParams | None = None
    structured_outputs: GuidedDecodingParams | None = None  # an alias: moved to guided_decoding
    logit_bias: dict[int, float] | None = None
    # vLLM's (V0) per-request processors, on the host: see lmjax.engine.host_outputs
    logits_processors: list | None = None
    # lmjax extensions, LMDeploy's GenerationConfig fields: "generation" or "all" (lmjax.engine.host_outputs)
    output_logits: str | None = None
    output_last_hidden_state: str | None = None
    detokenize: bool = True  # False: token ids only, text "" (vLLM's)
    # lmjax's: LMDeploy's filter order, min_p after top-k and top-p (GenerationConfig sets it); vLLM's first
    min_p_after_top_p: bool = False
    # vLLM's cache_salt (a prompt dict's / a server request's field, carried here): prompts with other salts
    # never share prefix-cache blocks (one tenant cannot probe another's prompts by timing or cached_tokens)
    cache_salt: str | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # vLLM's: what lmjax.LLMEngine.step returns
    # vLLM fields lmjax does not implement: accepted at their defaults only
    best_of: int | None = None
    # vLLM's room for custom samplers' arguments (no in-tree sampler there reads it either): carried, unread
    extra_args: dict[str, Any] | None = None

    def __post_init__(self):
        _check_numbers(self, SAMPLING_NUMBERS + ("presence_penalty", "frequency_penalty"))
        best_of = self.best_of if self.best_of in (None, self.n) else None
        _check_defaults_only(self, {"best_of": best_of})
        _check(isinstance(self.detokenize, bool), f"detokenize must be True or False, got {self.detokenize!r}")
        _check(isinstance(self.output_kind, RequestOutputKind),
               f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self.logits_processors = check_processors(self.logits_processors)
        check_output_kinds(self)
        _check(self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens)
                                                       and (self.truncate_prompt_tokens >= 1
                                                            or self.truncate_prompt_tokens == -1)),
               f"truncate_prompt_tokens must be None, -1 (the model's limit) or an int >= 1, got "
               f"{self.truncate_prompt_tokens!r}")
        _check_sampling(self.temperature, self.top_p, self.top_k, self.min_p,
                        self.repetition_penalty, self.n, self.logprobs)
        for name in ("presence_penalty", "frequency_penalty"):
            _check(-2 <= getattr(self, name) <= 2, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               f"max_tokens must be None or an int >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
               f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= -1),
               f"prompt_logprobs must be None, -1 (the whole vocabulary) or an int >= 0, got {self.prompt_logprobs!r}")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an int, got {self.seed!r}")
        self.seed = None if self.seed == -1 else self.seed  # vLLM's: -1 is "no seed", as None
        check_cache_salt(self.cache_salt)
        for name, kind in (("stop", str), ("bad_words", str), ("stop_token_ids", int), ("bad_token_ids", int),
                           ("allowed_token_ids", int)):
            setattr(self, name, _as_list(getattr(self, name), name, kind))
        self.stop, self.stop_token_ids = self.stop or [], self.stop_token_ids or []
        _check(all(self.stop), f"stop strings must be non-empty, got {self.stop!r}")
        _check(self.detokenize or not self.stop, f"stop strings are only supported when detokenize is True, got "
                                                 f"stop={self.stop!r} with detokenize=False")
        _check(self.allowed_token_ids != [], "allowed_token_ids must not be empty (None: every id)")
        self.logit_bias = check_logit_bias(self.logit_bias)
        self.guided_decoding, self.structured_outputs = as_guided(self.guided_decoding, self.structured_outputs), None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def all_stop_token_ids(self) -> set[int]:
        """vLLM's: the ids that end generation. vLLM adds the model's EOS ids (unless ignore_eos) when the
        request is submitted; these params do not know the model, so here (as on a fresh vLLM object) it is
        set(stop_token_ids). The engine adds its EOS ids itself (LLMEngine.eos_token_ids)."""
        return set(self.stop_token_ids)

    @staticmethod
    def from_optional(**fields) -> SamplingParams:
        """vLLM's: SamplingParams of the fields given, a None one taking its default."""
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's), e.g. to set one prompt's fields without touching a shared object. The
        logits processors are shared, not copied (as vLLM: they may hold a tokenizer or a model)."""
        clone = copy.copy(self)
        for name in _LIST_FIELDS:  # lists of ints / strings: a new list is a deep copy, and cheap at 100k ids
            if getattr(self, name) is not None:
                setattr(clone, name, list(getattr(self, name)))
        clone.logit_bias = None if self.logit_bias is None else dict(self.logit_bias)
        clone.guided_decoding = copy.deepcopy(self.guided_decoding)
        clone.extra_args = copy.deepcopy(self.extra_args)
        return clone

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


class PoolingSampling(SamplingParams):
    """The engine's form of a pooling (embedding) request, vLLM's PoolingParams: one greedy token whose final-norm
    hidden state (output_last_hidden_state="generation") is the output (lmjax.api.embed). That token is no
    generated output (the token counters leave it out) and the request finishes "stop", as vLLM's pooling ones."""

    @classmethod
    def embedding(cls, truncate_prompt_tokens: int | None = None) -> PoolingSampling:
        return cls(temperature=0.0, max_tokens=1, ignore_eos=True, output_last_hidden_state="generation",
                   truncate_prompt_tokens=truncate_prompt_tokens)


class _DefaultTopK(int):
    """GenerationConfig's top_k when the caller left it alone (it prints as 1): do_sample=True then
    means LMDeploy 0.6's default, SAMPLING_TOP_K. dataclasses.replace carries the mark along."""


SAMPLING_TOP_K = 50  # LMDeploy >= 0.6: GenerationConfig.top_k's default, used when do_sample=True


@_strict_fields
@dataclass
class GenerationConfig:
    """LMDeploy's per-request generation parameters. Defaults follow the LMDeploy docs of the seeds
    (before LMDeploy 0.6): top_k=1 means greedy decoding; set top_k=0 or >1 to sample.

    do_sample is LMDeploy 0.6's switch, for code written against it: None (default) keeps the rule
    above; False decodes greedily whatever top_k, top_p and temperature say; True samples, and with
    top_k left at its default, from the 50 most likely tokens (LMDeploy 0.6's default top_k). One
    difference, on purpose: LMDeploy's do_sample=False also drops repetition_penalty; lmjax applies it
    (greedy decoding with a penalty is a request worth honouring, not noise to strip).
    """
    n: int = 1
    max_new_tokens: int | None = 512
    do_sample: bool | None = None
    top_p: float = 1.0
    top_k: int = _DefaultTopK(1)
    min_p: float = 0.0
    temperature: float = 0.8
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    random_seed: int | None = None
    stop_words: list[str] | None = None
    bad_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    response_format: dict | None = None  # {"type": "json_schema" | "regex_schema" | "json_object", ...}
    # LMDeploy's (input_ids, logits) -> logits callables, and its outputs: lmjax.engine.host_outputs
    logits_processors: list | None = None
    output_logits: str | None = None
    output_last_hidden_state: str | None = None

    def __post_init__(self):
        _check_numbers(self, SAMPLING_NUMBERS)
        self.logits_processors = check_processors(self.logits_processors)
        check_output_kinds(self)
        from_response_format(self.response_format)  # a bad one fails here, naming it
        _check_sampling(self.temperature, self.top_p, self.top_k, self.min_p,
                        self.repetition_penalty, self.n, self.logprobs, top_p_zero=True)
        _check(self.max_new_tokens is None or (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1),
               f"max_new_tokens must be None or an int >= 1, got {self.max_new_tokens!r}")
        _check(self.do_sample in (None, True, False), f"do_sample must be None, True or False, got {self.do_sample!r}")
        check_bools(self, ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                           "include_stop_str_in_output"))
        _check(self.random_seed is None or _is_int(self.random_seed),
               f"random_seed must be None or an int, got {self.random_seed!r}")
        if self.do_sample and isinstance(self.top_k, _DefaultTopK):
            self.top_k = SAMPLING_TOP_K
        _check(self.min_new_tokens is None or (isinstance(self.min_new_tokens, int) and self.min_new_tokens >= 0),
               f"min_new_tokens must be None or an int >= 0, got {self.min_new_tokens!r}")
        _check(None in (self.min_new_tokens, self.max_new_tokens) or self.min_new_tokens <= self.max_new_tokens,
               f"min_new_tokens={self.min_new_tokens} must not exceed max_new_tokens={self.max_new_tokens}")
        for name, kind in (("stop_words", str), ("bad_words", str), ("stop_token_ids", int), ("bad_token_ids", int)):
            setattr(self, name, _as_list(getattr(self, name), name, kind))

    def to_sampling_params(self) -> SamplingParams:
        # top_p 0 keeps only the most likely token in LMDeploy's engines (TurboMind: top_k 1)
        greedy = self.do_sample is False or self.top_k == 1 or self.temperature == 0 or self.top_p == 0
        return SamplingParams(
            n=self.n, max_tokens=self.max_new_tokens, min_tokens=self.min_new_tokens or 0,
            temperature=0.0 if greedy else self.temperature, top_k=0 if greedy else self.top_k,
            top_p=self.top_p or 1.0, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos, seed=self.random_seed, stop=self.stop_words,
            stop_token_ids=self.stop_token_ids, bad_words=self.bad_words,
            bad_token_ids=self.bad_token_ids, logprobs=self.logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            guided_decoding=from_response_format(self.response_format),
            logits_processors=[AllIds(f) for f in self.logits_processors or ()] or None,
            output_logits=self.output_logits, output_last_hidden_state=self.output_last_hidden_state,
            min_p_after_top_p=True)


# Engine features that have a field but no implementation yet: a non-default value raises.
# Remove an entry here when the feature lands.
ENGINE_UNSUPPORTED: dict = {}


@_strict_fields
@dataclass
class EngineConfig:
    """lmjax's own engine configuration; the LMDeploy configs lower onto it.

    cache_max_entry_count: a fraction in (0, 1] of free device memory for the KV cache, or an
    integer > 1 meaning a block count. num_gpu_blocks > 0 overrides both.
    session_len None: the model's context (max_position_embeddings, times the factor of linear or dynamic RoPE
    scaling). device_type 'auto': JAX's default.
    seed: engine-wide seed; requests without one get seeds derived from it (vLLM's default 0: an unseeded
    run repeats itself). None: a fresh random one, so unseeded sampling differs from run to run, as LMDeploy's
    (its AsyncEngine draws a random seed for each request without random_seed); `pipeline` and AsyncEngine
    with LMDeploy's configs use None.
    max_logprobs: the most top log-probabilities a request may ask for, per sampled token
    (`logprobs`) or prompt token (`prompt_logprobs`); vLLM's engine argument and default. Each
    power-of-two count compiles its own step, so the cap bounds compilations too; -1: the vocabulary.
    """
    dtype: str = "auto"
    tp: int = 1
    session_len: int | None = None
    max_batch_size: int = 128
    block_size: int = 64
    cache_max_entry_count: float = 0.5
    num_gpu_blocks: int = 0
    max_prefill_token_num: int = 8192
    enable_prefix_caching: bool = False
    quant_policy: int = 0
    rope_scaling_factor: float = 0.0
    use_dynamic_ntk: bool = False
    use_logn_attn: bool = False
    seed: int | None = 0
    device_type: str = "auto"
    num_scheduler_steps: int = 8  # decode steps per host round trip when no request needs the host
    warmup: bool = False  # compile every decode batch bucket at start-up (LLM(enforce_eager=False))
    max_logprobs: int = 20
    speculative_config: SpeculativeConfig | dict | None = None  # vLLM's ngram speculation (lmjax.engine.speculative)
    # vLLM's: the engine's share of device memory, the KV cache taking what the weights leave (None: LMDeploy's rule)
    gpu_memory_utilization: float | None = None

    def __post_init__(self):
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        self.dtype = dtype_name(self.dtype)
        for name in ("tp", "max_batch_size", "block_size", "max_prefill_token_num", "num_scheduler_steps"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, f"{name} must be an int >= 1, got {value!r}")
        _check(self.session_len is None or _is_int(self.session_len) and self.session_len >= 1,
               f"session_len must be None or an int >= 1, got {self.session_len!r}")
        _check(self.seed is None or _is_int(self.seed), f"seed must be None or an int, got {self.seed!r}")
        c, u = self.cache_max_entry_count, self.gpu_memory_utilization
        _check(0 < c <= 1 or (c > 1 and float(c).is_integer()),
               f"cache_max_entry_count must be a fraction in (0, 1] or a block count, got {c}")
        _check(u is None or 0 < u <= 1, f"gpu_memory_utilization must be in (0, 1], got {u}")
        check_bools(self, ("enable_prefix_caching", "use_dynamic_ntk", "use_logn_attn", "warmup"))
        _check(_is_int(self.num_gpu_blocks) and self.num_gpu_blocks >= 0,
               f"num_gpu_blocks must be an int >= 0, got {self.num_gpu_blocks!r}")
        _check(isinstance(self.max_logprobs, int) and self.max_logprobs >= -1,
               f"max_logprobs must be an int >= -1 (-1: the vocabulary), got {self.max_logprobs!r}")
        _check(_is_int(self.quant_policy) and self.quant_policy in (0, 4, 8),
               f"quant_policy must be the int 0, 4 or 8, got {self.quant_policy!r}")
        _check(0 <= self.rope_scaling_factor < math.inf,
               f"rope_scaling_factor must be a finite number >= 0, got {self.rope_scaling_factor}")
        _check(self.device_type in ("auto", "gpu", "cpu", "tpu"),
               f"device_type must be auto, gpu, cpu or tpu, got {self.device_type!r}")
        for name, default in ENGINE_UNSUPPORTED.items():
            if getattr(self, name) != default:
                raise NotImplementedError(f"{name}={getattr(self, name)!r} is not supported by lmjax yet")

    def num_blocks(self, free_bytes: int, bytes_per_block: int) -> int:
        """KV-cache block count: num_gpu_blocks, else an integral cache_max_entry_count > 1,
        else that fraction of `free_bytes`."""
        if self.num_gpu_blocks:
            return self.num_gpu_blocks
        if self.cache_max_entry_count > 1:
            return int(self.cache_max_entry_count)
        return int(free_bytes * self.cache_max_entry_count) // bytes_per_block
