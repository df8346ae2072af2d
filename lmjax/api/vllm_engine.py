"""vLLM's engine-level API, for code that drives generation step by step:

    engine = LLMEngine.from_engine_args(EngineArgs(model="SmolLM2-135M-Instruct", max_model_len=2048))
    engine.add_request("0", "The capital of France is", SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.request_id, out.outputs[0].text, out.finished)

A thin layer over lmjax's own engine (lmjax.engine.engine.LLMEngine, `llm.llm_engine`, whose add_request takes
token ids): prompts take the forms `LLM.generate` takes, the engine arguments are `LLM`'s, and `step()`
returns one RequestOutput per request that changed, shaped by its `SamplingParams.output_kind`
(vLLM's RequestOutputKind): CUMULATIVE (the default) everything so far, DELTA the text, token ids and
logprobs new since the request's last output, FINAL_ONLY one output when it finishes. A request that fails
in the engine (a logits processor raising, a prompt that never fits the cache) finishes with finish reason
"error". Not vLLM's: no LoRA, no priorities, no tracing headers (their defaults only), and pooling
requests go through `LLM.embed`.
"""
from __future__ import annotations

from collections.abc import Iterable

from lmjax.api.llm import LLM, refuse_host_rows, with_salts
from lmjax.api.outputs import RequestOutput, delta_output, request_output
from lmjax.config import RequestOutputKind, SamplingParams, check_defaults_only
from lmjax.engine.request import Request


class EngineArgs:
    """vLLM's EngineArgs: the model and `LLM`'s keyword arguments (checked when the engine is built)."""

    def __init__(self, model: str, **kwargs):
        self.model, self.kwargs = model, kwargs

    def __repr__(self) -> str:
        return f"EngineArgs(model={self.model!r}, {', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"


class LLMEngine:
    def __init__(self, llm: LLM):
        self.llm = llm
        self.engine = llm.llm_engine
        self._live: dict[str, Request] = {}
        self._delta_sent: dict[str, set] = {}  # DELTA requests that had a first output: completions sent finished

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(LLM(engine_args.model, **engine_args.kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def add_request(self, request_id: str, prompt, params: SamplingParams, arrival_time: float | None = None,
                    lora_request=None, priority: int = 0, trace_headers=None) -> None:
        """Queue a request (checked first: a bad one raises, naming the value, and queues nothing)."""
        check_defaults_only("LLMEngine.add_request", {"lora_request": lora_request, "priority": priority,
                                                      "trace_headers": trace_headers},
                            {"lora_request": None, "priority": 0, "trace_headers": None})
        if not isinstance(request_id, str):  # (vLLM's: an int id could never be aborted by that int)
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams (embeddings: LLM.embed), got {type(params).__name__}")
        refuse_host_rows(params)
        text, ids = self.llm._encode(prompt)
        params = with_salts([params], [prompt])[0]
        req = self.engine.add_request(ids, params, prompt=text, request_id=request_id)
        if arrival_time is not None:
            req.metrics.arrival_time = arrival_time
        self._live[req.request_id] = req

    def step(self) -> list[RequestOutput]:
        """One engine step (a multi-step decode call's worth of tokens); the outputs of the requests it changed."""
        outs = []
        changed = {id(req): req for req in self.engine.step()}
        # and those another caller's step finished (LLM.generate on the same engine): their final output now
        changed.update({id(req): req for req in self._live.values() if req.finished})
        for req in changed.values():
            if self._live.get(req.request_id) is not req:
                continue
            kind = req.params.output_kind
            if kind is RequestOutputKind.DELTA:
                first = req.request_id not in self._delta_sent
                outs.append(delta_output(req, self.engine.tokenizer, first,
                                         self._delta_sent.setdefault(req.request_id, set())))
            elif kind is RequestOutputKind.CUMULATIVE or req.finished:
                outs.append(request_output(req, self.engine.tokenizer))
            if req.finished:
                del self._live[req.request_id]
                self._delta_sent.pop(req.request_id, None)
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def get_num_unfinished_requests(self) -> int:
        return len(self._live)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Cancel requests (unknown or finished ids are ignored, as vLLM does)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id) \
            if isinstance(request_id, Iterable) else [request_id]
        if not all(isinstance(rid, str) for rid in ids):
            raise TypeError(f"request ids are str, got {request_id!r}")
        for rid in ids:
            if self._live.pop(rid, None) is not None:
                self._delta_sent.pop(rid, None)
                self.engine.abort(rid)
