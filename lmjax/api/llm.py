"""vLLM's offline API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(messages)`.

vLLM's constructor arguments map onto EngineConfig: gpu_memory_utilization (the engine's share of device memory),
max_model_len -> session_len, max_num_seqs -> max_batch_size, max_num_batched_tokens ->
max_prefill_token_num (both default by device, as vLLM's do: 1024 sequences and 16,384 batched tokens on a
GPU with >= 70 GiB that is not an A100, else 256 and 8,192), enforce_eager=False -> warmup (vLLM captures a CUDA graph per batch size at start-up;
lmjax compiles the decode step of every batch bucket; the default None compiles each bucket when first
reached, since on a CPU a start-up warm-up costs seconds per bucket). Arguments that only tune vLLM's own
machinery (swap_space, CUDA-graph capture sizes, ...: `_VLLM_TUNING`) take any value, a non-default one logged
once as having no effect; the other vLLM-only ones (`_VLLM_ONLY_DEFAULTS`) raise at anything but their
default, never silently ignored. kv_cache_dtype="int8" / "int4" quantizes the KV cache
(LMDeploy's quant_policy 8 / 4); vLLM's float8 values raise. enable_prefix_caching is on unless False, as
in vLLM V1 (n > 1 siblings and prompts sharing a prefix prefill it once, also within one step).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

import jax

from lmjax.api.batch import encode_text, is_token_id, per_prompt, run_to_completion, submit_all, token_ids_of
from lmjax.api.batch_limits import batch_defaults, batch_limits
from lmjax.api.beam_search import BeamSearchOutput, BeamSearchParams, beam_search as run_beam_search
from lmjax.api.embed import EmbeddingRequestOutput, PoolingParams, embed_token_ids
from lmjax.api.outputs import RequestOutput, request_output
from lmjax.config import EngineConfig, SamplingParams, check_cache_salt, check_defaults_only, warn_no_effect
from lmjax.engine.apply_model import apply_model
from lmjax.engine.engine import LLMEngine
from lmjax.guided_params import GuidedDecodingParams
from lmjax.loader.awq import require_awq
from lmjax.loader.generation_config import check_generation_config_choice, chosen_sampling_defaults
from lmjax.loader.model_loader import read_model_config
from lmjax.loader.resolve import resolve_model_path
from lmjax.loader.tokenizer import render_chat

logger = logging.getLogger("lmjax.api")

# vLLM arguments with no lmjax meaning that would change what is generated or need a missing feature:
# allowed only at these values. tokenizer_mode="slow" stays refused: LLMEngine loads the tokenizer (fast, or
# a GGUF file's, which has no slow form) and takes no mode; a slow one could also tokenize differently.
# skip_tokenizer_init: lmjax always detokenizes; revision / tokenizer_revision: another checkpoint;
# cpu_offload_gb > 0: a model that needs it would not fit (lmjax has no weight offload); pipeline_parallel_size:
# no pipeline parallelism; load_format: lmjax reads the format from the path ("dummy" weights it has not);
# hf_overrides: another model config.
# a prompt dict's fields lmjax reads (vLLM's TextPrompt / TokensPrompt)
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}
_VLLM_ONLY_DEFAULTS = {"tokenizer_mode": "auto", "skip_tokenizer_init": False, "trust_remote_code": False,
                       "revision": None, "tokenizer_revision": None, "cpu_offload_gb": 0, "pipeline_parallel_size": 1,
                       "load_format": "auto", "hf_overrides": None,
                       # logprobs are the raw model's (lmjax.layers.sampler); the processed modes are not built
                       "logprobs_mode": "raw_logprobs"}

# vLLM arguments that only tune parts lmjax does not have: any value is accepted, a non-default one is logged
# once as having no effect. {name: (default, why)}
_EXECUTOR_BACKENDS = (None, "mp", "ray", "uni", "external_launcher")
_VLLM_TUNING = {
    "swap_space": (4, "no CPU swap space: a preempted request is recomputed (vLLM: 0 is safe with best_of=1)"),
    "max_context_len_to_capture": (None, "no CUDA graphs (lmjax compiles a step per batch bucket)"),
    "max_seq_len_to_capture": (8192, "no CUDA graphs (lmjax compiles a step per batch bucket)"),
    "disable_custom_all_reduce": (False, "no custom all-reduce kernel (XLA's collectives)"),
    "disable_async_output_proc": (False, "no asynchronous output processor"),
    # vLLM's LLM defaults it to True; lmjax logs no periodic stats (LLMEngine.stats() gives the counters)
    "disable_log_stats": (True, "lmjax logs no periodic engine stats; see llm.llm_engine.stats()"),
    "task": ("auto", "an LLM serves generate and embed alike"),
    "download_dir": (None, "nothing is downloaded: models are local paths"),
    "distributed_executor_backend": (None, "one process drives every local device (JAX; tp across hosts: "
                                           "jax.distributed)"),
    "enable_chunked_prefill": (None, "prefill is always chunked to max_num_batched_tokens"),
}


def _check_quantization(model, quantization: str | None) -> None:
    """vLLM's quantization=: None reads the format from the checkpoint (as lmjax always does); "awq"
    must name an AWQ checkpoint; other methods are not lmjax's (`lmjax convert --quant w8|w4` makes its own)."""
    if quantization is None:
        return
    if quantization != "awq":
        raise NotImplementedError(f"LLM(quantization={quantization!r}) is not supported by lmjax: AWQ checkpoints "
                                  "load with 'awq' or None; `lmjax convert --quant w8|w4` quantizes others")
    require_awq(resolve_model_path(model), "LLM(quantization='awq')")


