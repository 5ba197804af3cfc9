"""The HTTP side: FastAPI routes over an ``EngineWorker`` (async; never runs the model).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming SSE or
not), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Every error is an
OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``.

Limits (``Limits``): the API key and the body size are checked by ``guard.Guard`` before
a route runs; here, a request is refused with 429 and ``Retry-After`` when ``max_queue``
requests already wait for their first token, or when its prompt would push the tokens
waiting past ``max_queued_prompt_tokens``; ``timeout`` is passed to the engine thread,
which ends a request past it (504, or an SSE error event once streaming).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.scheduler import PRIORITY_POLICIES
from . import metrics, protocol
from .guard import BodyTooLarge, Guard
from .logprobs import Entry, LogprobsFormatter
from .protocol import APIError
from .worker import SHUTDOWN_MESSAGE, LoopSink, RequestTimeout

log = logging.getLogger("kvmetal.serve")

WAIT_POLL_S = 0.25  # how often a waiting handler checks whether its client is still there


@dataclass
class Limits:
    """The server's refusal rules (``--api-key``, ``--max-body-bytes``, ``--max-queue``,
    ``--max-prompt-tokens``, ``--timeout``); None: no limit."""

    api_key: str | None = None
    max_body_bytes: int | None = None
    max_queue: int | None = None  # requests waiting for their first token
    max_queued_prompt_tokens: int | None = None  # prompt tokens of those requests together
    timeout: float | None = None  # seconds a request may take from its arrival


class Queue:
    """Requests submitted that have not had their first token yet (the event loop's thread
    only), and how long the last ones waited (the Retry-After hint)."""

    def __init__(self):
        self.requests = 0
        self.prompt_tokens = 0
        self.wait_s = 1.0  # a running mean of the wait for the first token

    def retry_after(self) -> str:
        return str(max(1, math.ceil(self.wait_s)))

    def enter(self, tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += tokens

    def leave(self, tokens: int, waited_s: float | None) -> None:
        self.requests -= 1
        self.prompt_tokens -= tokens
        if waited_s is not None:
            self.wait_s = 0.8 * self.wait_s + 0.2 * waited_s


@dataclass
class ServeState:
    """What the routes need: the worker, the tokenizer and the server's defaults."""

    worker: object  # EngineWorker
    tokenizer: object  # mlx-lm TokenizerWrapper
    model_id: str
    defaults: protocol.Defaults = field(default_factory=protocol.Defaults)
    context_limit: int | None = None  # the model's max_position_embeddings, if it says
    chat_template_kwargs: dict = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    created: int = field(default_factory=lambda: int(time.time()))
    queue: Queue = field(default_factory=Queue)
    rejected: dict = field(default_factory=dict)  # HTTP status -> requests answered with a 4xx
    model_path: str | None = None  # the model directory, when model_id is a name

    # Computed once, on first use (a test's stand-in tokenizer may lack what they need).
    @functools.cached_property
    def model_names(self) -> frozenset:
        """The names a request's "model" may give: the id /v1/models lists, the directory as
        given, resolved or by its last component, and "default_model"."""
        names = {self.model_id, "default_model"}
        for path in {self.model_id, self.model_path} - {None}:
            names |= {path, Path(path).name, str(Path(path).resolve())}
        return frozenset(names)

    @functools.cached_property
    def eos_ids(self) -> frozenset:
        return frozenset(int(t) for t in getattr(self.tokenizer, "eos_token_ids", ()) or ())

    @functools.cached_property
    def vocab_size(self) -> int | None:
        """The model's logits width (its config's vocab_size, what the engine checks token
        ids against), else the tokenizer's size; None when neither is known."""
        engine = getattr(self.worker, "engine", None)
        size = getattr(getattr(getattr(engine, "model", None), "args", None), "vocab_size", None)
        if isinstance(size, int) and not isinstance(size, bool):
            return size
        try:
            return len(self.tokenizer)
        except TypeError:
            return None

    @functools.cached_property
    def xtc_special_tokens(self) -> tuple:
        """What mlx_lm.server keeps out of XTC's cut: the newline and the end tokens."""
        return tuple(self.tokenizer.encode("\n")) + tuple(getattr(self.tokenizer, "eos_token_ids", ()) or ())


