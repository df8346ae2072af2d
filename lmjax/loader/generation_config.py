"""A checkpoint's generation_config.json: the end-of-turn ids and the sampling defaults its authors chose.

Llama-3-Instruct, for one, names `<|eot_id|>` only there (config.json has `<|end_of_text|>`), so a chat
reply would run on past its turn without it. LMDeploy and vLLM both stop on these ids; vLLM also takes
the sampling fields below as its defaults (`LLM.get_default_sampling_params`, and the server's values for
fields a request leaves out). transformers parses the file (`GenerationConfig`); only the values it holds
away from transformers' own defaults count, as in vLLM.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("lmjax.loader")

# generation_config field -> SamplingParams field (the set vLLM reads)
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(path: str) -> dict:
    """The fields generation_config.json in the checkpoint directory `path` sets ({} when there is none,
    e.g. for a GGUF file)."""
    if not os.path.isfile(os.path.join(path, "generation_config.json")):
        return {}
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path).to_diff_dict()
    except (OSError, ValueError) as e:  # as vLLM: a file transformers rejects means no defaults, not no model
        logger.warning("ignoring %s/generation_config.json: %s", path, e)
        return {}


def generation_eos_ids(generation_config: dict) -> set[int]:
    eos = generation_config.get("eos_token_id")
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else {int(i) for i in eos}


def sampling_defaults(generation_config: dict) -> dict:
    """{SamplingParams field: value} for the sampling fields the file sets."""
    return {ours: generation_config[theirs] for theirs, ours in SAMPLING_FIELDS.items()
            if generation_config.get(theirs) is not None}


def check_generation_config_choice(choice: str, what: str = "generation_config") -> None:
    """vLLM's generation_config argument: 'auto', 'vllm' or a directory (a ValueError naming it, before
    anything loads)."""
    if choice not in ("auto", "vllm") and not os.path.isdir(choice):
        raise ValueError(f"{what}={choice!r} must be 'auto', 'vllm' or a directory holding a generation_config.json")


def chosen_sampling_defaults(choice: str, model_defaults: dict) -> dict:
    """The sampling defaults vLLM's generation_config argument picks: 'auto' the model's (`model_defaults`),
    'vllm' none (vLLM's own), or those of the generation_config.json in that directory."""
    if choice == "auto":
        defaults = model_defaults
    elif choice == "vllm":
        defaults = {}
    else:
        defaults = sampling_defaults(read_generation_config(choice))
    if defaults:
        logger.info("default sampling parameters from the generation config: %s", defaults)
    return defaults
