"""LMDeploy's API: `pipe = pipeline(model_path, backend_config=..., chat_template_config=...)`, then
`pipe(prompts, gen_config=GenerationConfig(...))` (also `infer` / `batch_infer`), `pipe.stream_infer(...)`,
`pipe.chat(...)`, `pipe.get_ppl(input_ids)`, and `with pipeline(...) as pipe:` / `pipe.close()`.

Prompts are a str, a list of str, one OpenAI-style message list, or a list of them. With
`do_preprocess=True` (the default) each goes through the chat template, as in LMDeploy.
A str in gives a Response out; a list gives a list (n > 1: the n completions of each prompt in a row).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator

import numpy as np

from lmjax.api.batch import run_to_completion, submit_all, token_id_lists
from lmjax.api.lmdeploy_params import check_keywords, lmdeploy_batch, lmdeploy_sampling_params
from lmjax.api.outputs import Response, batch_offsets, response
from lmjax.config import ChatTemplateConfig, EngineConfig, SamplingParams
from lmjax.engine.apply_model import apply_model, engine_model
from lmjax.engine.engine import LLMEngine
from lmjax.engine.request import check_prompt
from lmjax.lmdeploy_config import PytorchEngineConfig, TurbomindEngineConfig
from lmjax.loader.awq import require_awq
from lmjax.loader.resolve import resolve_model_path
from lmjax.models.forward import prompt_logits
from lmjax.validation import check

def check_adapter(adapter_name) -> None:
    """LMDeploy's per-call LoRA adapter: lmjax serves no adapters."""
    if adapter_name is not None:
        raise NotImplementedError(f"adapter_name={adapter_name!r}: lmjax serves no LoRA adapters")


def _engine_config(backend_config, tp: int | None) -> EngineConfig:
    if backend_config is None:
        config = EngineConfig(seed=None)  # (LMDeploy's unseeded requests: a random seed each)
    elif isinstance(backend_config, EngineConfig):
        config = backend_config
    elif isinstance(backend_config, (TurbomindEngineConfig, PytorchEngineConfig)):
        config = backend_config.to_engine_config()
    else:
        raise TypeError(f"backend_config must be TurbomindEngineConfig, PytorchEngineConfig or EngineConfig, "
                        f"got {type(backend_config).__name__}")
    if tp is not None and tp != config.tp:
        config = dataclasses.replace(config, tp=tp)
    return config


