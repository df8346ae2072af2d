"""What LMDeploy's facades (pipeline, AsyncEngine) make of a call's sampling settings: a GenerationConfig (or a
vLLM SamplingParams) plus keyword arguments, and the chat template's stop words -> the engine's SamplingParams.

Keywords: LMDeploy's old argument names (`request_output_len`, `top_k`, ...) and GenerationConfig's own field
names override the gen_config. LMDeploy's `generate(..., **kwargs)` reads none of them, and lagent's
AsyncLMDeployPipeline forwards its per-call overrides (`max_new_tokens=...`) there as well as into its
gen_config: honouring them keeps such code working and never drops a setting the caller wrote. Other names
are a TypeError (lmjax ignores no argument silently).

Stop words: LMDeploy turns each into token ids and stops on those; the token that stopped a reply is then left
out of its token_ids and generate_token_len (lmjax.api.outputs.lmdeploy_tokens). lmjax does so for a word that
is one token of the vocabulary: a special token (InternLM2's `<|action_end|>`, which adds no text when
skip_special_tokens is on, so the text alone would never see it) or a plain one ("Paris" when that is a token).
Every word is also matched on the output text (vLLM's stop strings), so a word of several tokens stops too (LMDeploy
warns and ignores it), as does a word inside a longer token (LMDeploy takes up to five tokens that contain the
word as stop ids; lmjax stops on such a token by its text, and keeps it in token_ids)."""
from __future__ import annotations

import dataclasses

from lmjax.api.batch import check_kind, encode_chat, encode_text, per_prompt
from lmjax.config import ChatTemplateConfig, GenerationConfig, SamplingParams

LEGACY_ARGS = {"request_output_len": "max_new_tokens", "top_k": "top_k", "top_p": "top_p",
               "temperature": "temperature", "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos"}
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(GenerationConfig)}
# The legacy arguments' own defaults (LMDeploy's call table: request_output_len 512, top_k 40, top_p 0.8,
# temperature 0.8): a call that passes some of them and no gen_config samples with these, as LMDeploy built
# its GenerationConfig from them. A call with neither gets GenerationConfig()'s (greedy), as LMDeploy now does.
_LEGACY_DEFAULTS = GenerationConfig(max_new_tokens=512, top_k=40, top_p=0.8, temperature=0.8)
GEN_CONFIG_KINDS = (GenerationConfig, SamplingParams, type(None))  # what the LMDeploy facades take as gen_config


def check_keywords(kwargs: dict) -> None:
    unknown = set(kwargs) - set(LEGACY_ARGS) - _CONFIG_FIELDS
    if unknown:
        raise TypeError(f"unexpected arguments {sorted(unknown)}: sampling keywords are LMDeploy's old names "
                        f"{sorted(LEGACY_ARGS)} or GenerationConfig's fields")


def with_legacy(gen_config: GenerationConfig | None, kwargs: dict) -> GenerationConfig:
    """gen_config (or the defaults above) with the keyword settings that are not None."""
    overrides = {LEGACY_ARGS.get(k, k): v for k, v in kwargs.items() if v is not None}
    legacy = any(k in LEGACY_ARGS for k, v in kwargs.items() if v is not None)  # (some are fields' names too)
    base = gen_config if gen_config is not None else _LEGACY_DEFAULTS if legacy else GenerationConfig()
    return dataclasses.replace(base, **overrides) if overrides else base


def lmdeploy_sampling_params(gen_config, kwargs: dict, template: ChatTemplateConfig, tokenizer,
                             eos_ids=()) -> SamplingParams:
    """The engine's SamplingParams of one prompt (a SamplingParams gen_config is taken as it is, keywords
    refused with it), with the template's stop words added; `eos_ids`: the engine's."""
    check_kind(gen_config, GEN_CONFIG_KINDS, "gen_config")
    if isinstance(gen_config, SamplingParams):
        given = sorted(k for k, v in kwargs.items() if v is not None)
        if given:
            raise TypeError(f"{given} cannot be combined with a SamplingParams gen_config")
        params, words = dataclasses.replace(gen_config), []
    else:
        check_keywords(kwargs)
        config = with_legacy(gen_config, kwargs)
        params, words = config.to_sampling_params(), list(config.stop_words or [])
    words += [w for w in template.stop_words or [] if w not in words]
    if words:
        params.stop = list(params.stop or []) + [w for w in words if w not in (params.stop or [])]
        # EOS ids stay out: they stop anyway, and ignore_eos must still be able to pass them
        known = set(params.stop_token_ids or []) | set(eos_ids)
        ids = [i for i in stop_word_ids(tokenizer, words) if i not in known]
        if ids:
            params.stop_token_ids = list(params.stop_token_ids or []) + ids
    return params