def _as_list(prompts) -> list:
    """One prompt (a str, a dict or a list of token ids) or a list of them, as a list."""
    if isinstance(prompts, (bytes, bytearray)):  # a Sequence of ints to Python: not token ids
        raise TypeError(f"a prompt must be a str or token ids, got {type(prompts).__name__} (bytes: decode them first)")
    one = isinstance(prompts, (str, dict)) or (prompts and is_token_id(prompts[0]))
    return [prompts] if one else prompts


def refuse_host_rows(params: SamplingParams) -> None:
    """output_logits / output_last_hidden_state are LMDeploy's (Response.logits / last_hidden_state): vLLM's
    RequestOutput has no place for the rows, so its facades refuse them instead of computing them for nobody."""
    for name in ("output_logits", "output_last_hidden_state"):
        if getattr(params, name) is not None:
            raise ValueError(f"{name}={getattr(params, name)!r} is LMDeploy's: RequestOutput has no field for it; use "
                             "lmjax.pipeline / AsyncEngine (Response.logits, .last_hidden_state), or LLM.embed")


def _no_lora(lora_request) -> None:
    if lora_request is not None:
        raise NotImplementedError(f"lora_request={lora_request!r} is not supported by lmjax (no LoRA adapters)")


def _no_prompt_adapter(prompt_adapter_request) -> None:
    if prompt_adapter_request is not None:
        raise NotImplementedError(f"prompt_adapter_request={prompt_adapter_request!r} is not supported by lmjax "
                                  "(no prompt adapters)")


# vLLM's guided_options_request (LLMGuidedOptions dict / GuidedDecodingRequest): field -> GuidedDecodingParams'
_GUIDED_OPTIONS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                   "guided_grammar": "grammar", "guided_json_object": "json_object", "structural_tag": "structural_tag",
                   "guided_decoding_backend": "backend", "guided_whitespace_pattern": "whitespace_pattern"}


def _guide_from_options(options) -> GuidedDecodingParams | None:
    """vLLM's guided_options_request (a dict or an object with its guided_* fields; a GuidedDecodingParams
    passes as it is) as GuidedDecodingParams. GuidedDecodingParams checks it: exactly one kind of guide."""
    if options is None or isinstance(options, GuidedDecodingParams):
        return options
    if isinstance(options, dict):
        unknown = sorted(set(options) - set(_GUIDED_OPTIONS))
        if unknown:
            raise TypeError(f"guided_options_request has unknown field(s) {unknown}; valid: {list(_GUIDED_OPTIONS)}")
        values = options
    else:
        values = {name: getattr(options, name, None) for name in _GUIDED_OPTIONS}
    return GuidedDecodingParams(**{_GUIDED_OPTIONS[k]: v for k, v in values.items() if v is not None})


def _with_guide(params: list[SamplingParams], guide: GuidedDecodingParams | None) -> list[SamplingParams]:
    """vLLM's rule: guided_options_request applies to every prompt, and may not meet a SamplingParams that
    has its own guided_decoding. Unlike vLLM, the caller's SamplingParams are not modified (clones are)."""
    if guide is None:
        return params
    if any(p.guided_decoding is not None for p in params):
        raise ValueError("give guided_options_request or SamplingParams.guided_decoding, not both")
    clones = [p.clone() for p in params]
    for c in clones:
        c.guided_decoding = guide
    return clones