@dataclasses.dataclass
class Session:
    """A multi-turn chat kept by `Pipeline.chat`: the message history and the last response. As LMDeploy's
    Session (`pipe.session()`), calling it runs the next turn (`sess("Hi")` is `pipe.chat("Hi", session=sess)`)
    and `close()` (or leaving a `with` block) forgets the history. It holds no KV cache of its own: each turn
    renders the whole conversation, and prefix caching reuses the earlier turns' blocks."""

    session_id: int
    messages: list[dict] = dataclasses.field(default_factory=list)
    response: Response | None = None
    pipeline: "Pipeline | None" = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def history(self) -> list[tuple[str, str]]:
        turns = [m["content"] for m in self.messages if m["role"] in ("user", "assistant")]
        return list(zip(turns[::2], turns[1::2]))

    def __call__(self, prompt: str, gen_config=None, stream_response: bool = False, **legacy):
        if self.pipeline is None:
            raise ValueError("this Session belongs to no pipeline: take one from pipe.session()")
        return self.pipeline.chat(prompt, self, gen_config, stream_response, **legacy)

    def close(self) -> None:
        self.messages, self.response = [], None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Pipeline:
    def __init__(self, model_path: str | None, backend_config=None, chat_template_config=None,
                 log_level: str = "ERROR", tp: int | None = None, model_name: str | None = None,
                 backend: str | None = None, instance_num: int | None = None):
        """`instance_num`: LMDeploy's count of TurboMind instances, accepted and unused (one engine
        serves every request, as AsyncEngine)."""
        logging.getLogger("lmjax").setLevel(log_level)
        if backend not in (None, "turbomind", "pytorch"):
            raise ValueError(f"backend must be 'turbomind' or 'pytorch', got {backend!r}")
        if getattr(backend_config, "model_format", None) == "awq":
            require_awq(resolve_model_path(model_path), "TurbomindEngineConfig(model_format='awq')")
        self.engine = LLMEngine(model_path, _engine_config(backend_config, tp))
        self.chat_template = chat_template_config or ChatTemplateConfig(model_name=model_name)
        self.tokenizer = self.engine.tokenizer
        self._session_ids = iter(range(1, 1 << 62))
        self._async_engine = None  # LMDeploy's AsyncEngine methods, on an engine thread from their first use

    def _submit(self, prompts, gen_config, do_preprocess, legacy, template=None):
        single, encoded, params = lmdeploy_batch(prompts, gen_config, legacy, do_preprocess,
                                                 template or self.chat_template, self.tokenizer,
                                                 self.engine.eos_token_ids)
        # a prompt over session_len gives an empty "length" Response (LMDeploy's), not an error for the batch
        return single, submit_all(self.engine, encoded, params, overflow_as_length=True)

    def __call__(self, prompts, gen_config=None, do_preprocess: bool = True, use_tqdm: bool = False,
                 chat_template_config: ChatTemplateConfig | None = None, adapter_name: str | None = None,
                 **legacy) -> Response | list[Response]:
        """`chat_template_config`: this call's template instead of the pipeline's."""
        check_keywords(legacy)
        check_adapter(adapter_name)

        def run(stop):
            single, requests = self._submit(prompts, gen_config, do_preprocess, legacy, chat_template_config)
            run_to_completion(self.engine, requests, use_tqdm, stop)
            offsets = batch_offsets([r.params.n for r in requests])
            out = [response(r, c, index=offsets[p] + c.index) for p, r in enumerate(requests) for c in r.completions]
            return out[0] if single and len(out) == 1 else out
        return self._exclusive(run)

    batch_infer = __call__
    infer = __call__  # LMDeploy >= 0.7's name (batch_infer its older one)

    def stream_infer(self, prompts, gen_config=None, do_preprocess: bool = True,
                     chat_template_config: ChatTemplateConfig | None = None, adapter_name: str | None = None,
                     **legacy) -> Iterator[Response]:
        """Yield Responses carrying the new text of one prompt (`index`) as it is generated (on the engine
        thread, as every call: a stream left suspended meanwhile keeps all of its output)."""
        check_keywords(legacy)
        check_adapter(adapter_name)
        yield from self._async().stream_infer(prompts, gen_config, do_preprocess, chat_template_config, **legacy)

    def chat(self, prompt: str, session: Session | None = None, gen_config=None, stream_response: bool = False,
             **legacy) -> Session | Iterator[Response]:
        """One turn of a multi-turn chat; pass the session back for the next turn. Returns the session, or
        with `stream_response` (as LMDeploy) an iterator of the reply's pieces, which records the turn in
        `session` (give one, or take `pipe.session()`) once it is read to the end."""
        check_adapter(legacy.pop("adapter_name", None))
        do_preprocess = legacy.pop("do_preprocess", True)
        check_keywords(legacy)
        if not do_preprocess:
            raise ValueError("chat(do_preprocess=False) is not supported: a chat turn is the chat template's "
                             "rendering of the session (give the raw text to pipe(..., do_preprocess=False))")
        # built once: the turn's calls take a SamplingParams as it is (the stop words are in it already)
        params = lmdeploy_sampling_params(gen_config, legacy, self.chat_template, self.tokenizer,
                                          self.engine.eos_token_ids)
        check(params.n == 1, f"chat takes n=1 (one reply a turn, as LMDeploy's), got n={params.n}")
        session = session or self.session()
        turn = {"role": "user", "content": prompt}  # history only once the turn completes (LMDeploy)
        if stream_response:
            return self._chat_stream(session, turn, params)
        self._record(session, turn, self(session.messages + [turn], gen_config=params))
        return session

    def _chat_stream(self, session: Session, turn: dict, params: SamplingParams) -> Iterator[Response]:
        pieces = []
        for piece in self.stream_infer([session.messages + [turn]], params):
            pieces.append(piece)
            yield piece
        logprobs = None if pieces[-1].logprobs is None else [e for p in pieces for e in p.logprobs or ()]
        self._record(session, turn, Response("".join(p.text for p in pieces), pieces[-1].generate_token_len,
                                             pieces[-1].input_token_len, pieces[-1].finish_reason,
                                             [t for p in pieces for t in p.token_ids], logprobs))

    @staticmethod
    def _record(session: Session, turn: dict, resp: Response) -> None:
        session.response = dataclasses.replace(resp, session_id=session.session_id)
        session.messages += [turn, {"role": "assistant", "content": resp.text}]

    def session(self) -> Session:
        """A new chat session for `chat`."""
        return Session(next(self._session_ids), pipeline=self)

    def get_ppl(self, input_ids: list[int] | list[list[int]]) -> list[float]:
        """LMDeploy's get_ppl: per sequence of token ids, the mean cross-entropy (nats) of each token
        given the ones before it (exp of it is the perplexity), from the engine's logprobs: the prompt's for
        all but the last token, which is the one sampled token (forced by allowed_token_ids; logprobs are the
        raw model's), so a sequence of session_len tokens fits as get_logits' does."""
        batch = token_id_lists(input_ids, "input_ids")
        for i, ids in enumerate(batch):
            if len(ids) < 2:
                raise ValueError(f"get_ppl needs at least 2 tokens a sequence; input_ids[{i}] has {len(ids)}")
        scored = [SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, logprobs=0,
                                 allowed_token_ids=[ids[-1]]) for ids in batch]

        def run(stop):
            requests = submit_all(self.engine, [(None, list(ids[:-1])) for ids in batch], scored)
            return run_to_completion(self.engine, requests, stop=stop)

        def nll(r, ids) -> float:
            logprobs = [e[t] for t, e in zip(ids[1:-1], r.prompt_logprobs[1:])] + [r.completions[0].logprobs[0][ids[-1]]]
            return -sum(logprobs) / (len(ids) - 1)
        return [nll(r, ids) for r, ids in zip(self._exclusive(run), batch)]

    def get_logits(self, input_ids: list[int] | list[list[int]]) -> list[np.ndarray]:
        """LMDeploy's get_logits: per sequence of token ids, float32 logits [len, vocab] at every position
        (numpy arrays; LMDeploy's are torch tensors), from one forward of the engine's model through a KV
        cache of the engine's quant_policy, outside its cache (lmjax.models.forward.prompt_logits)."""
        batch = token_id_lists(input_ids, "input_ids")
        for ids in batch:
            check_prompt(ids, self.engine.model_config.vocab_size, self.engine.session_len + 1)
        runner = self.engine.runner
        if runner.leading:  # its forward is not a step the followers are sent: they would never join it
            raise NotImplementedError("get_logits is not supported by a multi-process engine led by one process; "
                                      "run the same program in every process (each calls get_logits) instead")
        return prompt_logits(engine_model(runner), [list(ids) for ids in batch],
                             quant_policy=self.engine.config.quant_policy, kv_maps=self.engine.kv_maps)

    def apply_model(self, func) -> list:
        """vLLM's LLM.apply_model (an lmjax extension here): [func(model)] on the engine's model, whose
        parameter values it sets become the weights every later call uses (lmjax.engine.apply_model)."""
        return self._exclusive(lambda stop: [apply_model(self.engine, func)])

    # ------------------------------------------------------------------ LMDeploy's pipeline is an AsyncEngine
    @property
    def session_len(self) -> int:
        return self.engine.session_len

    def _async(self):
        """The AsyncEngine view (lmjax.api.async_engine) behind `generate` and the session methods; its
        thread starts on their first use, and from then on every method steps the engine through it."""
        if self._async_engine is None:
            from lmjax.api.async_engine import AsyncEngine  # it imports this module

            self._async_engine = AsyncEngine.over(self.engine, self.chat_template)
        return self._async_engine

    def generate(self, *args, **kwargs):
        """AsyncEngine.generate: an async generator of GenOuts for one session turn."""
        return self._async().generate(*args, **kwargs)

    def stop_session(self, session_id: int):
        return self._async().stop_session(session_id)

    def end_session(self, session_id: int):
        return self._async().end_session(session_id)

    def get_generator(self, stop: bool, session_id: int):
        return self._async().get_generator(stop, session_id)

    @property
    def id2step(self) -> dict:
        return self._async().id2step

    def _exclusive(self, run):
        """run(stop) (it steps the engine to its end) on the engine thread, started on first use: one owner
        steps the engine, so calls from several threads, suspended streams and async callers never step it
        at once (async callers' requests wait meanwhile, and get their outputs after). Ctrl-C while waiting
        sets `stop`: the batch is aborted at its next step."""
        stop = threading.Event()
        future = self._async()._thread.call_stepping(lambda: run(stop))
        try:
            return future.result()
        except KeyboardInterrupt:
            stop.set()
            raise

    def close(self) -> None:
        """Abort whatever is still running and stop the engine thread, if one started (LMDeploy frees its
        engine here; lmjax's goes with the object). A second close does nothing."""
        if self._async_engine is not None:
            self._async_engine.close()  # aborts what runs, fails what was queued

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pipeline(model_path: str | None = None, backend_config=None, chat_template_config=None,
             log_level: str = "ERROR", **kwargs) -> Pipeline:
    """Build an LMDeploy-style pipeline over lmjax's engine."""
    return Pipeline(model_path, backend_config, chat_template_config, log_level, **kwargs)
