"""The OpenAI-compatible HTTP API over the serving engine (FastAPI; `hybrid serve` runs it with uvicorn).

    POST /v1/completions        prompt: a text, a list of texts (one choice each), token ids, or lists of them
    POST /v1/chat/completions   messages rendered by the checkpoint's chat template (sandboxed)
    GET  /v1/models, /health, /metrics (Prometheus text)

Both POST endpoints stream with `"stream": true` (server-sent events, `data: [DONE]` last;
`stream_options.include_usage` adds a usage chunk). Parameters: max_tokens / max_completion_tokens,
temperature (default 1, as OpenAI's), top_p, top_k (vLLM's extension), seed, frequency_penalty and
presence_penalty (OpenAI's), repetition_penalty and ignore_eos (vLLM's), stop (strings, never sent,
matched across token boundaries), n (1 only), chat_template_kwargs (e.g. {"enable_thinking": false}),
logprobs (chat: `logprobs` true and `top_logprobs` 0..20; completions: the legacy `logprobs` 0..5; the
model's raw log-probabilities, before temperature, top-k and top-p, as vLLM's default).
`usage.prompt_tokens_details.cached_tokens` counts the prompt tokens the prefix cache served. For a chat
template that uses `<think>`, the thinking is returned as `reasoning_content` (`hybrid.serving.text`).

Errors are OpenAI's JSON (`{"error": {"message", "type", "param", "code"}}`): 400 for bad parameters,
for a parameter this server does not implement set to anything but its neutral value (`UNSUPPORTED`), and
for prompts past the model length (with the numbers), 401 without the `--api-key`, 404 for another model or
route, 413 for a body past `MAX_BODY_BYTES`, 503 with Retry-After when the queue is full. Fields no OpenAI /
vLLM parameter is named for are ignored with a warning in the server's log (as vLLM does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import numbers
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybrid.sampling import SamplingParams
from hybrid.serving.request import RequestOutput, TokenLogprobs
from hybrid.serving.runner import EngineRunner, Finished, QueueFull
from hybrid.serving.messages import render_chat, sampling_params, template_thinks
from hybrid.serving.metrics import exposition
from hybrid.serving.text import ReasoningSplitter, TextStream

MAX_BODY_BYTES = 16 * 2**20
MAX_STOP_STRINGS = 16
# parameters (OpenAI's and vLLM's) this server does not implement, with the values that ask for nothing
# (accepted); any other value is a 400 naming the parameter, never silently ignored
UNSUPPORTED = {"echo": (None, False), "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
               "tool_choice": (None, "none"), "logit_bias": (None, {}), "min_p": (None, 0),
               "min_tokens": (None, 0), "stop_token_ids": (None, []), "response_format": (None, {"type": "text"}),
               "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
               "use_beam_search": (None, False), "length_penalty": (None, 1), "prompt_logprobs": (None,),
               "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
               "truncate_prompt_tokens": (None,), "add_generation_prompt": (None, True),
               "continue_final_message": (None, False), "parallel_tool_calls": (None, True, False),
               "functions": (None, []), "function_call": (None, "none"), "audio": (None,), "modalities": (None, ["text"]),
               "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,)}
# fields that do not change the output (accepted and unused); any field in neither set is logged as ignored
INERT = {"user", "metadata", "store", "service_tier", "request_id", "priority"}
ACCEPTED = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
            "seed", "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs", "chat_template_kwargs", "frequency_penalty",
            "presence_penalty", "repetition_penalty", "ignore_eos"}
log = logging.getLogger("hybrid.serving")
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's and vLLM's limit)
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions' logprobs (OpenAI's limit)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind, self.headers = status, message, param, code, kind, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def _number(body: dict, key: str, default, lo: float = -math.inf, hi: float = math.inf, integer: bool = False,
            open_low: bool = False):
    """body[key] checked to be a finite number (an integer if `integer`) in [lo, hi] ((lo, hi] if
    `open_low`); `default` when absent or null.

    Raises:
        APIError: 400 naming the key, the range and the value.
    """
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and (not integer or float(value).is_integer())
    if not ok or not math.isfinite(value) or not lo <= value <= hi or (open_low and value == lo):
        kind = "an integer" if integer else "a number"
        where = (f"{'>' if open_low else '>='} {_bound(lo)}" if hi == math.inf else
                 f"in {'(' if open_low else '['}{_bound(lo)}, {_bound(hi)}]")
        raise _bad(f"{key} must be {kind} {where}, got {json.dumps(value)[:80]}", key)
    return int(value) if integer else float(value)


def _bound(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and float(x).is_integer() else f"{x:g}"


class Server:
    """The app's state: the runner, the tokenizer, the served name and the limits."""

    def __init__(self, runner: EngineRunner, tokenizer, model_name: str, api_key: str | None = None):
        self.runner, self.tokenizer, self.model_name, self.api_key = runner, tokenizer, model_name, api_key
        self.engine = runner.engine
        self.max_model_len = self.engine.max_model_len
        self.thinks = template_thinks(tokenizer)
        self.created = int(time.time())  # /v1/models' `created`: when this server loaded the model

    # ------------------------------------------------------------------------------------------ parameters
    def sampling(self, body: dict) -> SamplingParams:
        temperature = _number(body, "temperature", None, 0, 2)
        top_p = _number(body, "top_p", None, 0, 1, open_low=True)
        top_k = _number(body, "top_k", None, -1, 2**31 - 1, integer=True)
        seed = _number(body, "seed", None, -2**63, 2**64 - 1, integer=True)
        penalties = {"frequency_penalty": _number(body, "frequency_penalty", 0.0, -2, 2),
                     "presence_penalty": _number(body, "presence_penalty", 0.0, -2, 2),
                     "repetition_penalty": _number(body, "repetition_penalty", 1.0, 0, math.inf, open_low=True)}
        # what the request leaves out: the checkpoint's defaults (generation_config.json), else the API's
        return sampling_params(temperature, top_p, top_k, seed, self.tokenizer.sampling_defaults, **penalties)

    def stop_ids(self, body: dict) -> frozenset[int]:
        """The ids that end a generation: the tokenizer's (end of sequence, end of turn), none with vLLM's
        `ignore_eos: true` (generation then runs to max_tokens or a stop string)."""
        ignore = body.get("ignore_eos", False)
        if not isinstance(ignore, bool):
            raise _bad(f"ignore_eos must be true or false, got {json.dumps(ignore)[:80]}", "ignore_eos")
        return frozenset() if ignore else frozenset(self.tokenizer.stop_ids)

    def stop_strings(self, body: dict) -> list[str]:
        stop = body.get("stop")
        if stop is None:
            return []
        stop = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)) or len(stop) > MAX_STOP_STRINGS:
            raise _bad(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
        return stop

    def logprobs(self, body: dict, chat: bool) -> int | None:
        """How many most likely tokens to report beside each token's log-probability; None: no logprobs.
        Chat: `logprobs` true, `top_logprobs` in [0, 20] (a top_logprobs above 0 without logprobs is an
        error, as in OpenAI's API and vLLM). Completions: the legacy `logprobs`, an integer in [0, 5]."""
        if not chat:
            if body.get("top_logprobs") not in (None, 0):
                raise _bad("top_logprobs is a parameter of /v1/chat/completions; /v1/completions takes logprobs "
                           f"(an integer in [0, {MAX_COMPLETION_LOGPROBS}])", "top_logprobs")
            if body.get("logprobs") is False:
                return None
            return _number(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS, integer=True)
        asked = body.get("logprobs")
        if not (asked is None or isinstance(asked, bool)):
            raise _bad(f"logprobs must be true or false, got {json.dumps(asked)[:80]}", "logprobs")
        top = _number(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
        if not asked:
            if top:
                raise _bad("top_logprobs requires logprobs to be true", "top_logprobs")
            return None
        return top or 0

    def check_common(self, body: dict) -> None:
        if body.get("model") not in (None, self.model_name):
            raise APIError(404, f"The model `{body.get('model')}` does not exist (this server serves "
                                f"`{self.model_name}`)", "model", "model_not_found")
        if _number(body, "n", 1, 1, 2**31, integer=True) != 1:
            raise _bad("n must be 1: this server returns one choice per prompt", "n")
        for key, neutral in UNSUPPORTED.items():
            if key in body and body[key] not in neutral:
                raise _bad(f"{key} is not supported by this server", key)
        ignored = sorted(k for k in body if k not in ACCEPTED and k not in INERT and k not in UNSUPPORTED)
        if ignored:
            log.warning("The following fields were present in the request but ignored: %s", ignored)

    def max_tokens(self, body: dict, prompt_len: int, default: int | None, prompt_key: str = "prompt") -> int:
        """The request's max_tokens (or max_completion_tokens); `default` when absent (None: what the model
        length leaves after the prompt).

        Raises:
            APIError: 400 for a value that is not an integer >= 1, or a prompt (`prompt_key`: "prompt" or
                "messages") and completion past the model length, with the numbers.
        """
        limit = self.max_model_len - prompt_len if self.max_model_len is not None else None
        value = body.get("max_completion_tokens", body.get("max_tokens"))
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if limit is not None and limit < 1:
            raise _bad(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                       f"{'messages' if prompt_key == 'messages' else 'prompt'} has {prompt_len} tokens, which "
                       "leaves no room for a completion. Please reduce the length of the "
                       f"{'messages' if prompt_key == 'messages' else 'prompt'}.", prompt_key)
        if value is None:
            value = default if default is not None else limit
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise _bad(f"{key} must be an integer >= 1, got {json.dumps(value)[:80]}", key)
        if limit is not None and value > limit:
            raise _bad(f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                       f"{prompt_len + value} tokens ({prompt_len} in the prompt, {value} in the completion). "
                       "Please reduce the prompt or the completion length.", key)
        return value

    def check(self, prompt_ids, sampling, max_tokens, stop_ids, where: str):
        try:
            return self.engine.check_request(prompt_ids, sampling, max_tokens, stop_ids, where)
        except ValueError as e:
            raise _bad(str(e), "prompt") from None

    # ------------------------------------------------------------------------------------------ running
    async def run(self, http: Request, checked) -> tuple[str, asyncio.Queue]:
        request_id = uuid.uuid4().hex
        try:
            return request_id, self.runner.submit(request_id, checked)
        except QueueFull as e:
            raise APIError(503, f"the server is busy ({e}); retry later", kind="server_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None


class _Watch:
    """Whether the client of a response that is not streamed went away, asked at most every `every` seconds
    (tokens arrive far more often; a streamed response learns it from Starlette, which cancels its generator)."""

    def __init__(self, http: Request, every: float = 0.1):
        self.http, self.every, self.last = http, every, time.monotonic()

    async def gone(self) -> bool:
        if time.monotonic() - self.last < self.every:
            return False
        self.last = time.monotonic()
        return await self.http.is_disconnected()


class _ClientGone(Exception):
    """The client of a response that is not streamed disconnected."""


async def _next(stream: asyncio.Queue, watch: _Watch | None, server: Server, request_id: str):
    """The request's next item; with a `watch`, aborts the request (and raises `_ClientGone`) once the
    client is gone."""
    if watch is None:
        return await stream.get()
    getter = asyncio.ensure_future(stream.get())  # one getter throughout: a cancelled get could lose an item
    while True:
        done, _ = await asyncio.wait({getter}, timeout=watch.every)
        if await watch.gone():
            getter.cancel()
            server.runner.abort(request_id)
            raise _ClientGone
        if done:
            return getter.result()


# A token's logprobs as a response carries them: (where its text starts in the choice's text, id, TokenLogprobs).
Logprobs = tuple[int, int, TokenLogprobs]


class _Choice:
    """One prompt's generation as the API shows it: text (and reasoning), finish reason, token counts and,
    when asked, each token's logprobs. A token's logprobs go out with the text that starts it, so a token a
    stop string cuts (its text starts at or after the cut) never does: the logprobs match the text sent.
    Reasoning tokens have theirs too (vLLM's `logprobs.content` covers every generated token)."""

    def __init__(self, server: Server, stop: list[str], reasoning: ReasoningSplitter | None, logprobs: bool = False):
        self.text = TextStream(server.tokenizer, stop, server.tokenizer.stop_ids)
        self.reasoning = reasoning
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.error: str | None = None
        self.reasoning_text = self.content = ""  # all of it so far (a response that is not streamed)
        self.logprobs: list[Logprobs] | None = [] if logprobs else None  # likewise, when asked
        self._pending: list[Logprobs] = []  # tokens whose text is not sent yet

    def take(self, item) -> tuple[str, str, list[Logprobs]]:
        """(reasoning delta, content delta, the logprobs of the tokens their text starts) of one queue item
        (also added to `reasoning_text`, `content`, `logprobs`)."""
        r, c = self._take(item)
        self.reasoning_text, self.content = self.reasoning_text + r, self.content + c
        if self.logprobs is None:
            return r, c, []
        # offsets never decrease: the tokens whose text starts before what was sent lead the list
        done = len(self._pending) if isinstance(item, Finished) and not self.text.stopped else \
            sum(1 for offset, _, _ in self._pending if offset < self.text.sent)
        released, self._pending = self._pending[:done], self._pending[done:]
        self.logprobs += released
        return r, c, released

    def _take(self, item) -> tuple[str, str]:
        if isinstance(item, Finished):
            self.prompt_tokens, self.cached_tokens, self.error = item.prompt_tokens, item.cached_tokens, item.error
            text = self.text.finish()
            parts = self._split(text)
            if self.reasoning is not None:
                r, c = self.reasoning.finish()
                parts = (parts[0] + r, parts[1] + c)
            return parts
        out: RequestOutput = item
        self.completion_tokens += len(out.new_token_ids)
        text = ""
        for i, token in enumerate(out.new_token_ids):
            if out.logprobs is not None and not self.text.stopped:
                self._pending.append((self.text.offset, token, out.logprobs[i]))
            text += self.text.add([token])
        if out.finished:
            self.finish_reason = "stop" if out.finish_reason in ("stop", "abort") else out.finish_reason
        if self.text.stopped:
            self.finish_reason = "stop"
        return self._split(text)

    def _split(self, text: str) -> tuple[str, str]:
        return self.reasoning.feed(text) if self.reasoning is not None else ("", text)


def _token(tokenizer, token_id: int, logprob: float) -> dict:
    # -9999.0 for -inf (JSON has no infinity), as OpenAI and vLLM
    return {"token": tokenizer.token_text(token_id), "logprob": max(logprob, -9999.0),
            "bytes": list(tokenizer.token_bytes(token_id))}


def chat_logprobs(tokenizer, tokens: list[Logprobs]) -> dict:
    """A chat choice's `logprobs` for these tokens: {"content": [{token, logprob, bytes, top_logprobs:
    [{token, logprob, bytes}, ...] (the most likely first)}, ...]}."""
    return {"content": [{**_token(tokenizer, token_id, lp.logprob),
                         "top_logprobs": [_token(tokenizer, i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
                        for _, token_id, lp in tokens]}


def completion_logprobs(tokenizer, tokens: list[Logprobs]) -> dict:
    """A legacy completion choice's `logprobs` for these tokens: tokens, token_logprobs, top_logprobs (per
    token {text: logprob} of the k most likely and of the sampled token: up to k + 1, as OpenAI says),
    text_offset (where each token's text starts in the choice's text)."""
    tops = []
    for _, token_id, lp in tokens:
        top: dict[str, float] = {}
        for i, v in [*zip(lp.top_ids, lp.top_logprobs), (token_id, lp.logprob)]:
            top.setdefault(tokenizer.token_text(i), max(v, -9999.0))
        tops.append(top)
    return {"tokens": [tokenizer.token_text(t) for _, t, _ in tokens],
            "token_logprobs": [max(lp.logprob, -9999.0) for _, _, lp in tokens],
            "top_logprobs": tops, "text_offset": [offset for offset, _, _ in tokens]}


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="hybrid", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(http: Request, e: StarletteHTTPException):  # an unknown route or method, in OpenAI's form
        message = {404: f"Invalid URL ({http.method} {http.url.path})",
                   405: f"method {http.method} is not allowed on {http.url.path}"}
        return APIError(e.status_code, message.get(e.status_code, str(e.detail)),
                        headers=getattr(e, "headers", None)).response()

    def check_access(http: Request) -> None:
        """The API key and the body size, before anything else (a plain check in each /v1/ handler: a
        Starlette `BaseHTTPMiddleware` would make `is_disconnected` report a disconnect that did not happen)."""
        if server.api_key is not None and http.headers.get("authorization") != f"Bearer {server.api_key}":
            raise APIError(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
        length = http.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is {int(length):,} bytes, more than the limit of {MAX_BODY_BYTES:,}")

    async def body_of(http: Request) -> dict:
        check_access(http)
        raw = await http.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is more than the limit of {MAX_BODY_BYTES:,} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise _bad("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        server.check_common(body)
        return body

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(http: Request):
        check_access(http)
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "hybrid", "max_model_len": server.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(exposition(server.runner))

    async def generate(http: Request, body: dict, prompts: list[list[int]], chat: bool, in_thinking: bool = False):
        top_logprobs = server.logprobs(body, chat)
        sampling = dataclasses.replace(server.sampling(body), logprobs=top_logprobs)
        stop = server.stop_strings(body)
        stop_ids = server.stop_ids(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("stream must be true or false", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise _bad("stream_options must be an object", "stream_options")
        usage_in_stream = bool(options.get("include_usage", False))
        default = None if chat else 16
        checked = []
        for i, ids in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            max_tokens = server.max_tokens(body, len(ids), default, "messages" if chat else "prompt")
            checked.append(server.check(ids, sampling, max_tokens, stop_ids, where))
        runs = []
        try:
            for c in checked:
                runs.append(await server.run(http, c))
        except APIError:
            for request_id, _ in runs:
                server.runner.abort(request_id)
            raise
        choices = [_Choice(server, stop, ReasoningSplitter(in_thinking) if chat and server.thinks else None,
                           top_logprobs is not None) for _ in runs]
        format_logprobs = chat_logprobs if chat else completion_logprobs
        kind = "chat.completion" if chat else "text_completion"
        response_id = ("chatcmpl-" if chat else "cmpl-") + runs[0][0]
        created = int(time.time())

        def usage() -> dict:
            p = sum(c.prompt_tokens for c in choices)
            g = sum(c.completion_tokens for c in choices)
            return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g,
                    "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in choices)}}

        if not stream:
            watch = _Watch(http)
            try:
                for (request_id, queue), choice in zip(runs, choices):
                    while True:
                        item = await _next(queue, watch, server, request_id)
                        choice.take(item)
                        if isinstance(item, Finished):
                            break
                        if choice.text.stopped:
                            server.runner.abort(request_id)
                    if choice.error:
                        raise APIError(500, f"generation failed: {choice.error}", kind="server_error")
            except (_ClientGone, asyncio.CancelledError) as e:
                for request_id, _ in runs:
                    server.runner.abort(request_id)
                if isinstance(e, _ClientGone):  # nobody to answer (nginx's 499: client closed request)
                    return Response(status_code=499)
                raise
            out = []
            for i, choice in enumerate(choices):
                reasoning, content = choice.reasoning_text, choice.content
                logprobs = None if choice.logprobs is None else format_logprobs(server.tokenizer, choice.logprobs)
                if chat:
                    message = {"role": "assistant", "content": content}
                    if choice.reasoning is not None:
                        message["reasoning_content"] = reasoning
                    out.append({"index": i, "message": message, "logprobs": logprobs,
                                "finish_reason": choice.finish_reason})
                else:
                    out.append({"index": i, "text": content, "logprobs": logprobs,
                                "finish_reason": choice.finish_reason})
            return {"id": response_id, "object": kind, "created": created, "model": server.model_name,
                    "choices": out, "usage": usage()}

        async def events():
            chunk_kind = "chat.completion.chunk" if chat else "text_completion"

            def chunk(i: int, delta: dict | str, finish=None, logprobs: dict | None = None) -> str:
                choice = ({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish} if chat
                          else {"index": i, "text": delta, "logprobs": logprobs, "finish_reason": finish})
                body = {"id": response_id, "object": chunk_kind, "created": created, "model": server.model_name,
                        "choices": [choice]}
                if usage_in_stream:
                    body["usage"] = None
                return f"data: {json.dumps(body)}\n\n"

            try:
                for i, ((request_id, queue), choice) in enumerate(zip(runs, choices)):
                    if chat:
                        yield chunk(i, {"role": "assistant", "content": ""})
                    while True:
                        item = await _next(queue, None, server, request_id)
                        r, c, released = choice.take(item)
                        logprobs = None if choice.logprobs is None else format_logprobs(server.tokenizer, released)
                        if chat:
                            delta = {}
                            if r:
                                delta["reasoning_content"] = r
                            if c:
                                delta["content"] = c
                            if delta or released:
                                yield chunk(i, delta, logprobs=logprobs)
                        elif c or released:
                            yield chunk(i, c, logprobs=logprobs)
                        if isinstance(item, Finished):
                            break
                        if choice.text.stopped:
                            server.runner.abort(request_id)
                    if choice.error:
                        error = {"error": {"message": f"generation failed: {choice.error}", "type": "server_error"}}
                        yield f"data: {json.dumps(error)}\n\n"
                        break
                    yield chunk(i, {} if chat else "", choice.finish_reason)
                if usage_in_stream:
                    body = {"id": response_id, "object": chunk_kind, "created": created, "model": server.model_name,
                            "choices": [], "usage": usage()}
                    yield f"data: {json.dumps(body)}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # a client that went away (or any end) frees every request of the response
                for request_id, _ in runs:
                    server.runner.abort(request_id)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(http: Request):
        body = await body_of(http)
        prompt = body.get("prompt")
        tok = server.tokenizer
        if isinstance(prompt, str):
            prompts = [tok.encode(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = [tok.encode(p) for p in prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            prompts = prompt
        else:
            raise _bad("prompt must be a string, a list of strings, a list of token ids or a list of them", "prompt")
        return await generate(http, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        body = await body_of(http)
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
            raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m.get("content"), (str, type(None))):
                raise _bad(f"messages[{i}].content must be a string (content parts are not supported)", "messages")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _bad("chat_template_kwargs must be an object", "chat_template_kwargs")
        if server.tokenizer.chat_template is None:
            raise _bad(f"the model `{server.model_name}` has no chat template, so /v1/chat/completions cannot "
                       "render messages; use /v1/completions with a prompt", "messages")
        try:
            prompt = render_chat(server.tokenizer, messages, kwargs)
        except ValueError as e:
            raise _bad(str(e), "messages") from None
        return await generate(http, body, [prompt.ids], chat=True, in_thinking=prompt.opened_thinking)

    return app
