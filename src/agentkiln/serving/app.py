"""`agentkiln endpoint`: a policy behind an OpenAI-compatible HTTP API (FastAPI on uvicorn).

    GET  /v1/models                      the served model
    POST /v1/chat/completions            a reply: the policy's chat template, agent format and decoding
    POST /v1/episodes/{id}/reward        close a recorded episode with its reward ({"reward": 1.0, "won": true})
    GET  /health                         the version being served

Request extensions (top-level fields, `extra_body` in the openai client):
    admissible: ["go north", ...]        the valid actions: listed in the observation (as the agent was
                                         trained) and, by default, the reply constrained to one of them
    decoding: constrained | free | auto  auto (default): constrained when `admissible` is given
    metadata: {"task_id", "family"}      kept with the recorded episode (OpenAI's own `metadata` field)
Response extensions: `prompt_token_ids` (the window the reply was decoded from), each choice's
`token_ids` (the reply's ids exactly as generated), and `agentkiln` {episode_id, model_version,
turn, window, action, retokenized}; headers `x-agentkiln-model-version` and `x-agentkiln-episode`.
Streaming (`stream: true`) sends the reply as server-sent events once it is decoded.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from agentkiln import lifecycle
from agentkiln.serving.conversation import RequestError
from agentkiln.serving.recorder import Recorder
from agentkiln.serving.source import ModelSource
from agentkiln.serving.worker import Job, VLLMGenerators, Worker

DEFAULT_REPLY_TOKENS = 64


def _error(status: int, message: str, code: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}},
                        status_code=status)


def parse_job(body: dict, default_budget: int) -> Job:
    """The decoding job a request asks for; RequestError naming the field otherwise."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError("`messages` must be a list of message objects")
    if body.get("n", 1) != 1:
        raise RequestError("`n` must be 1: one reply per request (send the request again for more samples)")
    temperature = body.get("temperature", 1.0)
    temperature = 1.0 if temperature is None else temperature
    if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
        raise RequestError(f"`temperature` {temperature!r}: expected a number in [0, 2] (0: greedy)")
    top_p = body.get("top_p")
    if top_p not in (None, 1, 1.0):
        raise RequestError(f"`top_p` {top_p}: not supported; agentkiln samples the whole distribution, as it trains")
    if body.get("top_logprobs") not in (None, 0):
        raise RequestError("`top_logprobs`: not supported; each reply token's own log-prob comes with `logprobs: true`")
    budget = body.get("max_completion_tokens", body.get("max_tokens")) or default_budget
    if not isinstance(budget, int) or budget < 1:
        raise RequestError(f"`max_tokens` {budget!r}: expected a positive integer")
    seed = body.get("seed")
    if seed is not None and not isinstance(seed, int):
        raise RequestError(f"`seed` {seed!r}: expected an integer")
    admissible = body.get("admissible")
    if admissible is not None and (not isinstance(admissible, list) or not admissible
                                   or not all(isinstance(a, str) and a.strip() for a in admissible)):
        raise RequestError("`admissible` must be a non-empty list of action strings")
    decoding = body.get("decoding", "auto")
    if decoding not in ("auto", "constrained", "free"):
        raise RequestError(f"`decoding` {decoding!r}: expected auto, constrained or free")
    if decoding == "constrained" and not admissible:
        raise RequestError("`decoding: constrained` needs `admissible`: the actions to constrain the reply to")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name") for t in tools)):
        raise RequestError("`tools` must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}} objects")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise RequestError("`metadata` must be an object")
    return Job(messages=messages, budget=budget, temperature=float(temperature), seed=seed, admissible=admissible,
               decoding=decoding, tools=tools, metadata=metadata)


def create_app(worker: Worker, default_budget: int = DEFAULT_REPLY_TOKENS) -> FastAPI:
    app = FastAPI(title="agentkiln endpoint", docs_url="/docs", redoc_url=None)
    source = worker.source

    @app.get("/health")
    def health():
        return {"status": "ok", "model": source.spec, "model_version": source.version, "batches": worker.batches}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": source.served_name, "object": "model", "created": 0,
                                            "owned_by": "agentkiln", "root": source.spec,
                                            "model_version": source.version}]}

    @app.post("/v1/episodes/{episode_id}/reward")
    async def reward(episode_id: str, request: Request):
        if worker.recorder is None:
            return _error(409, "this endpoint records nothing: start it with --record DIR", "not_recording")
        try:
            body = await request.json()
            value, won = body["reward"], body.get("won")
            if not isinstance(value, (int, float)) or (won is not None and not isinstance(won, bool)):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            return _error(400, 'expected {"reward": <number>, "won": <true|false, optional>}', param="reward")
        try:
            outcome = worker.recorder.reward(episode_id, value, won)
        except KeyError:
            return _error(404, f"no recorded episode {episode_id!r}", "episode_not_found")
        return {"episode_id": episode_id, **outcome}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return _error(400, f"the request body is not JSON ({e})")
        try:
            job = parse_job(body, default_budget)
            out = await asyncio.wrap_future(worker.submit(job))
        except RequestError as e:
            return _error(400, str(e), e.code)
        answer = completion(out, source.served_name, bool(body.get("logprobs")))
        headers = {"x-agentkiln-model-version": out["version"], "x-agentkiln-episode": out["episode_id"]}
        if not body.get("stream"):
            return JSONResponse(answer, headers=headers)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
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
          backend: str = "hf", out=print) -> None:
    """Load the policy, start the decoding thread (and the alias follower), serve until SIGINT / SIGTERM.
    `backend`: hf (the in-process engine) or vllm (a vLLM engine in its own process: scripts/install_vllm.sh)."""
    if threads:
        torch.set_num_threads(threads)
    source = ModelSource(spec, poll=poll, log=out)
    generators = VLLMGenerators(source.policy) if backend == "vllm" else None
    worker = Worker(source, Recorder(record) if record else None, max_batch=max_batch, generators=generators)
    follower = source.follow()
    out(f"serving {spec} (version {source.version}, {backend}) at http://{host}:{port}/v1"
        + (f", following its alias every {poll:g} s" if follower else "")
        + (f"; recording episodes to {record}" if record else ""))
    out(f"try: curl http://{host}:{port}/v1/models   (docs/serving.md: the harness loop with the openai client)")
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again for the handler it
    # found: ours (lifecycle) turns it into Terminated, so the cleanup below runs and the command ends 0
    lifecycle.handle_signals()
    try:
        uvicorn.Server(uvicorn.Config(create_app(worker, max_tokens), host=host, port=port, log_level="warning",
                                      access_log=False)).run()
    except lifecycle.Terminated as e:
        out(f"{e}: requests in progress were answered")
    finally:
        source.stop()
        worker.stop()
        if generators is not None:
            generators.close()
        out("endpoint stopped" + (f"; recorded episodes are in {record} (agentkiln collect {record} ...)" if record else ""))