def prompt_salts(prompts: list) -> list[str | None]:
    """Each prompt dict's cache_salt (vLLM's; None for none), checked."""
    salts = [prompt.get("cache_salt") if isinstance(prompt, dict) else None for prompt in prompts]
    for salt in salts:
        check_cache_salt(salt)
    return salts


def with_salts(params: list[SamplingParams], prompts: list) -> list[SamplingParams]:
    """Each prompt dict's cache_salt (vLLM's) on a copy of its params."""
    out = []
    for p, salt in zip(params, prompt_salts(prompts)):
        if salt is not None:
            p = p.clone()
            p.cache_salt = salt
        out.append(p)
    return out


def check_max_model_len(max_model_len: int | None, context_len: int) -> None:
    """vLLM's check: a max_model_len past the model's context (max_position_embeddings, times a linear or
    dynamic RoPE factor) is an error unless LMJAX_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN).
    LMDeploy's session_len has no such bound, so the engine itself does not check."""
    if max_model_len is None or max_model_len <= context_len or os.environ.get("LMJAX_ALLOW_LONG_MAX_MODEL_LEN") == "1":
        return
    raise ValueError(f"max_model_len={max_model_len} is longer than the model's context of {context_len} tokens "
                     "(max_position_embeddings, times the RoPE scaling factor); set LMJAX_ALLOW_LONG_MAX_MODEL_LEN=1 "
                     "to allow it, at the risk of wrong outputs past that length")


def _check_swap_space(swap) -> None:
    """Accepted but unused (_VLLM_TUNING); still a number of GiB >= 0, so a typo is not taken silently."""
    if isinstance(swap, bool) or not isinstance(swap, (int, float)) or swap < 0:
        raise ValueError(f"swap_space must be a number of GiB >= 0, got {swap!r}")


# vLLM's tasks an LLM here serves (generate; embed through LLM.embed): the pooling heads others need
# (classify, score, reward) and speech (transcription) it has not.
_SERVED_TASKS = ("auto", "generate", "embed", "embedding")


def _check_task(task) -> None:
    if task not in _SERVED_TASKS:
        raise NotImplementedError(f"LLM(task={task!r}) is not supported by lmjax: it serves {list(_SERVED_TASKS)} "
                                  "(no classification, scoring, reward or transcription heads)")


def _check_vllm_only(kwargs: dict) -> None:
    unknown = sorted(set(kwargs) - set(_VLLM_ONLY_DEFAULTS) - set(_VLLM_TUNING))
    if unknown:
        raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}")
    _check_swap_space(kwargs.get("swap_space", 4))
    backend = kwargs.get("distributed_executor_backend")
    if backend not in _EXECUTOR_BACKENDS:  # (accepted with no effect, but a typo is not taken silently)
        raise ValueError(f"distributed_executor_backend={backend!r} is not one of vLLM's {_EXECUTOR_BACKENDS}")
    _check_task(kwargs.get("task", "auto"))
    for name, value in kwargs.items():
        if name in _VLLM_TUNING and value != _VLLM_TUNING[name][0]:
            warn_no_effect("LLM", name, value, _VLLM_TUNING[name][1])
    kwargs = {k: v for k, v in kwargs.items() if k in _VLLM_ONLY_DEFAULTS
              and not (k == "trust_remote_code" and v)}  # nothing remote to run
    check_defaults_only("LLM", kwargs, _VLLM_ONLY_DEFAULTS)


# vLLM's kv_cache_dtype names a float8 cache; lmjax quantizes the cache as LMDeploy does (quant_policy):
# integer codes with a scale and zero point per token and head. "int8" / "int4" are lmjax's values.
KV_CACHE_DTYPES = {"auto": 0, "int8": 8, "int4": 4}


def kv_cache_quant_policy(kv_cache_dtype: str) -> int:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        hint = " (lmjax has no float8 cache; int8 holds as many tokens)" if "fp8" in str(kv_cache_dtype) else ""
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of {sorted(KV_CACHE_DTYPES)}{hint}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


