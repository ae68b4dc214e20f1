"""The endpoint's request bodies as types. A body is parsed as strict JSON (UTF-8, nested at most
`MAX_DEPTH` deep, no lone surrogates), then validated into a typed request (pydantic, strict: a field
of the wrong type is refused, not coerced) and checked against the size limits (serving.limits), all
before anything reaches the conversation store or the decoding thread. Every refusal is a
RequestError whose `param` names the field (`messages[2].content[0].text`), as OpenAI's errors do.
Fields the endpoint does not use are ignored, as other OpenAI-compatible servers do."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentkiln.serving.conversation import RequestError
from agentkiln.serving.limits import OPTION, Limits
from agentkiln.serving.worker import Job

MAX_DEPTH = 64  # nesting of a body: a JSON schema of tool parameters needs a dozen levels
_SURROGATE = re.compile("[\ud800-\udfff]")
_INT64 = 2**63


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"] = "text"  # the policy reads text: an image or audio part is refused, not dropped
    text: str


class CalledFunction(_Strict):
    name: str = Field(min_length=1, max_length=64)
    arguments: str | dict[str, Any] = ""


class ToolCall(_Strict):
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=256)
    reasoning_content: str | None = None

    def chars(self) -> int:
        """Its text: the content, the reasoning, every tool call's name and arguments."""
        calls = sum(len(c.function.name) + (len(c.function.arguments) if isinstance(c.function.arguments, str)
                                            else len(json.dumps(c.function.arguments)))
                    for c in self.tool_calls or [])
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return len(text) + len(self.reasoning_content or "") + calls


class Parameters(_Strict):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)  # a JSON schema: kept whole
    properties: dict[str, Any] | None = None


class FunctionSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=8192)
    parameters: Parameters | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionSpec


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatRequest(_Strict):
    messages: list[Message] = Field(min_length=1)
    model: str | None = Field(None, max_length=256)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1, lt=_INT64)
    max_completion_tokens: int | None = Field(None, ge=1, lt=_INT64)
    seed: int | None = Field(None, ge=-_INT64, lt=2**64)  # what torch.Generator.manual_seed takes
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    admissible: list[str] | None = None
    decoding: Literal["auto", "constrained", "free"] = "auto"
    metadata: dict[str, str] | None = Field(None, max_length=16)


class RewardRequest(_Strict):
    reward: float  # finite: allow_inf_nan=False
    won: bool | None = None
    replace: bool = False  # a second reward for an episode is refused (409) unless it says so


