"""The gRPC front end (grpc.aio): `dsjax.serving.v1.Engine` (Generate, Abort, GetModelInfo), `grpc.health.v1`
and server reflection.

A cancelled call or an expired deadline cancels the handler's coroutine; its `finally` aborts the request, so the
slot is free before the next dispatch. Health and reflection need no key (probes and discovery); Engine calls
do when one is configured (`authorization: Bearer <key>` or `x-api-key: <key>` metadata).
"""

from __future__ import annotations

import math
import secrets
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dsjax.serving.auth import ApiKey
from dsjax.serving.engine import RowSampling
from dsjax.serving.openai_protocol import ApiError
from dsjax.serving.proto import engine_pb2 as pb
from dsjax.serving.proto import engine_pb2_grpc as pb_grpc
from dsjax.serving.service import Service
from dsjax.serving.text import OutputText

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Engine"].full_name
_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
           429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}
_FINISH = {"stop": pb.STOP, "length": pb.LENGTH, "abort": pb.ABORT}


def _sampling(s: pb.SamplingParams, has: bool) -> RowSampling:
    if not has:
        return RowSampling(seed=secrets.randbelow(2**31))
    for name in ("temperature", "top_p", "min_p"):
        if not math.isfinite(getattr(s, name)):
            raise ApiError(400, f"sampling.{name} must be finite", f"sampling.{name}")
    if s.temperature < 0:
        raise ApiError(400, f"sampling.temperature must be ≥ 0, got {s.temperature}", "sampling.temperature")
    if not 0 <= s.top_p <= 1:
        raise ApiError(400, f"sampling.top_p must lie in [0, 1], got {s.top_p}", "sampling.top_p")
    if not 0 <= s.min_p <= 1:
        raise ApiError(400, f"sampling.min_p must lie in [0, 1], got {s.min_p}", "sampling.min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(s, name)
        if not (math.isfinite(v) and -2 <= v <= 2):
            raise ApiError(400, f"sampling.{name} must lie in [-2, 2], got {v}", f"sampling.{name}")
    for t, v in s.logit_bias.items():
        if not (math.isfinite(v) and -100 <= v <= 100):
            raise ApiError(400, f"sampling.logit_bias[{t}] must lie in [-100, 100], got {v}", "sampling.logit_bias")
    seed = s.seed if s.HasField("seed") else secrets.randbelow(2**31)
    return RowSampling(temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k, min_p=s.min_p, seed=seed,
                       presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                       logit_bias=tuple(sorted(s.logit_bias.items())))


class EngineServicer(pb_grpc.EngineServicer):
    def __init__(self, svc: Service, api_key: ApiKey, metrics=None):
        self.svc, self.api_key, self.metrics = svc, api_key, metrics

    async def _authorize(self, context) -> None:
        if not self.api_key.required:
            return
        md = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
        if not (self.api_key.accepts_bearer(md.get("authorization")) or
                ("x-api-key" in md and self.api_key.accepts(md["x-api-key"]))):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key "
                                "(metadata authorization: Bearer <key>, or x-api-key)")

    async def _fail(self, context, e: ApiError):
        where = f" ({e.param})" if e.param else ""
        await context.abort(_STATUS.get(e.status, grpc.StatusCode.INTERNAL), e.message + where)

    async def GetModelInfo(self, request, context):
        await self._authorize(context)
        i = self.svc.info
        return pb.ModelInfo(model_id=i.id, source=i.source, family=i.family, max_model_len=i.max_model_len,
                            max_num_seqs=i.max_num_seqs, vocab_size=i.vocab_size, eos_token_id=i.eos_token_id,
                            max_logprobs=self.svc.limits.max_logprobs)

    async def Abort(self, request, context):
        await self._authorize(context)
        return pb.AbortResponse(found=self.svc.abort(request.request_id))

    async def Generate(self, request, context):
        await self._authorize(context)
        svc = self.svc
        try:
            kind = request.WhichOneof("input")
            if kind == "input_ids":
                ids = list(request.input_ids.ids)
            elif kind == "text":
                ids = [svc.tokenizer.special.bos] + svc.tokenizer.encode(request.text)
            else:
                raise ApiError(400, "set input_ids or text", "input")
            if len(request.stop) > svc.limits.max_stop:
                raise ApiError(400, f"at most {svc.limits.max_stop} stop strings", "stop")
            max_tokens = svc.budget(ids, request.max_tokens or None, "input")
            sampling = _sampling(request.sampling, request.HasField("sampling"))
            if len(request.conversation_id) > 256:
                raise ApiError(400, "conversation_id is longer than 256 characters", "conversation_id")
            md = dict(context.invocation_metadata() or ())
            conv = await svc.conversation(request.conversation_id, ApiKey.tenant(
                md.get("authorization") or (f"key {md['x-api-key']}" if "x-api-key" in md else None)), ids,
                context.time_remaining())
            rid, stream = svc.submit(ids, max_tokens, sampling=sampling,
                                     top_logprobs=request.top_logprobs, stop_token_ids=tuple(request.stop_token_ids),
                                     request_id=request.request_id or None, conversation=conv)
        except ApiError as e:
            await self._fail(context, e)
            return
        text = OutputText(svc.tokenizer, tuple(request.stop))
        t0, first, n, finished = time.monotonic(), None, 0, False
        try:
            async for out in stream:
                used = text.tokens_used
                delta = "" if request.skip_text else text.add(out.tokens)
                k = (text.tokens_used - used) if not request.skip_text else len(out.tokens)
                done = text.stopped or out.finish_reason is not None
                if out.finish_reason is not None and not text.stopped and not request.skip_text:
                    delta += text.flush()
                if out.finish_reason == "error":
                    finished = True
                    yield pb.GenerateResponse(request_id=rid, error=pb.Error(message=out.error or "generation failed"))
                    return
                if k:
                    first = first or time.monotonic()
                    n += k
                    lps = [pb.TokenLogprob(logprob=lp, top=[pb.TopLogprob(token_id=i, logprob=l) for i, l in top])
                           for lp, top in zip(out.logprobs[:k], out.top[:k])] if request.top_logprobs else []
                    yield pb.GenerateResponse(request_id=rid, chunk=pb.Chunk(
                        token_ids=out.tokens[:k], text=delta, logprobs=lps,
                        usage=pb.Usage(prompt_tokens=len(ids), completion_tokens=n, cached_tokens=out.cached_tokens)))
                if done:
                    finished = True
                    reason = pb.STOP_STRING if text.stopped else _FINISH.get(out.finish_reason, pb.STOP)
                    end = time.monotonic()
                    rate = (n - 1) / (end - first) if first and n > 1 and end > first else 0.0
                    yield pb.GenerateResponse(request_id=rid, complete=pb.Complete(
                        finish_reason=reason, usage=pb.Usage(prompt_tokens=len(ids), completion_tokens=n,
                                                             cached_tokens=out.cached_tokens),
                        ttft_s=(first or end) - t0, tokens_per_s=rate,
                        kv_source=out.kv_source))
                    if text.stopped:
                        svc.abort(rid, "stop")
                    return
        finally:
            if not finished:  # cancelled by the client or by its deadline
                svc.abort(rid)


class GrpcServer:
    """The aio server: Engine + health + reflection on one port."""

    def __init__(self, svc: Service, api_key: ApiKey, *, max_request_bytes: int, metrics=None):
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_request_bytes),
                                               ("grpc.so_reuseport", 0)])
        pb_grpc.add_EngineServicer_to_server(EngineServicer(svc, api_key, metrics), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self.port = 0

    def bind(self, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = (self.server.add_secure_port(addr, credentials) if credentials
                     else self.server.add_insecure_port(addr))
        if not self.port:
            raise OSError(f"could not bind the gRPC port {addr}")
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)
