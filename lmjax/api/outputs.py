"""Result types of the two facades: vLLM's RequestOutput / CompletionOutput / Logprob and LMDeploy's
Response, all built from the engine's Request objects."""
from __future__ import annotations

import dataclasses

from lmjax.engine.request import Completion, Request


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: object | None = None  # vLLM's; always None: lmjax serves no LoRA adapters

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    # vLLM's fields after `finished`, in its positional order. metrics: vLLM V0's RequestMetrics (arrival, first
    # scheduled, first / last token, finish times: lmjax.engine.request.RequestMetrics).
    # lora_request: no LoRA adapters; encoder_prompt*: decoder-only models only.
    metrics: object | None = None
    lora_request: object | None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int = 0


def logprob_dicts(entries, tokenizer, chosen_ids, chosen_ranks):
    """vLLM's {token id: Logprob} per position: the top-k ranked by place (they are the k most likely);
    the chosen token (sampled, or the prompt's own) ranked in the whole vocabulary, as the step counted. The
    chosen token comes first, then the others from the most likely, as vLLM V1 orders them (code reads the
    sampled token's entry as `next(iter(d))`)."""
    if entries is None:
        return None
    out = []
    for entry, tid_chosen, rank_chosen in zip(entries, chosen_ids, chosen_ranks or [0] * len(entries)):
        if entry is None:
            out.append(None)
            continue
        by_logprob = sorted(entry.items(), key=lambda kv: -kv[1])
        ranked = {tid: place + 1 for place, (tid, _) in enumerate(by_logprob)}
        if rank_chosen:
            ranked[tid_chosen] = rank_chosen
        order = [kv for kv in by_logprob if kv[0] == tid_chosen] + [kv for kv in by_logprob if kv[0] != tid_chosen]
        out.append({tid: Logprob(lp, ranked[tid], tokenizer.decode([tid]) if tokenizer else None)
                    for tid, lp in order})
    return out


def _cumulative(c: Completion) -> float | None:
    """vLLM's: the sum of the sampled tokens' logprobs, None when the request asked for no logprobs."""
    return None if c.logprobs is None else c.cumulative_logprob


def completion_output(c: Completion, tokenizer=None) -> CompletionOutput:
    return CompletionOutput(c.index, c.text, list(c.token_ids), _cumulative(c),
                            logprob_dicts(c.logprobs, tokenizer, c.token_ids, c.ranks), c.finish_reason,
                            c.stop_reason)


def delta_output(r: Request, tokenizer=None, first: bool = False, finished: set | None = None) -> RequestOutput:
    """vLLM's DELTA output: the completions that moved, each with the text, token ids and logprobs new since
    its previous delta (Completion.take_delta), a finished one once (`finished`: the indices already sent
    finished, updated here); the prompt's logprobs only with the `first` one."""
    tokenizer = tokenizer if r.params.detokenize else None
    finished = set() if finished is None else finished
    outputs = []
    for c in r.completions:
        text, ids = c.take_delta()
        if not (text or ids) and (not c.finished or c.index in finished):
            continue
        if c.finished:
            finished.add(c.index)
        end = len(c.token_ids)
        logprobs = None if c.logprobs is None else logprob_dicts(
            c.logprobs[end - len(ids):end], tokenizer, ids, c.ranks[end - len(ids):end])
        outputs.append(CompletionOutput(c.index, text, ids, _cumulative(c), logprobs, c.finish_reason,
                                        c.stop_reason))
    prompt_logprobs = logprob_dicts(r.prompt_logprobs, tokenizer, r.prompt_token_ids, r.prompt_ranks) \
        if first else None
    return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, prompt_logprobs, outputs, r.finished,
                         metrics=dataclasses.replace(r.metrics), num_cached_tokens=r.num_cached_tokens)


def request_output(r: Request, tokenizer=None) -> RequestOutput:
    tokenizer = tokenizer if r.params.detokenize else None  # vLLM: no decoded_token without detokenize
    prompt_logprobs = logprob_dicts(r.prompt_logprobs, tokenizer, r.prompt_token_ids, r.prompt_ranks)
    return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, prompt_logprobs,
                         [completion_output(c, tokenizer) for c in r.completions], r.finished,
                         metrics=dataclasses.replace(r.metrics), num_cached_tokens=r.num_cached_tokens)


@dataclasses.dataclass
class Response:
    """LMDeploy's pipeline result: `index` is the prompt's position in the batch (with n > 1, completion i
    of prompt p has index p * n + i, as the OpenAI server numbers its choices; with n's that differ, the
    completions before it plus i: batch_offsets).

    The first nine fields are LMDeploy's, in its positional order (lagent builds `Response('', 0, 0, uid)`;
    as in current LMDeploy the 4th is finish_reason); session_id is lmjax's. logits / last_hidden_state:
    float32 numpy arrays [rows, vocab] / [rows, hidden] for GenerationConfig(output_logits= /
    output_last_hidden_state=) ("generation" or "all": lmjax.engine.host_outputs), on a completion's final
    Response (numpy: LMDeploy gives torch tensors); else None."""

    text: str
    generate_token_len: int
    input_token_len: int
    finish_reason: str | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    logits: object | None = None
    last_hidden_state: object | None = None
    index: int = 0
    session_id: int | None = None

    def __repr__(self) -> str:
        return (f"Response(text={self.text!r}, generate_token_len={self.generate_token_len}, "
                f"input_token_len={self.input_token_len}, finish_reason={self.finish_reason!r})")


def batch_offsets(ns: list[int]) -> list[int]:
    """Each prompt's first Response index in a batch whose prompts ask for `ns` completions: its position
    when every n is 1 (LMDeploy's), position * n with one n, and unique however the n's mix (completion i of
    prompt p is offsets[p] + i)."""
    return [sum(ns[:p]) for p in range(len(ns))]


def response(r: Request, c: Completion, session_id: int | None = None, index: int | None = None) -> Response:
    """index: the Response's `index` (LMDeploy: the prompt's position in the batch); default the completion's."""
    ids, logprobs, count, rows = lmdeploy_tokens(list(c.token_ids), c.logprobs, len(c.token_ids), host_arrays(c),
                                                 c.stop_token_id, r.params.include_stop_str_in_output)
    return Response(c.text, count, len(r.prompt_token_ids), c.finish_reason, ids, logprobs,
                    index=c.index if index is None else index, session_id=session_id, **rows)


def lmdeploy_tokens(ids: list[int], logprobs: list | None, count: int, rows: dict, stop_token_id: int | None,
                    include_stop: bool) -> tuple[list[int], list | None, int, dict]:
    """(token_ids, logprobs, generate_token_len, {logits, last_hidden_state}) as LMDeploy reports a reply's
    last output: the token that stopped it (EOS or a stop id) is not counted, and neither in token_ids and
    logprobs nor as the last row of the logits and hidden states, unless include_stop_str_in_output (vLLM
    keeps it everywhere)."""
    if stop_token_id is None:
        return ids, logprobs, count, rows
    if include_stop or not ids or ids[-1] != stop_token_id:
        return ids, logprobs, count - 1, rows
    rows = {name: None if a is None else a[:-1] for name, a in rows.items()}
    return ids[:-1], None if logprobs is None else logprobs[:-1], count - 1, rows


def host_arrays(c: Completion) -> dict:
    """A finished completion's output_logits / output_last_hidden_state rows as arrays (else None)."""
    rows = c.host_rows if c.finished else None
    return {"logits": rows and rows.stacked("logits"), "last_hidden_state": rows and rows.stacked("hidden")}