# mlx-lm's BPE and SentencePiece streaming detokenizers drop the first token's leading space
# while their text is empty: right for a chat answer, wrong for a completion, whose text
# continues the prompt (" Paris" after "The capital of France is"). Priming the text with one
# character keeps that space; the primer is cut from everything handed out.
_PRIMER = "\x00"


class TextStream:
    """Token ids -> text pieces for one request, with stop strings held back and cut.
    ``keep_leading_space``: a completion's text starts with its first token's space, as
    OpenAI's /v1/completions returns it."""

    def __init__(self, tokenizer, stop: list, *, keep_leading_space: bool = False):
        self.detokenizer = tokenizer.detokenizer
        self.primer = 0  # characters of _PRIMER at the start of the detokenizer's text
        text_attr = getattr(type(self.detokenizer), "text", None)
        if keep_leading_space and not isinstance(text_attr, property):  # the naive one trims nothing
            self.detokenizer.text = _PRIMER
            self.primer = len(_PRIMER)
        self.stop = stop
        self.sent = 0  # characters already handed out
        self.stopped = False  # a stop string was found

    def _text(self) -> str:
        return self.detokenizer.text[self.primer:]

    def add(self, token: int) -> int:
        """Add a token; returns where its text starts (characters of the output so far)."""
        offset = len(self._text())
        self.detokenizer.add_token(token)
        return offset

    def take(self, final: bool = False) -> str:
        """New text that is safe to send (all of it when ``final``)."""
        if final:
            self.detokenizer.finalize()
        text = self._text()
        if self.stop:
            hits = [i for i in (text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                end = min(hits)
                piece, self.sent = text[self.sent:end], max(self.sent, end)
                return piece
        end = len(text)
        if not final:  # hold back a tail that may be the start of a stop string
            for s in self.stop:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        end = min(end, len(text) - k)
                        break
        end = max(end, self.sent)
        piece, self.sent = text[self.sent:end], end
        return piece


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)


def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="kvmetal serve", docs_url=None, redoc_url=None)
    app.state.serve = state
    app.add_middleware(Guard, api_key=state.limits.api_key, max_body_bytes=state.limits.max_body_bytes,
                       rejected=state.rejected)

    def refused(status: int) -> None:
        """Count a 4xx answer (the guard counts its own 401s and 413s)."""
        if 400 <= status < 500:
            state.rejected[status] = state.rejected.get(status, 0) + 1

    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        if not isinstance(e, BodyTooLarge):
            refused(e.status)
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, e: StarletteHTTPException):  # unknown route (404), wrong method (405)
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        refused(e.status_code)
        return _error(APIError(str(e.detail), status=e.status_code, type_=kind))

    @app.exception_handler(Exception)
    async def internal_error(_request, e: Exception):
        log.exception("unexpected error")
        return _error(APIError(f"internal error: {type(e).__name__}: {e}", status=500, type_="server_error"))

    @app.get("/health")
    async def health():
        if state.worker.failed or state.worker.stopping:
            return JSONResponse({"status": "error", "detail": state.worker.failed}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.created,
                                            "owned_by": "kvmetal"}]}

    @app.get("/metrics")
    async def metrics_text():
        snapshot = state.worker.snapshot()
        snapshot["http_rejected"] = dict(state.rejected)
        return PlainTextResponse(metrics.render(snapshot),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(state, request, chat=True)

    return app


async def _json_body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError("the request body is nested too deeply") from None


def _check_unicode(req: protocol.GenerationRequest) -> None:
    """400 for text that is no valid Unicode: JSON can escape a lone surrogate ("\\ud800"),
    which no tokenizer can encode."""
    if req.chat:
        texts = [("messages", m.get("content") or "") for m in req.prompt]
        texts += [("messages", m["role"]) for m in req.prompt]
    else:
        texts = [("prompt", req.prompt)] if isinstance(req.prompt, str) else []
    for param, text in texts + [("stop", s) for s in req.stop]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(f"'{param}' is not valid Unicode text: {e}", param=param) from None


def _tokenize(state: ServeState, req: protocol.GenerationRequest) -> list:
    tokenizer = state.tokenizer
    if not req.chat:
        return list(req.prompt) if isinstance(req.prompt, list) else list(tokenizer.encode(req.prompt))
    messages = [dict(m) for m in req.prompt]  # tool calls and tool results go to the template as sent
    if getattr(tokenizer, "has_chat_template", False):
        kwargs = {**state.chat_template_kwargs, **req.chat_template_kwargs}
        if req.tools:
            kwargs["tools"] = req.tools
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        except Exception as e:  # the template rejected the conversation (e.g. role order)
            raise APIError(f"the chat template failed on these messages: {e}", param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return list(tokenizer.encode(_plain_chat(messages, req.role_mapping)))


def with_default_stop(state: ServeState, req: protocol.GenerationRequest) -> protocol.GenerationRequest:
    """A chat for a model without a chat template (a base model, prompted with "role:
    content" lines) also stops where a new turn starts: :data:`protocol.PLAIN_CHAT_STOP`
    ("\\nuser:", "\\nassistant:") and "\\n<role>:" for each other role of the messages;
    such a model otherwise writes the next turns itself. Added to the request's own stop
    strings; not with ``role_mapping`` (the caller chose the format) nor with a chat template."""
    if not req.chat or req.role_mapping is not None or getattr(state.tokenizer, "has_chat_template", False):
        return req
    stops = list(protocol.PLAIN_CHAT_STOP) + [f"\n{m['role']}:" for m in req.prompt]
    return dataclasses.replace(req, stop=list(req.stop) + [s for s in dict.fromkeys(stops) if s not in req.stop])


def _plain_chat(messages: list, role_mapping: dict | None) -> str:
    """The prompt of a tokenizer without a chat template. With ``role_mapping``, mlx_lm.server's
    format (each message as role prefix + content + "stop", then the assistant prefix,
    trailing whitespace stripped); without, "role: content" lines and "assistant:"."""
    if role_mapping is None:
        # no space after the last colon (mlx_lm.server strips its prompt likewise): a BPE
        # model's answer starts with its own " word" token; after "assistant: " base Gemma
        # answered "What is the capital of France?" with "19th century"
        return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + "assistant:"
    stop = role_mapping.get("stop", "")
    text = "".join(f"{role_mapping.get(m['role'], '')}{m.get('content') or ''}{stop}" for m in messages)
    return (text + role_mapping.get("assistant", "")).rstrip()


async def _generate(state: ServeState, request: Request, *, chat: bool):
    body = await _json_body(request)
    req = with_default_stop(state, protocol.parse(body, chat=chat, defaults=state.defaults))
    model = body.get("model")
    if model is not None and model not in state.model_names:
        raise APIError(f"the model '{model}' does not exist; this server serves '{state.model_id}'",
                       status=404, param="model", type_="not_found_error", code="model_not_found")
    worker = state.worker
    if worker.failed:
        raise APIError(worker.failed, status=503, type_="server_error")
    _check_unicode(req)
    prompt = await asyncio.to_thread(_tokenize, state, req)  # a long prompt must not stall other streams
    if not prompt:
        raise APIError("the prompt encodes to no tokens", param="messages" if chat else "prompt")
    if not chat and isinstance(req.prompt, list) and max(prompt) >= len(state.tokenizer):
        raise APIError(f"token ids must be < {len(state.tokenizer)}, the tokenizer's size", param="prompt")
    vocab = state.vocab_size
    outside = [t for t, _ in req.sampling.logit_bias if vocab is not None and t >= vocab]
    if outside:  # here, not in the engine: a 400 naming the field, without the engine's prefix
        raise APIError(f"'logit_bias' token ids must be < {vocab}, the model's vocabulary size; got {outside[0]}",
                       param="logit_bias")
    max_tokens = protocol.check_fits(len(prompt), req, max_prompt=worker.max_prompt_tokens,
                                     max_total=worker.max_sequence_tokens, context_limit=state.context_limit)
    if req.priority and not worker.uses_priority:
        raise APIError(f"'priority' = {req.priority} needs a scheduling policy that reads it "
                       f"(kvmetal serve --scheduling-policy {' or '.join(PRIORITY_POLICIES)})", param="priority")
    _admit_to_queue(state, len(prompt), chat)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    loop = asyncio.get_running_loop()
    deliveries: asyncio.Queue = asyncio.Queue()
    sink = LoopSink(loop, deliveries)  # called on the engine thread
    eos = state.eos_ids
    sampling = req.sampling
    if sampling.xtc_probability > 0:
        sampling = dataclasses.replace(sampling, xtc_special_tokens=state.xtc_special_tokens)
    queued_at = time.monotonic()
    state.queue.enter(len(prompt))
    waited = None
    try:
        try:
            worker.submit(request_id, prompt, max_tokens=max_tokens, sampling=sampling, stop_token_ids=eos,
                          sink=sink, logprobs=req.logprobs, timeout=state.limits.timeout, priority=req.priority,
                          speculative=req.speculative)
        except RuntimeError as e:
            raise APIError(str(e), status=503, type_="server_error") from None
        run = _Run(state, req, request_id, prompt, eos, deliveries)
        # Wait for the first token before answering, so an engine-side rejection is still a 4xx.
        try:
            first = await run.next(request)
        except BaseException:
            worker.abort(request_id)
            raise
        waited = time.monotonic() - queued_at if first is not None and first.error is None else None
    finally:
        state.queue.leave(len(prompt), waited)
    if first is None:  # the client left while the request waited
        worker.abort(request_id)
        return JSONResponse({}, status_code=499)
    if first.error is not None:
        raise _as_api_error(first.error)
    if req.stream:
        return StreamingResponse(run.sse(first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await run.whole(first, request)


def _admit_to_queue(state: ServeState, prompt_tokens: int, chat: bool) -> None:
    """429 (with Retry-After) when the waiting queue is full; 400 when this prompt alone is
    over the queue's token bound (waiting cannot help it)."""
    limits, queue = state.limits, state.queue
    bound = limits.max_queued_prompt_tokens
    if bound is not None and prompt_tokens > bound:
        raise APIError(f"the prompt has {prompt_tokens} tokens; this server queues at most {bound} prompt tokens "
                       f"(--max-prompt-tokens)", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    why = None
    if limits.max_queue is not None and queue.requests >= limits.max_queue:
        why = f"{queue.requests} requests are waiting, the server's --max-queue"
    elif bound is not None and queue.prompt_tokens + prompt_tokens > bound:
        why = (f"{queue.prompt_tokens} prompt tokens are waiting and this request brings {prompt_tokens}; "
               f"the server's --max-prompt-tokens is {bound}")
    if why is not None:
        raise APIError(f"the server is busy: {why}; retry later", status=429, type_="rate_limit_error",
                       code="rate_limit_exceeded", headers={"Retry-After": queue.retry_after()})


def _as_api_error(error: BaseException) -> APIError:
    if isinstance(error, RequestTimeout):
        return APIError(str(error), status=504, type_="timeout_error", code="request_timeout")
    if isinstance(error, (ValueError, TypeError)):
        return APIError(str(error))
    return APIError(str(error), status=503 if SHUTDOWN_MESSAGE in str(error) else 500, type_="server_error")


class _Run:
    """One request's deliveries turned into OpenAI responses."""

    def __init__(self, state: ServeState, req, request_id: str, prompt: list, eos: frozenset, deliveries):
        self.state, self.req, self.id, self.prompt, self.eos = state, req, request_id, prompt, eos
        self.deliveries = deliveries
        self.text = TextStream(state.tokenizer, req.stop, keep_leading_space=not req.chat)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason = None
        self.created = int(time.time())
        self.logprobs = None if req.logprobs is None else LogprobsFormatter(state.tokenizer, chat=req.chat,
                                                                            top=req.logprobs)
        self.entries: list = []  # logprob entries not yet sent

    async def next(self, request: Request | None = None):
        """The next delivery; None if the client disconnected first (non-streaming wait)."""
        while True:
            try:
                return await asyncio.wait_for(self.deliveries.get(), WAIT_POLL_S)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    return None

    def _consume(self, delivery) -> str:
        """Apply one delivery; returns the text it makes safe to send."""
        event = delivery.event
        if self.completion_tokens == 0:  # as admitted first (a finished request is no longer looked up)
            self.cached_tokens = delivery.cached_prompt_tokens
        if event.token is not None:
            self.completion_tokens += 1
            if not (event.finish_reason == "stop" and event.token in self.eos):  # the end token is no text
                offset = self.text.add(event.token)
                if self.logprobs is not None and event.logprobs is not None:
                    self.entries.append(Entry(event.token, event.logprobs.logprob, event.logprobs.top, offset))
        if event.finished:
            self.finish_reason = "stop" if event.finish_reason == "stop" else "length"
        piece = self.text.take(final=event.finished)
        if self.text.stopped:
            if not event.finished:
                self.state.worker.abort(self.id, reason="stop")  # a stop string ended it: free its blocks now
            self.finish_reason = "stop"
        return piece

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": self.completion_tokens,
                "total_tokens": len(self.prompt) + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def _take_logprobs(self, *, delta: bool):
        """The logprobs object for the entries not sent yet (None when not asked for; in a
        stream chunk, also when there are none)."""
        if self.logprobs is None or (delta and not self.entries):
            return None
        entries, self.entries = self.entries, []
        return self.logprobs.format(entries)

    def _choice(self, text: str, finish_reason, *, delta: bool, first: bool = False) -> dict:
        logprobs = self._take_logprobs(delta=delta)
        if not self.req.chat:
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if not delta:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        content = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}

    def _envelope(self, choices: list, *, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.req.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.state.model_id,
                "system_fingerprint": "kvmetal", "choices": choices}

    async def whole(self, first, request: Request):
        pieces, delivery = [], first
        while True:
            if delivery is None:  # the client went away
                self.state.worker.abort(self.id)
                return JSONResponse({}, status_code=499)
            if delivery.error is not None:
                raise _as_api_error(delivery.error)
            pieces.append(self._consume(delivery))
            if self.done:
                break
            delivery = await self.next(request)
        body = self._envelope([self._choice("".join(pieces), self.finish_reason, delta=False)], chunk=False)
        body["usage"] = self.usage()
        return body

    async def sse(self, first):
        delivery, sent_first = first, False
        try:
            while True:
                if delivery.error is not None:
                    yield _sse(_as_api_error(delivery.error).body())
                    self.finish_reason = "error"
                    break
                piece = self._consume(delivery)
                if piece or not sent_first or self.done:
                    choice = self._choice(piece, self.finish_reason, delta=True, first=not sent_first)
                    yield _sse(self._envelope([choice], chunk=True))
                    sent_first = True
                if self.done:
                    if self.req.include_usage:
                        final = self._envelope([], chunk=True)
                        final["usage"] = self.usage()
                        yield _sse(final)
                    break
                delivery = await self.deliveries.get()
            yield "data: [DONE]\n\n"
        finally:
            if not self.done:  # the client disconnected mid-stream: free its blocks
                self.state.worker.abort(self.id)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"
