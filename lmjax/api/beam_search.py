"""vLLM's offline beam search, `LLM(model).beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=16))`,
built the way vLLM builds it: on top of the ordinary engine, one token per step.

Data flow. Each prompt is a BeamSearchInstance holding its live `beams` (at first one: the prompt) and its
`completed` ones. A step turns every live beam of every prompt into one engine request with max_tokens=1
and logprobs=2 * beam_width (vLLM's 2x candidates, after transformers: with half of them EOS, beam_width
live ones remain), submits them all together (`submit_all`) and runs them to completion
(`run_to_completion`), so the engine schedules and batches them as any batch. Each beam's candidates are the
tokens of its returned logprobs dict (the 2 * beam_width most likely, plus the sampled token), each
`beam + [token]` with `cum_logprob + logprob`. A candidate ending in EOS (unless ignore_eos) is complete:
finish_reason "stop", stop_reason the EOS id. The other candidates of a prompt are ranked by
`get_beam_search_score` (cum_logprob / len(tokens) ** length_penalty, the prompt counted in the length, a
final EOS not) and the best beam_width stay live. After max_tokens steps the live beams end with "length";
completed + live are ranked by the same score and the best beam_width returned, best first (fewer when a
prompt had fewer candidates). Logprobs are the raw model's (vLLM V1's default, lmjax.layers.sampler).

Cost: every step re-submits each beam's whole sequence; prefix caching (LLM's default, as vLLM V1's) skips
the shared part. With LLM(enable_prefix_caching=False) the results are the same, only slower on long prompts
or many steps.

Where lmjax differs from vLLM, and why:
- Finished beams follow vLLM's *online* beam search (its OpenAI server), since vLLM's offline one leaves
  finish_reason / stop_reason None and ignores include_stop_str_in_output: an EOS-finished beam's `tokens`
  keep the EOS only with include_stop_str_in_output (its `logprobs` always hold that step), finish_reason
  "stop", stop_reason the EOS id; a beam that ran out of tokens has finish_reason "length".
- `text` is vLLM's offline one: tokenizer.decode(tokens), the prompt included, special tokens kept
  (so an EOS is in the text exactly when it is in `tokens`).
- EOS means every id the engine stops on (LLMEngine.eos_token_ids: the config's, the tokenizer's and
  generation_config.json's), not only tokenizer.eos_token_id: a Llama 3 chat model ends turns with
  <|eot_id|>, which vLLM's beam search would run past. `get_beam_search_score` takes an id or a collection.
- A beam that reaches the context (max_model_len) ends there with "length" (the prompt's step budget is
  capped up front); vLLM fails mid-search on the over-long request. A prompt that leaves no room at all,
  or whose full length needs more KV cache than exists, raises ValueError before any work.
- temperature: as in vLLM V1, the logprobs are raw, so temperature does not rescale the scores; it only
  makes the sampled token (an extra candidate, outside the top 2 * beam_width now and then) random.
- BeamSearchParams is validated on creation (beam_width, max_tokens >= 1; temperature >= 0), and
  2 * beam_width must not exceed LLM(max_logprobs=...) (20 by default, as vLLM's). structured_outputs
  (vLLM >= 0.11's guided beam search) is accepted at None only. BeamSearchSequence has no orig_prompt /
  multi-modal fields (lmjax takes token prompts only); lora_request is always None (no LoRA).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Collection, Sequence

from tqdm.auto import tqdm

from lmjax.api.batch import run_to_completion, submit_all
from lmjax.api.outputs import Logprob, request_output
from lmjax.config import SamplingParams
from lmjax.validation import check, strict_fields


@strict_fields
@dataclasses.dataclass
class BeamSearchParams:
    """vLLM's beam search parameters, its names and defaults (vllm.sampling_params.BeamSearchParams)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: object | None = None  # vLLM >= 0.11's; lmjax: None only

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  f"{name} must be an int >= 1, got {value!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                  f"{name} must be a finite number, got {value!r}")
        check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        # a beam's score divides by len ** length_penalty: past +-50 that leaves float64 for real lengths
        check(abs(self.length_penalty) <= 50, f"length_penalty must be in [-50, 50], got {self.length_penalty}")
        if self.structured_outputs is not None:
            raise NotImplementedError(f"BeamSearchParams(structured_outputs={self.structured_outputs!r}) is not "
                                      "supported by lmjax (no guided beam search)")


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's and the generated ids; `logprobs` one {token id: Logprob} per
    generated step (all of that step's candidates); `text` is filled only on the returned beams."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: object | None = None  # vLLM's; always None here
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """One prompt's result: up to beam_width sequences, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """One prompt's search state: its live `beams`, its `completed` ones, and `max_tokens`, the steps it may
    take (BeamSearchParams.max_tokens capped by the context: lmjax's addition)."""

    def __init__(self, prompt_token_ids: list[int], max_tokens: int, lora_request=None,
                 logprobs: list[dict[int, Logprob]] | None = None):
        self.beams = [BeamSearchSequence(list(prompt_token_ids), list(logprobs or []), lora_request)]
        self.completed: list[BeamSearchSequence] = []
        self.max_tokens = max_tokens


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | Collection[int] | None,
                          length_penalty: float = 1.0) -> float:
    """cumulative_logprob / seq_len ** length_penalty, seq_len counting the prompt and not a final EOS
    (vLLM's, after transformers' BeamHypotheses). length_penalty > 0 favours longer sequences (their
    negative sum is divided more), 0 ranks by the sum alone."""
    eos_ids = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos_ids else 0)
    return cumulative_logprob / (seq_len ** length_penalty)


def create_sort_beams_key_function(eos_token_id: int | Collection[int] | None, length_penalty: float):
    def sort_beams_key(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, length_penalty)

    return sort_beams_key


