"""The OpenAI-compatible HTTP API (Starlette, served by uvicorn): /v1/chat/completions, /v1/completions,
/v1/models, /health, /metrics.

Streams are Server-Sent Events: `data: {chunk}` frames, the usage chunk (`choices: []`) when
`stream_options.include_usage` is set, then `data: [DONE]`. A client that disconnects aborts its request, which
frees its batch slot before the next device dispatch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dsjax.chat import OutputParser
from dsjax.serving.auth import ApiKey
from dsjax.serving.openai_protocol import ApiError, GenParams, parse_chat, parse_completion
from dsjax.serving.scheduler import RequestOutput
from dsjax.serving.service import Service
from dsjax.serving.text import OutputText


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _read_json(request: Request, max_bytes: int):
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body has {declared} bytes; the limit is {max_bytes}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise ApiError(413, f"the request body exceeds the limit of {max_bytes} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        _check_text(data, "")
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply") from None
    return data


def _check_text(value, where: str) -> None:
    """JSON may escape lone surrogates (\\ud800), which are not text; refuse them with the field's name."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"{where or 'the body'} contains an unpaired surrogate (invalid Unicode)",
                           where or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            _check_text(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{where}[{i}]")


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _Responder:
    """One response being assembled: text, stop strings, usage and logprobs over the request's outputs."""

    def __init__(self, svc: Service, p: GenParams, ids: list[int], *, chat: bool, thinking: bool = False):
        self.svc, self.p, self.ids, self.chat, self.thinking = svc, p, ids, chat, thinking
        tok = svc.tokenizer
        # chat output keeps control tokens for the parser (</think>, DSML, EOS); completions drop them
        self.text = OutputText(tok, p.stop, skip_special_tokens=not chat)
        self.parser = OutputParser(svc.info.family, thinking) if chat else None
        self.finish: str | None = None
        self.error: str | None = None
        self.reasoning_tokens = 0
        self._in_reasoning = thinking
        self.tool_calls = 0
        self.cached_tokens = 0

    def consume(self, out: RequestOutput):
        """-> (new text, logprob entries, finished) for one scheduler output."""
        self.cached_tokens = out.cached_tokens
        used_before = self.text.tokens_used
        delta = self.text.add(out.tokens)
        n = self.text.tokens_used - used_before
        if self._in_reasoning:
            ids = out.tokens[:n]
            end = self.svc.tokenizer.special.think_end
            self.reasoning_tokens += ids.index(end) + 1 if end in ids else len(ids)
            self._in_reasoning = end not in ids
        entries = self._logprobs(out, n) if self.p.logprobs else []
        if self.text.stopped:
            self.finish = "stop"
        elif out.finish_reason is not None:
            self.finish = out.finish_reason  # stop | length | abort | error
            self.error = out.error
            delta += self.text.flush()
        return delta, entries, self.finish is not None

    def _logprobs(self, out: RequestOutput, n: int) -> list:
        dec = self.svc.tokenizer.decode
        return [(dec([t]), lp, [(dec([i]), l) for i, l in top[:self.p.top_logprobs]])
                for t, lp, top in zip(out.tokens[:n], out.logprobs[:n], out.top[:n])]

    def usage(self) -> dict:
        n = self.text.tokens_used
        u = {"prompt_tokens": len(self.ids), "completion_tokens": n, "total_tokens": len(self.ids) + n,
             "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.chat:
            u["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return u


def _chat_lp(entries) -> dict:
    def one(s, lp):
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    return {"content": [{**one(s, lp), "top_logprobs": [one(ts, tl) for ts, tl in top]} for s, lp, top in entries]}


def _completion_lp(entries, offset: int) -> dict:
    offsets, pos = [], offset
    for s, _, _ in entries:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": [s for s, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries], "text_offset": offsets}


async def _merge(streams):
    """(choice index, output) from several request streams as they arrive."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        async for out in stream:
            await queue.put((i, out))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while True:
            yield await queue.get()
    finally:
        for t in tasks:
            t.cancel()


def _usage(rs: list[_Responder]) -> dict:
    """One prompt, n completions: prompt tokens counted once (as OpenAI does), completion tokens summed."""
    u = rs[0].usage()
    for r in rs[1:]:
        more = r.usage()
        u["completion_tokens"] += more["completion_tokens"]
        u["total_tokens"] += more["completion_tokens"]
        if "completion_tokens_details" in u:
            u["completion_tokens_details"]["reasoning_tokens"] += more["completion_tokens_details"]["reasoning_tokens"]
    return u


def _tool_call_dict(call, index: int, rid: str) -> dict:
    return {"index": index, "id": f"call_{rid[-12:]}_{index}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def build_app(svc: Service, *, api_key: ApiKey, max_request_bytes: int = 1 << 20, metrics=None) -> Starlette:
    async def guarded(request: Request, handler):
        if request.url.path.startswith("/v1/") and not api_key.accepts_bearer(request.headers.get("authorization")):
            return _error(ApiError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                                   type="authentication_error", code="invalid_api_key"))
        try:
            return await handler(request)
        except ApiError as e:
            return _error(e)

    async def health(request: Request):
        ok = svc.ready and not svc.scheduler.draining
        return JSONResponse({"status": "ok" if ok else ("draining" if svc.scheduler.draining else "starting")},
                            status_code=200 if ok else 503)

    async def models(request: Request):
        i = svc.info
        return JSONResponse({"object": "list", "data": [
            {"id": i.id, "object": "model", "created": i.created, "owned_by": "dsjax", "root": i.source,
             "max_model_len": i.max_model_len}]})

    async def metrics_route(request: Request):
        return Response(metrics.exposition(), media_type=metrics.content_type) if metrics else Response(status_code=404)

    async def run(request: Request, p: GenParams, ids: list[int], *, chat: bool, thinking: bool, max_tokens: int,
                  images=None):
        """Submit the request (n of them for `n` choices: seeds seed, seed+1, ...) and answer, streamed or whole."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        subs: list[tuple[str, object]] = []
        key = p.conversation or request.headers.get("x-conversation-id")
        # image spans carry the same token id whatever the image: their KV is never shared between requests
        conv = None if images is not None else await svc.conversation(
            key, api_key.tenant(request.headers.get("authorization")), ids)
        try:
            for i in range(p.n):
                sampling = dataclasses.replace(p.sampling, seed=p.sampling.seed + i)
                subs.append(svc.submit(ids, max_tokens, sampling=sampling, top_logprobs=p.top_logprobs,
                                       stop_token_ids=p.stop_token_ids, request_id=rid if p.n == 1 else f"{rid}-{i}",
                                       conversation=conv if i == 0 else None, images=images))
        except ApiError:
            for sid, _ in subs:
                svc.abort(sid)
            raise
        rs = [_Responder(svc, p, ids, chat=chat, thinking=thinking) for _ in subs]
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": svc.info.id}
        merged = _merge([stream for _, stream in subs])
        if p.stream:
            return StreamingResponse(_stream(subs, merged, rs, base, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        watcher = asyncio.create_task(_abort_on_disconnect(request, [sid for sid, _ in subs]))
        texts, entries, open_ = [""] * p.n, [[] for _ in subs], set(range(p.n))
        try:
            async for i, out in merged:
                if i not in open_:
                    continue
                delta, lps, done = rs[i].consume(out)
                texts[i] += delta
                entries[i] += lps
                if done:
                    open_.discard(i)
                    if not open_:
                        break
        finally:
            watcher.cancel()
            await merged.aclose()
            for (sid, _), r in zip(subs, rs):
                if r.finish is None or r.text.stopped:
                    svc.abort(sid, "stop")
        failed = [r for r in rs if r.finish == "error"]
        if failed:
            raise ApiError(500, failed[0].error or "generation failed", type="server_error")
        usage = _usage(rs)
        if not chat:
            choices = [{"index": i, "text": t, "logprobs": _completion_lp(e, 0) if p.logprobs else None,
                        "finish_reason": r.finish} for i, (t, e, r) in enumerate(zip(texts, entries, rs))]
            return JSONResponse({**base, "choices": choices, "usage": usage})
        choices = []
        for i, (text, e, r) in enumerate(zip(texts, entries, rs)):
            r.parser.feed(text)
            parsed = r.parser.finish()
            message = parsed.to_openai_message()
            finish = r.finish
            if parsed.tool_calls:
                message["tool_calls"] = [_tool_call_dict(c, k, f"{rid}{i}") for k, c in enumerate(parsed.tool_calls)]
                finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": i, "message": message, "logprobs": _chat_lp(e) if p.logprobs else None,
                            "finish_reason": finish})
        return JSONResponse({**base, "object": "chat.completion", "choices": choices, "usage": usage})

    async def _abort_on_disconnect(request: Request, rids: list[str]):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for rid in rids:
                    svc.abort(rid)
                return

    async def _stream(subs, merged, rs: list[_Responder], base: dict, chat: bool):
        n = len(rs)
        open_ = set(range(n))
        offsets = [0] * n

        def frame(i, **fields):
            if chat:
                return _sse({**base, "choices": [{"index": i, "delta": fields.get("delta", {}),
                                                  "logprobs": fields.get("logprobs"),
                                                  "finish_reason": fields.get("finish_reason")}]})
            return _sse({**base, "choices": [{"index": i, "text": fields.get("text", ""),
                                              "logprobs": fields.get("logprobs"),
                                              "finish_reason": fields.get("finish_reason")}]})

        try:
            if chat:
                for i in range(n):
                    yield frame(i, delta={"role": "assistant", "content": ""})
            async for i, out in merged:
                if i not in open_:
                    continue
                r = rs[i]
                delta, lps, done = r.consume(out)
                if chat:
                    events = r.parser.feed(delta) + (r.parser.flush() if done else [])
                    for d in _deltas(events, r, f"{base['id']}{i}"):
                        yield frame(i, delta=d)
                    if lps:
                        yield frame(i, logprobs=_chat_lp(lps))
                elif delta or lps:
                    yield frame(i, text=delta, logprobs=_completion_lp(lps, offsets[i]) if r.p.logprobs else None)
                    offsets[i] += len(delta)
                if done:
                    open_.discard(i)
                    if r.finish == "error":
                        yield _sse({"error": {"message": r.error or "generation failed", "type": "server_error",
                                              "param": None, "code": None}})
                    else:
                        finish = "tool_calls" if chat and r.tool_calls and r.finish == "stop" else r.finish
                        yield frame(i, finish_reason=finish)
                    if not open_:
                        break
            if rs[0].p.include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(rs)})
            yield b"data: [DONE]\n\n"
        finally:
            await merged.aclose()
            for (sid, _), r in zip(subs, rs):
                if r.finish is None or r.text.stopped:
                    svc.abort(sid, "stop" if r.finish else "abort")

    def _deltas(events, r: _Responder, rid: str):
        for e in events:
            if e.kind == "reasoning":
                yield {"reasoning_content": e.text}
            elif e.kind == "content":
                yield {"content": e.text}
            else:
                yield {"tool_calls": [_tool_call_dict(e.tool_call, r.tool_calls, rid)]}
                r.tool_calls += 1

    async def chat_completions(request: Request):
        p = parse_chat(await _read_json(request, max_request_bytes), svc.limits)
        svc.check_model(p.model)
        ids, thinking = svc.chat_prompt(p)
        images = None
        if p.images:
            images = svc.image_prompt(ids, p.images)
            ids = images.ids.tolist()
        max_tokens = svc.budget(ids, p.max_tokens, "messages")
        return await run(request, p, ids, chat=True, thinking=thinking, max_tokens=max_tokens, images=images)

    async def completions(request: Request):
        p = parse_completion(await _read_json(request, max_request_bytes), svc.limits)
        svc.check_model(p.model)
        try:
            ids = svc.completion_prompt(p)
        except ValueError as e:
            raise ApiError(400, f"prompt could not be tokenized: {e}", "prompt") from None
        max_tokens = svc.budget(ids, p.max_tokens, "prompt")
        return await run(request, p, ids, chat=False, thinking=False, max_tokens=max_tokens)

    def route(path, handler, methods):
        async def endpoint(request: Request):
            return await guarded(request, handler)
        return Route(path, endpoint, methods=methods)

    routes = [route("/health", health, ["GET"]), route("/metrics", metrics_route, ["GET"]),
              route("/v1/models", models, ["GET"]), route("/v1/chat/completions", chat_completions, ["POST"]),
              route("/v1/completions", completions, ["POST"])]
    return Starlette(routes=routes)