class LLM:
    def __init__(self, model: str | None = None, tokenizer: str | None = None, tensor_parallel_size: int = 1,
                 dtype: str = "auto", seed: int = 0, gpu_memory_utilization: float = 0.9,
                 max_model_len: int | None = None, max_num_seqs: int | None = None, block_size: int = 64,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool | None = None,
                 num_gpu_blocks_override: int | None = None, num_scheduler_steps: int = 8,
                 enforce_eager: bool | None = None, kv_cache_dtype: str = "auto", max_logprobs: int = 20,
                 quantization: str | None = None, generation_config: str = "auto",
                 speculative_config: dict | None = None, **kwargs):
        _check_vllm_only(kwargs)
        _check_quantization(model, quantization)
        check_generation_config_choice(generation_config)
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if max_model_len is not None:  # from the config alone: a bad length fails before the weights load
            check_max_model_len(max_model_len, read_model_config(model).context_len)
        seqs, tokens = batch_limits(max_num_seqs, max_num_batched_tokens, batch_defaults())
        config = EngineConfig(dtype=dtype, tp=tensor_parallel_size, session_len=max_model_len,
                              max_batch_size=seqs, block_size=block_size, seed=seed,
                              gpu_memory_utilization=gpu_memory_utilization, cache_max_entry_count=1.0,
                              num_gpu_blocks=num_gpu_blocks_override or 0, max_prefill_token_num=tokens,
                              # vLLM V1's default: on (None); the LMDeploy facades keep LMDeploy's off
                              enable_prefix_caching=enable_prefix_caching is not False,
                              num_scheduler_steps=num_scheduler_steps, warmup=enforce_eager is False,
                              quant_policy=kv_cache_quant_policy(kv_cache_dtype), max_logprobs=max_logprobs,
                              speculative_config=speculative_config)
        self.llm_engine = LLMEngine(model, config, tokenizer)
        self._sampling_defaults = chosen_sampling_defaults(generation_config, self.llm_engine.sampling_defaults)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def set_tokenizer(self, tokenizer) -> None:
        """vLLM's: prompts and outputs go through `tokenizer` from now on (requests already running keep
        the one they started with)."""
        self.llm_engine.set_tokenizer(tokenizer)

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and set(prompt) - _PROMPT_KEYS:  # multi_modal_data, mm_processor_kwargs...
            raise NotImplementedError(f"prompt fields {sorted(set(prompt) - _PROMPT_KEYS)} are not supported by "
                                      "lmjax (text-only models): a prompt takes 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, encode_text(self.llm_engine.tokenizer, prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), token_ids_of(prompt["prompt_token_ids"], "prompt_token_ids")
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], encode_text(self.llm_engine.tokenizer, prompt["prompt"])
        if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):  # token ids, each checked
            return None, token_ids_of(prompt, "prompt")
        raise TypeError(f"a prompt must be a str, a list of token ids or a dict with 'prompt' or "
                        f"'prompt_token_ids', got {type(prompt).__name__}")

    def apply_model(self, func) -> list:
        """vLLM's: [func(model)] (one result a worker; lmjax's one model spans its devices). The parameter
        values func sets become the weights of every later call, and the prefix cache is dropped; the model
        is the engine's layout (merged q/k/v and gate/up; see lmjax.engine.apply_model)."""
        return [apply_model(self.llm_engine, func)]

    def reset_prefix_cache(self, device=None) -> bool:
        """Drop the prefix cache (vLLM's): False, as there, while a request still holds KV blocks (an idle
        interactive session's included)."""
        reset = self.llm_engine.blocks.reset_prefix_cache()
        if not reset:
            logger.warning("prefix cache not reset: %d KV blocks are still in use",
                           self.llm_engine.blocks.num_usable_blocks - self.llm_engine.blocks.num_free_blocks)
        return reset

    def start_profile(self, profile_dir: str | None = None) -> None:
        """Start a JAX profiler trace (TensorBoard / Perfetto readable) into `profile_dir`, else
        $LMJAX_PROFILER_DIR: vLLM's start_profile, which traces into $VLLM_TORCH_PROFILER_DIR."""
        profile_dir = profile_dir or os.environ.get("LMJAX_PROFILER_DIR")
        if not profile_dir:
            raise RuntimeError("start_profile needs a directory: start_profile(profile_dir) or LMJAX_PROFILER_DIR")
        jax.profiler.start_trace(profile_dir)

    def stop_profile(self) -> None:
        """End the trace start_profile began (work still on the device is waited for first)."""
        jax.effects_barrier()
        jax.profiler.stop_trace()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: vLLM's defaults, with the sampling
        fields the model's generation_config.json sets (generation_config="vllm": vLLM's alone)."""
        return SamplingParams(**self._sampling_defaults)

    def generate(self, prompts=None, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: list[int] | list[list[int]] | None = None, use_tqdm: bool = True,
                 lora_request=None, prompt_adapter_request=None, guided_options_request=None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Completions for `prompts` (str, token-id list, or dict, one or a list), in input order.
        guided_options_request: vLLM's older way to guide every prompt ({"guided_json": schema}, ...).
        priority: vLLM's priority scheduling, which lmjax has not (first come, first served): all 0 or None."""
        _no_lora(lora_request)
        check_defaults_only("LLM.generate", {"priority": None if priority is None or not any(priority) else priority},
                            {"priority": None})
        _no_prompt_adapter(prompt_adapter_request)
        guide = _guide_from_options(guided_options_request)  # a bad one fails before any prompt is encoded
        if prompts is None and prompt_token_ids is None:
            raise ValueError("generate() needs prompts or prompt_token_ids")
        if prompts is None:
            prompts = prompt_token_ids if prompt_token_ids and isinstance(prompt_token_ids[0], list) \
                else [prompt_token_ids]
        encoded = [self._encode(p) for p in _as_list(prompts)]
        params = per_prompt(sampling_params or self.get_default_sampling_params(), len(encoded), "sampling_params",
                            SamplingParams)
        params = with_salts(_with_guide(params, guide), _as_list(prompts))
        for p in params:
            refuse_host_rows(p)
        requests = submit_all(self.llm_engine, encoded, params)
        run_to_completion(self.llm_engine, requests, use_tqdm)
        return [request_output(r, self.llm_engine.tokenizer) for r in requests]

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (lmjax.api.beam_search says how, and where lmjax differs): for each prompt (the
        forms generate takes: str, token ids, {'prompt': ...}, {'prompt_token_ids': ...}; one or a list) a
        BeamSearchOutput whose `sequences` are the best params.beam_width beams, best first."""
        _no_lora(lora_request)
        token_ids = [ids for _, ids in (self._encode(p) for p in _as_list(prompts))]
        return run_beam_search(self.llm_engine, token_ids, params, use_tqdm, concurrency_limit,
                               salts=prompt_salts(_as_list(prompts)))

    def embed(self, prompts, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              lora_request=None) -> list[EmbeddingRequestOutput]:
        """vLLM's embeddings (lmjax.api.embed): per prompt (the forms generate takes) the final-norm hidden
        state of its last token, L2-normalized unless pooling_params.normalize is False (one PoolingParams,
        or a list of one per prompt)."""
        _no_lora(lora_request)
        encoded = [self._encode(p) for p in _as_list(prompts)]
        pooling = per_prompt(pooling_params or PoolingParams(), len(encoded), "pooling_params", PoolingParams)
        if truncate_prompt_tokens is not None:
            pooling = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in pooling]
        return embed_token_ids(self.llm_engine, encoded, pooling, use_tqdm, salts=prompt_salts(_as_list(prompts)))

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, tools: list | None = None,
             lora_request=None, chat_template_content_format: str = "auto",
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {'role', 'content'}) or a list of them.
        continue_final_message: the last (assistant) message is left open for the model to go on with;
        chat_template_kwargs: extra variables for the template (vLLM's); tools: OpenAI-style tool
        definitions the template renders into the prompt (the replies are not parsed for calls: vLLM's
        LLM.chat does not either). Each conversation is rendered once and its text tokenized as the
        template's own tokenize=True would (no special tokens added)."""
        _no_lora(lora_request)
        # content parts are joined as text ("string", what "auto" picks for a text-only model); no multi-modal input
        check_defaults_only("LLM.chat", {"chat_template_content_format": "auto" if chat_template_content_format
                                         == "string" else chat_template_content_format,
                                         "mm_processor_kwargs": mm_processor_kwargs},
                            {"chat_template_content_format": "auto", "mm_processor_kwargs": None})
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer
        # as vLLM: chat_template_kwargs may set the switches too (they update the template's arguments)
        kwargs = {"chat_template": chat_template, "add_generation_prompt": add_generation_prompt,
                  "continue_final_message": continue_final_message, **(chat_template_kwargs or {}),
                  **({"tools": tools} if tools else {})}
        texts = [render_chat(tok, c, tokenize=False, **kwargs) for c in conversations]
        prompts = [{"prompt_token_ids": tok(t, add_special_tokens=False)["input_ids"], "prompt": t} for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