def step_sampling_params(engine, params: BeamSearchParams) -> SamplingParams:
    """What each beam's one-token request asks of the engine: 2 * beam_width candidates (a ValueError naming
    beam_width when that is more than the engine returns)."""
    vocab, most = engine.model_config.vocab_size, engine.config.max_logprobs
    cap = vocab if most == -1 else min(most, vocab)
    check(2 * params.beam_width <= cap,
          f"beam_width={params.beam_width} needs {2 * params.beam_width} candidates a step, more than "
          f"max_logprobs={cap} (LLM(max_logprobs=...); -1 allows up to the vocabulary, {vocab})")
    return SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature)


def new_instances(engine, prompts: Sequence[list[int]], params: BeamSearchParams, step_params: SamplingParams,
                  salts: Sequence[str | None] | None = None) -> list[BeamSearchInstance]:
    """Every prompt checked before any work: the engine's own request checks on the prompt grown by
    max_tokens (empty, ids outside the vocabulary, no room in the context, more KV cache than exists),
    which also give each prompt's step budget (max_tokens capped by the context). Each instance's beams
    step with `step_params` and the prompt's prefix-cache salt (vLLM's cache_salt), if any."""
    whole = dataclasses.replace(step_params, max_tokens=params.max_tokens)
    instances = [BeamSearchInstance(ids, engine.validate_request(ids, whole)) for ids in prompts]
    for inst, salt in zip(instances, salts or [None] * len(instances)):
        inst.step_params = step_params if salt is None else dataclasses.replace(step_params, cache_salt=salt)
    return instances


def _child(beam: BeamSearchSequence, token_id: int, entry: dict[int, Logprob]) -> BeamSearchSequence:
    return BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [entry], beam.lora_request,
                              beam.cum_logprob + entry[token_id].logprob)


def _expand(instance: BeamSearchInstance, entries: list[dict[int, Logprob]], params: BeamSearchParams,
            eos_ids: set[int], sort_key) -> None:
    """One prompt's step: every candidate of every beam (entries[i]: beam i's logprobs dict); EOS ones go to
    `completed`, the best beam_width of the others become the live beams."""
    candidates = []
    for beam, entry in zip(instance.beams, entries):
        for token_id in entry:
            child = _child(beam, token_id, entry)
            if token_id in eos_ids and not params.ignore_eos:
                if not params.include_stop_str_in_output:
                    child.tokens.pop()  # the EOS leaves tokens (and so the text); its logprob stays counted
                child.finish_reason, child.stop_reason = "stop", token_id
                instance.completed.append(child)
            else:
                candidates.append(child)
    instance.beams = sorted(candidates, key=sort_key, reverse=True)[:params.beam_width]


def run_step(engine, instances: list[BeamSearchInstance], params: BeamSearchParams, eos_ids: set[int],
             sort_key) -> None:
    """Every live beam of `instances` as one batch of one-token requests, then each prompt's expansion."""
    beams = [beam for inst in instances for beam in inst.beams]
    requests = submit_all(engine, [(None, beam.tokens) for beam in beams],
                          [inst.step_params for inst in instances for _ in inst.beams])
    run_to_completion(engine, requests)
    entries = []
    for req in requests:
        completion = request_output(req, engine.tokenizer).outputs[0]
        if not completion.logprobs:
            raise RuntimeError(f"beam search step of a {len(req.prompt_token_ids)}-token beam ended "
                               f"{completion.finish_reason!r} without a token: {req.error or 'no error given'}")
        entries.append(completion.logprobs[0])
    ends = itertools.accumulate(len(inst.beams) for inst in instances)  # before _expand replaces the beams
    for inst, end in zip(instances, list(ends)):
        _expand(inst, entries[end - len(inst.beams):end], params, eos_ids, sort_key)


def _best(instance: BeamSearchInstance, params: BeamSearchParams, tokenizer, sort_key) -> BeamSearchOutput:
    for beam in instance.beams:
        beam.finish_reason = "length"
    best = sorted(instance.completed + instance.beams, key=sort_key, reverse=True)[:params.beam_width]
    for beam in best:
        beam.text = tokenizer.decode(beam.tokens)
    return BeamSearchOutput(best)


def beam_search(engine, prompts: Sequence[list[int]], params: BeamSearchParams, use_tqdm: bool = False,
                concurrency_limit: int | None = None, salts: Sequence[str | None] | None = None
                ) -> list[BeamSearchOutput]:
    """Beam search for each prompt (token ids) on `engine` (an LLMEngine); one BeamSearchOutput per prompt,
    in input order. concurrency_limit (vLLM's): at most that many prompts searched at a time. salts: each
    prompt's prefix-cache salt (None: none)."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    check(concurrency_limit is None or (isinstance(concurrency_limit, int) and concurrency_limit >= 1),
          f"concurrency_limit must be None or an int >= 1, got {concurrency_limit!r}")
    step_params = step_sampling_params(engine, params)
    instances = new_instances(engine, prompts, params, step_params, salts)
    eos_ids = set(engine.eos_token_ids)
    sort_key = create_sort_beams_key_function(eos_ids, params.length_penalty)
    limit = concurrency_limit or max(len(instances), 1)
    for start in range(0, len(instances), limit):
        group = instances[start:start + limit]
        for step in tqdm(range(params.max_tokens), desc="Beam search", unit="token", disable=not use_tqdm):
            live = [inst for inst in group if inst.beams and step < inst.max_tokens]
            if not live:
                break
            run_step(engine, live, params, eos_ids, sort_key)
    return [_best(inst, params, engine.tokenizer, sort_key) for inst in instances]
