"""LMDeploy's API: `pipe = pipeline(model_path, backend_config=..., chat_template_config=...)`, then
`pipe(prompts, gen_config=GenerationConfig(...))`, `pipe.stream_infer(...)` and `pipe.chat(...)`.

Prompts are a str, a list of str, one OpenAI-style message list, or a list of them. With
`do_preprocess=True` (the default) each goes through the chat template, as in LMDeploy.
A str in gives a Response out; a list gives a list (n > 1: the n completions of each prompt in a row).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

from lmjax.api.batch import encode_chat, encode_text, per_prompt, run_to_completion, stream_steps, submit_all
from lmjax.api.outputs import Response, response
from lmjax.config import ChatTemplateConfig, EngineConfig, GenerationConfig
from lmjax.engine.engine import LLMEngine
from lmjax.lmdeploy_config import PytorchEngineConfig, TurbomindEngineConfig

_LEGACY_ARGS = {"request_output_len": "max_new_tokens", "top_k": "top_k", "top_p": "top_p",
                "temperature": "temperature", "repetition_penalty": "repetition_penalty",
                "ignore_eos": "ignore_eos"}


def _engine_config(backend_config, tp: int | None) -> EngineConfig:
    if backend_config is None:
        config = EngineConfig()
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
    """A multi-turn chat kept by `Pipeline.chat`: the message history and the last response."""

    session_id: int
    messages: list[dict] = dataclasses.field(default_factory=list)
    response: Response | None = None

    @property
    def history(self) -> list[tuple[str, str]]:
        turns = [m["content"] for m in self.messages if m["role"] in ("user", "assistant")]
        return list(zip(turns[::2], turns[1::2]))


class Pipeline:
    def __init__(self, model_path: str | None, backend_config=None, chat_template_config=None,
                 log_level: str = "ERROR", tp: int | None = None, model_name: str | None = None,
                 backend: str | None = None):
        logging.getLogger("lmjax").setLevel(log_level)
        if backend not in (None, "turbomind", "pytorch"):
            raise ValueError(f"backend must be 'turbomind' or 'pytorch', got {backend!r}")
        self.engine = LLMEngine(model_path, _engine_config(backend_config, tp))
        self.chat_template = chat_template_config or ChatTemplateConfig(model_name=model_name)
        self.tokenizer = self.engine.tokenizer
        self._session_ids = iter(range(1, 1 << 62))

    def _gen_config(self, gen_config, legacy: dict) -> GenerationConfig:
        gen_config = gen_config or GenerationConfig()
        overrides = {_LEGACY_ARGS[k]: v for k, v in legacy.items() if v is not None}
        return dataclasses.replace(gen_config, **overrides) if overrides else gen_config

    def _params(self, gen_config: GenerationConfig):
        params = gen_config.to_sampling_params()
        extra = self.chat_template.stop_words or []
        if extra:
            params.stop = list(params.stop or []) + [w for w in extra if w not in (params.stop or [])]
        return params

    def _encode(self, prompt, do_preprocess: bool):
        if do_preprocess:
            return encode_chat(self.tokenizer, prompt, self.chat_template)
        if not isinstance(prompt, str):
            raise TypeError(f"with do_preprocess=False a prompt must be a str, got {type(prompt).__name__}")
        return prompt, encode_text(self.tokenizer, prompt)

    def _submit(self, prompts, gen_config, do_preprocess, legacy):
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict))
        batch = [prompts] if single else list(prompts)
        configs = per_prompt(gen_config, len(batch), "gen_config")
        params = [self._params(self._gen_config(g, legacy)) for g in configs]
        requests = submit_all(self.engine, [self._encode(p, do_preprocess) for p in batch], params)
        return single, requests

    def __call__(self, prompts, gen_config=None, do_preprocess: bool = True, use_tqdm: bool = False,
                 **legacy) -> Response | list[Response]:
        _check_legacy(legacy)
        single, requests = self._submit(prompts, gen_config, do_preprocess, legacy)
        run_to_completion(self.engine, requests, use_tqdm)
        out = [response(r, c) for r in requests for c in r.completions]
        return out[0] if single and len(out) == 1 else out

    batch_infer = __call__

    def stream_infer(self, prompts, gen_config=None, do_preprocess: bool = True, **legacy) -> Iterator[Response]:
        """Yield Responses carrying the new text of one prompt (`index`) as it is generated."""
        _check_legacy(legacy)
        _, requests = self._submit(prompts, gen_config, do_preprocess, legacy)
        position = {r.request_id: i for i, r in enumerate(requests)}
        for r in stream_steps(self.engine, requests):
            for c in r.completions:
                text, ids = c.take_delta()
                if text or ids or c.finished:
                    yield Response(text, len(c.token_ids), len(r.prompt_token_ids), c.finish_reason, ids,
                                   None, position[r.request_id])

    def chat(self, prompt: str, session: Session | None = None, gen_config=None, stream_response: bool = False,
             **legacy) -> Session:
        """One turn of a multi-turn chat; pass the returned session back for the next turn."""
        session = session or Session(next(self._session_ids))
        session.messages.append({"role": "user", "content": prompt})
        resp = self(list(session.messages), gen_config=gen_config, **legacy) if not stream_response else \
            _join_stream(self.stream_infer([list(session.messages)], gen_config, **legacy))
        session.response = resp
        session.messages.append({"role": "assistant", "content": resp.text})
        return session


def _join_stream(stream) -> Response:
    pieces = list(stream)
    last = pieces[-1]
    return Response("".join(p.text for p in pieces), last.generate_token_len, last.input_token_len,
                    last.finish_reason, [t for p in pieces for t in p.token_ids])


def _check_legacy(legacy: dict) -> None:
    unknown = set(legacy) - set(_LEGACY_ARGS)
    if unknown:
        raise TypeError(f"unexpected arguments {sorted(unknown)}; pass sampling settings in gen_config")


def pipeline(model_path: str | None = None, backend_config=None, chat_template_config=None,
             log_level: str = "ERROR", **kwargs) -> Pipeline:
    """Build an LMDeploy-style pipeline over lmjax's engine."""
    return Pipeline(model_path, backend_config, chat_template_config, log_level, **kwargs)
