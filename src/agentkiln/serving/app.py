"""`agentkiln endpoint`: a policy behind an OpenAI-compatible HTTP API (FastAPI on uvicorn).

    GET  /v1/models                      the served model
    POST /v1/chat/completions            a reply: the policy's chat template, agent format and decoding
    POST /v1/episodes/{id}/reward        close a recorded episode with its reward ({"reward": 1.0, "won": true};
                                         once: a second one is 409 unless it says "replace": true)
    GET  /health                         the version being served, the queue, what was kept and dropped

Request extensions (top-level fields, `extra_body` in the openai client):
    admissible: ["go north", ...]        the valid actions: listed in the observation (as the agent was
                                         trained) and, by default, the reply constrained to one of them
    decoding: constrained | free | auto  auto (default): constrained when `admissible` is given
    metadata: {"task_id", "family"}      kept with the recorded episode (OpenAI's own `metadata` field)
Response extensions: `prompt_token_ids` (the window the reply was decoded from), each choice's
`token_ids` (the reply's ids exactly as generated), and `agentkiln` {episode_id, model_version,
turn, window, action, retokenized}; headers `x-agentkiln-model-version` and `x-agentkiln-episode`.
Streaming (`stream: true`) sends the reply as server-sent events once it is decoded.

Every body is bounded, parsed and typed before it is queued (serving.requests, serving.limits); a refusal
is an OpenAI-style error {"error": {"message", "type", "param", "code"}} with status 400 (a field: `param`
names it), 404, 409, 413 (the body), 422 (preparation over its time bound) or 503 (busy, stopping).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import traceback
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from agentkiln import lifecycle
from agentkiln.serving.conversation import RequestError
from agentkiln.serving.limits import OPTION, Limits
from agentkiln.serving.recorder import EPISODE_ID, Recorder, RewardExists
from agentkiln.serving.requests import RewardRequest, chat_job, parse_json, validate
from agentkiln.serving.source import ModelSource
from agentkiln.serving.worker import VLLMGenerators, Worker

DEFAULT_REPLY_TOKENS = 64
# after SIGTERM requests in progress get STOP_GRACE_S (uvicorn's default is forever: one stalled request kept
# a stopped endpoint alive), then the decoding thread STOP_DECODE_S to finish its step: a stop within 10 s
STOP_GRACE_S, STOP_DECODE_S = 3.0, 1.5


def _error(status: int, message: str, code: str = "invalid_request_error", param: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class CatchAll:
    """The last resort (ASGI middleware): an exception no route expected is logged here and answered as a
    JSON 500 without its traceback, on a connection that stays open (Starlette's own handler re-raises,
    and the server then drops the connection)."""

    def __init__(self, app, log=print):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            # the server is stopping and its grace for requests in progress ran out (STOP_GRACE_S): the
            # request ends here, answered as such rather than with the server's bare 500
            if started:
                raise
            await _error(503, "the endpoint stopped before this request was answered; send it again once it is "
                         "back", "server_stopping")(scope, receive, send)
        except Exception as e:  # noqa: BLE001
            self.log(f"{scope.get('method')} {scope.get('path')} failed:\n" + "".join(traceback.format_exception(e)))
            if started:
                raise  # half a response is out: only closing the connection can say it failed
            await _error(500, "the server failed on this request (its log has the details)", "internal_error")(
                scope, receive, send)


class TooLarge(RequestError):
    """A body over --max-body-bytes (413); `close`: its rest was not read, so its connection must close."""

    def __init__(self, limit: int, close: bool):
        super().__init__(f"the request body is larger than {limit:,} bytes ({OPTION['body_bytes']}): send a shorter "
                         "conversation", "request_too_large", status=413)
        self.close = close


class Bodies:
    """Request bodies, read with bounds: one body at most `limits.body_bytes` (413), all bodies being
    served at most `limits.inflight_bytes` together (503: the server is busy, try again). An oversized
    body up to DRAIN times the bound is read to its end and dropped, so that a client still sending it
    reads the 413 and keeps its connection; a larger one is refused unread and its connection closed."""

    DRAIN = 8

    def __init__(self, limits: Limits):
        self.limits, self.held = limits, 0

    @contextlib.asynccontextmanager
    async def read(self, request: Request):
        limit, held, chunks = self.limits.body_bytes, 0, []
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit * self.DRAIN:
            raise TooLarge(limit, close=True)
        try:
            stream = request.stream()
            async for chunk in stream:
                if held + len(chunk) > limit:
                    seen = held + len(chunk)
                    async for rest in stream:  # dropped as it comes
                        seen += len(rest)
                        if seen > limit * self.DRAIN:
                            raise TooLarge(limit, close=True)
                    raise TooLarge(limit, close=False)
                held += len(chunk)
                self.held += len(chunk)
                if self.held > self.limits.inflight_bytes:
                    raise RequestError("the server holds too many requests at once; retry in a moment",
                                       "server_busy", status=503)
                chunks.append(chunk)
            yield b"".join(chunks)
        finally:
            self.held -= held


def create_app(worker: Worker, default_budget: int = DEFAULT_REPLY_TOKENS, limits: Limits | None = None,
               log=print) -> FastAPI:
    limits = limits or worker.limits
    app = FastAPI(title="agentkiln endpoint", docs_url="/docs", redoc_url=None)
    app.add_middleware(CatchAll, log=log)
    source, bodies = worker.source, Bodies(limits)

    @app.exception_handler(RequestError)
    async def refused(request: Request, e: RequestError):
        headers = {"retry-after": "1"} if e.status == 503 else None
        if isinstance(e, TooLarge) and e.close:
            headers = {"connection": "close"}
        return _error(e.status, str(e), e.code, e.param, headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # an unknown route, a wrong method
        return _error(e.status_code, f"{request.method} {request.url.path}: {e.detail}", "not_found"
                      if e.status_code == 404 else "invalid_request_error", headers=e.headers)

    @app.get("/health")
    def health():
        return {"status": "ok", "model": source.spec, "model_version": source.version, **worker.stats(),
                "recording": worker.recorder.stats() if worker.recorder else None,
                "requests_in_flight_bytes": bodies.held}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": source.served_name, "object": "model", "created": 0,
                                            "owned_by": "agentkiln", "root": source.spec,
                                            "model_version": source.version}]}

    @app.post("/v1/episodes/{episode_id}/reward")
    async def reward(episode_id: str, request: Request):
        if worker.recorder is None:
            return _error(409, "this endpoint records nothing: start it with --record DIR", "not_recording")
        if not EPISODE_ID.fullmatch(episode_id):
            return _error(404, f"no recorded episode {episode_id[:64]!r} (ids look like ep-0123456789abcdef)",
                          "episode_not_found")
        async with bodies.read(request) as raw:
            body = validate(RewardRequest, parse_json(raw))
        try:
            outcome = await asyncio.to_thread(worker.recorder.reward, episode_id, body.reward, body.won, body.replace)
        except KeyError:
            return _error(404, f"no recorded episode {episode_id!r}", "episode_not_found")
        except RewardExists as e:
            return _error(409, f"episode {episode_id} already has a reward ({e.outcome['reward']}); send "
                          '{"replace": true} with the new one to replace it', "reward_exists", "replace")
        return {"episode_id": episode_id, **outcome}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        async with bodies.read(request) as raw:
            req, job = chat_job(parse_json(raw), default_budget, limits)
            out = await asyncio.wrap_future(worker.submit(job))
        answer = completion(out, source.served_name, bool(req.logprobs))
        headers = {"x-agentkiln-model-version": out["version"], "x-agentkiln-episode": out["episode_id"]}
        if not req.stream:
            return JSONResponse(answer, headers=headers)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_events(answer, usage), media_type="text/event-stream", headers=headers)

    return app


def completion(out: dict, model: str, logprobs: bool) -> dict:
    choice = {"index": 0, "message": out["message"], "finish_reason": out["finish_reason"],
              "logprobs": None, "token_ids": out["ids"]}
    if logprobs:
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                          for t, lp in zip(out["tokens"], out["logprobs"])]}
    n_prompt, n_reply = len(out["prompt_ids"]), len(out["ids"])
    return {"id": "chatcmpl-" + uuid.uuid4().hex[:24], "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice], "prompt_token_ids": out["prompt_ids"],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_reply, "total_tokens": n_prompt + n_reply},
            "agentkiln": {k: out[k] for k in ("episode_id", "turn", "window", "action", "retokenized")}
            | {"model_version": out["version"]}}


async def _events(c: dict, usage: bool):
    """The completion as chat.completion.chunk events: the role, the content, the tool calls, the end."""
    head = {"id": c["id"], "object": "chat.completion.chunk", "created": c["created"], "model": c["model"]}
    choice, msg = c["choices"][0], c["choices"][0]["message"]

    def event(delta: dict, top: dict | None = None, **extra) -> str:
        return "data: " + json.dumps(head | (top or {}) | {"choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None} | extra]}) + "\n\n"

    yield event({"role": "assistant", "content": ""})
    if msg.get("reasoning_content"):
        yield event({"reasoning_content": msg["reasoning_content"]})
    if msg.get("content"):
        yield event({"content": msg["content"]}, logprobs=choice["logprobs"])
    for k, call in enumerate(msg.get("tool_calls") or []):
        yield event({"tool_calls": [{"index": k, **call}]})
    yield event({}, {"prompt_token_ids": c["prompt_token_ids"], "agentkiln": c["agentkiln"]},
                finish_reason=choice["finish_reason"], token_ids=choice["token_ids"])
    if usage:
        yield "data: " + json.dumps(head | {"choices": [], "usage": c["usage"]}) + "\n\n"
    yield "data: [DONE]\n\n"


def serve(spec: str, host: str = "127.0.0.1", port: int = 8000, record: str | None = None, poll: float = 10.0,
          max_batch: int = 16, threads: int | None = None, max_tokens: int = DEFAULT_REPLY_TOKENS,
          backend: str = "hf", limits: Limits | None = None, out=print) -> None:
    """Load the policy, start the decoding thread (and the alias follower), serve until SIGINT / SIGTERM.
    `backend`: hf (the in-process engine) or vllm (a vLLM engine in its own process: scripts/install_vllm.sh)."""
    limits = limits or Limits()
    if threads:
        torch.set_num_threads(threads)
    source = ModelSource(spec, poll=poll, log=out)
    generators = VLLMGenerators(source.policy) if backend == "vllm" else None
    recorder = Recorder(record, limits.record_bytes, log=out) if record else None
    worker = Worker(source, recorder, max_batch=max_batch, generators=generators, limits=limits, log=out)
    follower = source.follow()
    out(f"serving {spec} (version {source.version}, {backend}) at http://{host}:{port}/v1"
        + (f", following its alias every {poll:g} s" if follower else "")
        + (f"; recording episodes to {record}" if record else ""))
    out(f"try: curl http://{host}:{port}/v1/models   (docs/serving.md: the harness loop with the openai client)")
    # uvicorn shuts down on SIGINT / SIGTERM (requests in progress get STOP_GRACE_S), then raises the
    # signal again for the handler it found: ours (lifecycle) turns it into Terminated, so the cleanup
    # below runs and the command ends 0
    lifecycle.handle_signals()
    try:
        uvicorn.Server(uvicorn.Config(create_app(worker, max_tokens, limits, log=out), host=host, port=port,
                                      log_level="warning", access_log=False,
                                      timeout_graceful_shutdown=STOP_GRACE_S)).run()
    except lifecycle.Terminated as e:
        out(f"{e}: requests in progress were answered or cancelled")
    finally:
        source.stop()
        ended = worker.stop(STOP_DECODE_S)
        if generators is not None:
            generators.close()
        out("endpoint stopped" + (f"; recorded episodes are in {record} (agentkiln collect {record} ...)" if record else ""))
        if not ended:  # one step of a preparation (a tokenizer call) cannot be interrupted: not waited for
            out(f"the decoding thread was still busy {STOP_DECODE_S:g} s after the stop: ending without it")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1 if sys.exc_info()[0] else 0)