# ---------------------------------------------------------------------------------------------- parsing
def parse_json(raw: bytes) -> Any:
    """The body as Python data; RequestError naming what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not UTF-8 (byte {raw[e.start]:#04x} at offset {e.start}): "
                           "send JSON encoded as UTF-8") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise RequestError(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, or an integer of more digits than Python converts
        raise RequestError(f"the request body is not valid JSON ({e})") from None
    _check_tree(data)
    return data


def _check_tree(data: Any) -> None:
    """Depth and strings of parsed JSON: nothing deeper than MAX_DEPTH, no lone surrogate (it cannot be
    encoded as UTF-8, so it would fail later, in the tokenizer or the recorder)."""
    stack = [(data, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            field = re.split(r"[.\[]", path, maxsplit=1)[0]
            raise RequestError(f"`{field}`: nests deeper than {MAX_DEPTH} levels (at {path[:80]}...)", param=field)
        if isinstance(node, str):
            if not node.isascii() and _SURROGATE.search(node):
                raise RequestError(f"`{path or 'body'}`: a lone UTF-16 surrogate (\\ud800-\\udfff without its pair) is "
                                   "not text; send valid Unicode", param=path or None)
        elif isinstance(node, dict):
            for k, v in node.items():
                sub = f"{path}.{k}" if path else k
                if not k.isascii() and _SURROGATE.search(k):
                    raise RequestError(f"`{sub}`: a lone UTF-16 surrogate in a key", param=path or None)
                stack.append((v, sub, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node))


def validate(model: type[_Strict], data: Any) -> Any:
    """`data` as `model`; a RequestError naming the first wrong field otherwise."""
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, not {_shown(data)}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = [_located(err, data) for err in e.errors(include_url=False)]
        param, err = max(errors, key=lambda pe: pe[0].count(".") + pe[0].count("["))  # the most specific one
        msg = err["msg"].removeprefix("Value error, ")
        got = "" if err["type"] == "missing" else f" (got {_shown(err['input'])})"
        raise RequestError(f"`{param}`: {msg}{got}", "invalid_type" if "type" in err["type"] else err["type"],
                           param=param) from None


def _located(err: dict, data: Any) -> tuple[str, dict]:
    """The JSON path of a validation error: its location walked through the data (the union-member
    tags pydantic adds to a location name no field, so they are skipped)."""
    path, node = "", data
    for part in err["loc"]:
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            path, node = (f"{path}.{part}" if path else part), node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path, node = f"{path}[{part}]", node[part]
        elif isinstance(part, str) and not path.endswith(part) and "[" not in part and part not in _TAGS:
            path = f"{path}.{part}" if path else part  # a missing field
    return path or "body", err


_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "TextPart", "function-after", "literal"}


def _shown(value: Any) -> str:
    """A wrong value as an error message shows it: short scalars as they are, the rest by their kind."""
    if isinstance(value, (bool, int, float)) or value is None:
        return json.dumps(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge integer"
    if isinstance(value, str):
        return json.dumps(value[:40] + ("..." if len(value) > 40 else ""))
    return {dict: "an object", list: "an array"}.get(type(value), type(value).__name__)


def _too_long(param: str, what: str, n: int, limit: int, key: str, code: str) -> RequestError:
    return RequestError(f"`{param}`: {n:,} {what}, more than the {limit:,} this endpoint takes ({OPTION[key]})",
                        code, param=param)


def check_limits(req: ChatRequest, limits: Limits) -> None:
    """The size limits of one request (serving.limits)."""
    if len(req.messages) > limits.messages:
        raise _too_long("messages", "messages", len(req.messages), limits.messages, "messages",
                        "array_above_max_length")
    total = 0
    for i, m in enumerate(req.messages):
        n = m.chars()
        if n > limits.message_chars:
            raise _too_long(f"messages[{i}].content", "characters", n, limits.message_chars, "message_chars",
                            "string_above_max_length")
        total += n
    if total > limits.conversation_chars:
        raise _too_long("messages", "characters in all", total, limits.conversation_chars, "conversation_chars",
                        "string_above_max_length")
    if req.admissible is not None:
        if len(req.admissible) > limits.admissible:
            raise _too_long("admissible", "actions", len(req.admissible), limits.admissible, "admissible",
                            "array_above_max_length")
        for i, a in enumerate(req.admissible):
            if len(a) > limits.action_chars:
                raise _too_long(f"admissible[{i}]", "characters", len(a), limits.action_chars, "action_chars",
                                "string_above_max_length")
        n = sum(map(len, req.admissible))
        if n > limits.admissible_chars:
            raise _too_long("admissible", "characters in all", n, limits.admissible_chars, "admissible_chars",
                            "string_above_max_length")
    if req.tools is not None and len(req.tools) > limits.tools:
        raise RequestError(f"`tools`: {len(req.tools)} tools, more than the {limits.tools} this endpoint takes",
                           "array_above_max_length", param="tools")


def chat_job(data: Any, default_budget: int, limits: Limits) -> tuple[ChatRequest, Job]:
    """The typed request and the decoding job it asks for; RequestError naming the field otherwise."""
    req = validate(ChatRequest, data)
    check_limits(req, limits)
    if req.n not in (None, 1):
        raise RequestError("`n` must be 1: one reply per request (send the request again for more samples)", param="n")
    if req.top_p not in (None, 1):
        raise RequestError(f"`top_p` {req.top_p}: not supported; agentkiln samples the whole distribution, as it "
                           "trains", param="top_p")
    if req.top_logprobs:
        raise RequestError("`top_logprobs`: not supported; each reply token's own log-prob comes with "
                           "`logprobs: true`", param="top_logprobs")
    if req.admissible is not None:
        blank = next((i for i, a in enumerate(req.admissible) if not a.strip()), None)
        if not req.admissible or blank is not None:
            param = "admissible" if blank is None else f"admissible[{blank}]"
            raise RequestError("`admissible` must be a non-empty list of action strings (none of them blank)",
                               param=param)
    if req.decoding == "constrained" and not req.admissible:
        raise RequestError("`decoding: constrained` needs `admissible`: the actions to constrain the reply to",
                           param="admissible")
    messages = [m.model_dump(exclude_none=True) | ({"role": "system"} if m.role == "developer" else {})
                for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools is not None else None
    budget = req.max_completion_tokens or req.max_tokens or default_budget
    temperature = 1.0 if req.temperature is None else req.temperature
    return req, Job(messages=messages, budget=budget, temperature=float(temperature), seed=req.seed,
                    admissible=req.admissible, decoding=req.decoding, tools=tools, metadata=req.metadata or {})


def parse_job(body: dict, default_budget: int, limits: Limits | None = None) -> Job:
    """A request given as Python data (mlflow's pyfunc), checked as a body is."""
    try:
        body = json.loads(json.dumps(body))  # what a client could have sent: plain JSON types only
    except (TypeError, ValueError, RecursionError) as e:
        raise RequestError(f"the request is not JSON data ({e})") from None
    _check_tree(body)
    return chat_job(body, default_budget, limits or Limits())[1]
