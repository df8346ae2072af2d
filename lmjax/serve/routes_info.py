"""The server's routes that generate nothing: health and metrics, the model cards, embeddings (one batch of
prompts' pooled hidden states: lmjax.serve.embeddings), and tokenizing (LMDeploy's /v1/encode, vLLM's
/tokenize and /detokenize)."""
from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, Response

from lmjax.serve import responses as R
from lmjax.serve.embeddings import EmbeddingRequest, embed, embedding_body, prompt_ids
from lmjax.serve.errors import api_errors
from lmjax.serve.http_extras import client_request_id, json_body
from lmjax.serve.lmdeploy_protocol import EncodeRequest
from lmjax.serve.metrics import render_metrics
from lmjax.serve.prompts import chat_prompt
from lmjax.serve.served import GONE, authorize, served
from lmjax.serve.streams import until_disconnect
from lmjax.serve.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from lmjax.validation import check_token_ids

router = APIRouter()
JSON_IN = [Depends(authorize), Depends(json_body)]


@router.get("/health")
async def health():
    return {"status": "ok"}


for _method in ("GET", "POST"):  # vLLM's (SageMaker's) name for /health; a route a method: unique OpenAPI ids
    router.add_api_route("/ping", health, methods=[_method], name=f"ping_{_method.lower()}")


@router.get("/metrics")
async def metrics(raw: Request):
    s = served(raw)
    return PlainTextResponse(render_metrics(s.engine, s.name), media_type="text/plain; version=0.0.4")


def _model_card(raw: Request) -> dict:
    s = served(raw)
    return {"id": s.name, "object": "model", "created": int(time.time()), "owned_by": "lmjax", "root": s.name,
            "parent": None, "max_model_len": s.engine.session_len, "permission": [R.model_permission()]}


@router.get("/v1/models", dependencies=[Depends(authorize)])
async def models(raw: Request):
    return {"object": "list", "data": [_model_card(raw)]}


@router.get("/v1/models/{model:path}", dependencies=[Depends(authorize)])
async def model(model: str, raw: Request):  # openai-python's client.models.retrieve
    served(raw).check_model(model)
    return _model_card(raw)


@router.post("/v1/embeddings", dependencies=JSON_IN)
async def embeddings(req: EmbeddingRequest, raw: Request):
    """All inputs of a request run as one batch; a bad input is a 400 naming it before any work."""
    s = served(raw)
    s.check_model(req.model)
    config = s.engine.engine.model_config
    with api_errors():  # the engine's own checks too (KV cache size: NotImplementedError)
        prompts = prompt_ids(req, s.engine.tokenizer, lambda chat: chat_prompt(s.engine, chat), config.vocab_size,
                             s.engine.session_len, config.hidden_size)
        work = asyncio.ensure_future(embed(s.engine, prompts, req.normalize))
        if not await until_disconnect(raw, work):
            return Response(status_code=GONE)
        vectors = work.result()
    head = R.Head("embd", s.name, request_id=client_request_id(raw))
    return embedding_body(head, vectors, req.encoding_format, sum(map(len, prompts)))


@router.post("/v1/encode", dependencies=[Depends(authorize)])
async def encode(req: EncodeRequest, raw: Request):
    """LMDeploy's: token ids and their count, a list of each for a list input."""
    engine = served(raw).engine
    with api_errors():  # add_bos=False: a later turn (no BOS, and the template's text that follows a reply)
        ids = [engine.encode(text, sequence_start=req.add_bos, do_preprocess=req.do_preprocess)[1]
               for text in req.inputs()]
    if isinstance(req.input, str):
        return {"input_ids": ids[0], "length": len(ids[0])}
    return {"input_ids": ids, "length": [len(i) for i in ids]}


@router.post("/tokenize", dependencies=JSON_IN)
async def tokenize(req: TokenizeRequest, raw: Request):
    """vLLM's: the ids of a prompt or of chat messages as /v1/chat/completions would render them."""
    s = served(raw)
    s.check_model(req.model)
    with api_errors():
        ids = req.token_ids(s.engine.tokenizer, lambda chat: chat_prompt(s.engine, chat))
    strs = s.engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": s.engine.session_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize", dependencies=JSON_IN)
async def detokenize(req: DetokenizeRequest, raw: Request):
    """vLLM's: the text of token ids (special tokens kept, as vLLM)."""
    s = served(raw)
    s.check_model(req.model)
    with api_errors():
        check_token_ids("tokens", req.tokens, s.engine.engine.model_config.vocab_size)
    return {"prompt": s.engine.tokenizer.decode(req.tokens)}