def lmdeploy_batch(prompts, gen_config, legacy: dict, do_preprocess: bool, template: ChatTemplateConfig, tokenizer,
                   eos_ids=()) -> tuple[bool, list[tuple[str, list[int]]], list[SamplingParams]]:
    """(one prompt?, [(text, ids)] of each prompt's first turn, [SamplingParams] of each) of a call of LMDeploy's
    facades (pipeline, AsyncEngine): `gen_config` one for all or one per prompt. Settings are checked before
    any prompt is tokenized."""
    single, batch = lmdeploy_prompts(prompts)
    configs = per_prompt(gen_config, len(batch), "gen_config", GEN_CONFIG_KINDS)
    params = [lmdeploy_sampling_params(g, legacy, template, tokenizer, eos_ids) for g in configs]
    return single, [encode_first_turn(tokenizer, p, do_preprocess, template) for p in batch], params


def encode_first_turn(tokenizer, prompt, do_preprocess: bool, template: ChatTemplateConfig) -> tuple[str, list[int]]:
    """(text, ids) of a prompt that starts a sequence: the chat template's rendering, or with do_preprocess=False
    the str itself (BOS added as the tokenizer does)."""
    if do_preprocess:
        return encode_chat(tokenizer, prompt, template)
    if not isinstance(prompt, str):
        raise TypeError(f"with do_preprocess=False a prompt must be a str, got {type(prompt).__name__}")
    return prompt, encode_text(tokenizer, prompt)


def stop_word_ids(tokenizer, words: list[str]) -> list[int]:
    """The ids of the `words` that are one token of `tokenizer`: special tokens, and plain words that encode
    to a single token that decodes back to the word."""
    special = _special_tokens(tokenizer)
    ids = [special[w] if w in special else _one_token(tokenizer, w) for w in words]
    return [i for i in ids if i is not None]


def _one_token(tokenizer, word: str) -> int | None:
    ids = tokenizer.encode(word, add_special_tokens=False)
    return ids[0] if len(ids) == 1 and tokenizer.decode(ids) == word else None


def special_token_ids(tokenizer, words: list[str]) -> list[int]:
    """The ids of the `words` that are special tokens of `tokenizer`."""
    special = _special_tokens(tokenizer)
    return [special[w] for w in words if w in special]


def _special_tokens(tokenizer) -> dict[str, int]:
    """{text: id} of the tokenizer's special tokens (added tokens marked special, and its named ones)."""
    special = {tok.content: i for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
               if getattr(tok, "special", False)}
    special.update({t: tokenizer.convert_tokens_to_ids(t) for t in getattr(tokenizer, "all_special_tokens", ())
                    if t not in special})
    return special


def lmdeploy_prompts(prompts) -> tuple[bool, list]:
    """(one prompt?, the batch) of what LMDeploy's pipeline takes: a str, an OpenAI messages list, or a list of
    these. A tuple is LMDeploy's vision-language prompt, (text, image or images): refused, as anything else,
    naming the value (lmjax reads text only; LMDeploy's text pipelines take a list for a batch)."""
    single = isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], dict))
    batch = [prompts] if single else prompts
    if not isinstance(batch, list):
        _refuse_prompt("prompts", prompts)
    for i, p in enumerate(batch):
        if not (isinstance(p, str) or (isinstance(p, list) and all(isinstance(m, dict) for m in p))):
            _refuse_prompt(f"prompts[{i}]", p)
    return single, batch


def _refuse_prompt(name: str, value) -> None:
    if isinstance(value, tuple):
        raise TypeError(f"{name} is a tuple {value!r:.80}: LMDeploy's (text, image) prompt of a vision-language "
                        "model; lmjax reads text only (a batch of prompts is a list)")
    raise TypeError(f"{name} must be a str or an OpenAI messages list (or a list of them), got "
                    f"{type(value).__name__} {value!r:.80}")
