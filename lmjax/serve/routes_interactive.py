"""LMDeploy's session endpoint, `POST /v1/chat/interactive`: a turn of session `session_id` (continuing its
history when interactive_mode is on), a cancel, or an end; newline-delimited JSON when streaming."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from lmjax.serve import responses as R
from lmjax.serve.errors import APIError, api_errors
from lmjax.serve.lmdeploy_protocol import InteractiveRequest
from lmjax.serve.served import GONE, authorize, served
from lmjax.serve.stream_errors import chain as _chain, guarded as _guarded, json_line as _json_line
from lmjax.serve.streams import first_and_rest, merge

router = APIRouter(dependencies=[Depends(authorize)])


@router.post("/v1/chat/interactive")
async def chat_interactive(req: InteractiveRequest, raw: Request):
    s = served(raw)
    engine = s.engine
    if req.cancel and req.session_id == -1:  # as LMDeploy: a fresh id has nothing to cancel
        raise APIError(400, "please set a session_id to cancel a request")
    sid = req.session_id if req.session_id != -1 else s.new_session_id()
    # A turn the client left (a closed stream) is aborted by the engine thread: wait for that before reading
    # the history it keeps, or the next turn sent at once would start the session over.
    await engine.settle(sid)
    history = engine.id2step.get(sid, 0)
    # LMDeploy's APIClient.end_session sends request_output_len=0: an end even of a session with no
    # history yet (its first turn may still be running)
    ends = not req.interactive_mode and req.prompt == "" and (history or req.request_output_len == 0)
    if req.cancel or ends:
        await (engine.stop_session(sid) if req.cancel else engine.end_session(sid))
        # LMDeploy answers a cancel with these same fields: finish_reason "stop", history_tokens 0
        return {"text": "", "tokens": 0, "input_tokens": 0, "history_tokens": 0 if req.cancel else history,
                "finish_reason": "stop", "session_id": sid}
    with api_errors():
        gen = engine.generate(req.prompt, sid, req.gen_config(), sequence_start=history == 0,
                              sequence_end=not req.interactive_mode)
        first, rest = await first_and_rest(merge([gen]))
    choices = R.Choices(1)

    def line(out, text) -> dict:
        return {"text": text, "tokens": out.generate_token_len, "input_tokens": out.input_token_len,
                "history_tokens": out.history_token_len, "finish_reason": out.finish_reason, "session_id": sid}
    if not req.stream:
        if not await s.collect(raw, first, rest, choices, openai=False):
            return Response(status_code=GONE)
        return line(choices.outs[0], choices.outs[0].response)

    async def lines():
        async for _, out in _chain(first, rest, openai=False):
            yield _json_line(line(out, out.response))
    return StreamingResponse(_guarded(lines(), frame=_json_line), media_type="application/x-ndjson")
