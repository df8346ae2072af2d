"""vLLM's embeddings from a decoder model: `LLM(model).embed(prompts)` and the server's /v1/embeddings.

vLLM serves a Llama-family checkpoint as an embedding model with its default pooler for such models: the
final-norm hidden state of the prompt's last token, L2-normalized (`PoolingParams(normalize=False)`: as it
is). lmjax computes it through the ordinary engine: each prompt is a request for one greedy token with
`output_last_hidden_state="generation"`, whose one row is exactly that hidden state (lmjax.engine.host_outputs),
so embeddings batch, share the cache and the prefix cache like any request. Differences from vLLM: no
`task="embed"` / `runner="pooling"` switch is needed (any generative checkpoint embeds); `dimensions`
(Matryoshka truncation) is refused, as vLLM refuses it for models not trained for it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from lmjax.api.batch import run_to_completion, submit_all
from lmjax.config import PoolingSampling, check_defaults_only
from lmjax.engine.engine import LLMEngine
from lmjax.validation import strict_fields


@strict_fields
@dataclasses.dataclass
class PoolingParams:
    """vLLM's pooling parameters, the fields an embedding takes: normalize None means vLLM's default (True)."""
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        check_defaults_only("PoolingParams", {"dimensions": self.dimensions}, {"dimensions": None})


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


def embed_token_ids(engine: LLMEngine, encoded: Sequence[tuple[str | None, list[int]]],
                    pooling: Sequence[PoolingParams], use_tqdm: bool = False,
                    salts: Sequence[str | None] | None = None) -> list[EmbeddingRequestOutput]:
    """One embedding per (text, token ids) prompt, in order, with its PoolingParams (and prefix-cache salt);
    every prompt is checked before any runs."""
    params = [PoolingSampling.embedding(p.truncate_prompt_tokens) for p in pooling]
    for p, salt in zip(params, salts or ()):
        p.cache_salt = salt
    requests = run_to_completion(engine, submit_all(engine, encoded, params), use_tqdm)
    return [EmbeddingRequestOutput(r.request_id, EmbeddingOutput(_pooled(r, p.normalize)), list(r.prompt_token_ids))
            for r, p in zip(requests, pooling)]


def _pooled(request, normalize: bool | None) -> list[float]:
    completion = request.completions[0]
    if completion.finish_reason == "error":
        raise RuntimeError(f"embedding request {request.request_id} failed: {request.error}")
    return pool(completion.host_rows.stacked("hidden")[0], normalize)


def pool(hidden_D, normalize: bool | None = None) -> list[float]:
    """The embedding of a prompt from its last token's hidden state [D] (one "generation" row)."""
    hidden_D = np.asarray(hidden_D, np.float32)
    if normalize is not False:
        hidden_D = hidden_D / max(float(np.linalg.norm(hidden_D)), 1e-12)  # vLLM's F.normalize eps
    return hidden_D.tolist()
