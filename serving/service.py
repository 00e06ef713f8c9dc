"""What both front ends share: the model's identity, the tokenizer and chat encoding, prompt limits, and
submitting a request to the scheduler (and aborting it when the client goes away)."""

from __future__ import annotations

import dataclasses
import time
import uuid

from dsjax.chat import ChatEncodingError, encode_messages_to_ids
from dsjax.serving.engine import RowSampling
from dsjax.serving.openai_protocol import ApiError, GenParams, Limits, bad, reasoning_effort_for
from dsjax.serving.scheduler import Draining, OutputStream, QueueFull, Request, Scheduler
from dsjax.tokenizer import Tokenizer


@dataclasses.dataclass
class ModelInfo:
    id: str                 # the name clients send as `model`
    source: str             # where the weights came from
    family: str             # "v4" | "v4.1"
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    eos_token_id: int
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


class Service:
    def __init__(self, info: ModelInfo, tokenizer: Tokenizer, scheduler: Scheduler, limits: Limits, *,
                 default_thinking: bool = True, metrics=None, kv=None, vision_cfg=None):
        self.info, self.tokenizer, self.scheduler, self.limits = info, tokenizer, scheduler, limits
        self.default_thinking, self.metrics, self.kv = default_thinking, metrics, kv
        self.vision_cfg = vision_cfg  # the ModelConfig of a V4.1 model with a vision tower, else None
        self.ready = False  # set after warm-up; cleared on drain

    def check_model(self, name: str) -> None:
        if name != self.info.id:
            raise ApiError(404, f"The model {name!r} does not exist; this server serves {self.info.id!r}",
                           "model", type="invalid_request_error", code="model_not_found")

    def chat_prompt(self, p: GenParams) -> tuple[list[int], bool]:
        """(prompt ids, thinking) for a chat request."""
        thinking = self.default_thinking if p.thinking is None else p.thinking
        effort = reasoning_effort_for(self.info.family, p.reasoning_effort)
        try:
            ids = encode_messages_to_ids(p.messages, family=self.info.family, thinking=thinking,
                                         tokenizer=self.tokenizer, reasoning_effort=effort if thinking else None,
                                         tools=p.tools)
        except (ChatEncodingError, ValueError, TypeError, KeyError) as e:
            raise bad("messages", f"messages could not be encoded: {e}") from None
        return ids, thinking

    def image_prompt(self, ids: list[int], images: list):
        """Chat ids holding one image placeholder per image -> the images preprocessed and the placeholders expanded
        (dsjax.vision.PreparedPrompt); the ViT runs when the request joins the engine."""
        from dsjax.errors import ImageError
        from dsjax.vision.inputs import prepare_prompt

        if self.vision_cfg is None:
            raise bad("messages", f"image_url parts: the model {self.info.id!r} has no vision tower "
                                  "(DeepSeek-V4.1 with vision_config takes images)")
        found = sum(t == self.vision_cfg.image_token_id for t in ids)
        if found != len(images):
            raise bad("messages", f"the encoded messages hold {found} image placeholder(s) for {len(images)} image(s)")
        try:
            return prepare_prompt(self.vision_cfg, ids, images, name="image_url")
        except ImageError as e:
            raise bad("messages", str(e)) from None

    def completion_prompt(self, p: GenParams) -> list[int]:
        if isinstance(p.prompt, str):
            return [self.info_bos()] + self.tokenizer.encode(p.prompt)
        return list(p.prompt)

    def info_bos(self) -> int:
        return self.tokenizer.special.bos

    def budget(self, ids: list[int], max_tokens: int | None, param: str = "messages") -> int:
        """Validate the prompt against the context; the token budget (default: the rest of the context)."""
        n, ctx = len(ids), self.info.max_model_len
        bad_ids = [t for t in ids if not 0 <= t < self.info.vocab_size]
        if bad_ids:
            raise bad("prompt", f"token id {bad_ids[0]} is out of range [0, {self.info.vocab_size})")
        if not ids:
            raise bad(param, "the prompt encodes to no tokens")
        if n >= ctx:
            raise bad(param, f"This model's maximum context length is {ctx} tokens; the prompt has {n} tokens "
                             "(room is needed to generate)")
        if max_tokens is None:
            return ctx - n
        if n + max_tokens > ctx:
            raise bad("max_tokens", f"This model's maximum context length is {ctx} tokens; you requested "
                                    f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} to generate)")
        return max_tokens

    def submit(self, ids: list[int], max_tokens: int, *, sampling: RowSampling, top_logprobs: int = 0,
               stop_token_ids=(), request_id: str | None = None, conversation: tuple[str, object] | None = None,
               images=None) -> tuple[str, OutputStream]:
        """Queue a request; its outputs arrive on the returned stream. Raises ApiError 429 / 503."""
        for t in stop_token_ids:
            if not 0 <= t < self.info.vocab_size:
                raise bad("stop_token_ids", f"stop token id {t} is out of range [0, {self.info.vocab_size})")
        if top_logprobs > self.limits.max_logprobs:
            raise bad("top_logprobs", f"at most {self.limits.max_logprobs} top logprobs on this server")
        for t, _ in sampling.logit_bias:
            if t >= self.info.vocab_size:
                raise bad("logit_bias", f"logit_bias token id {t} is out of range [0, {self.info.vocab_size})")
        if self.limits.speculative and sampling.penalised:
            name = next(n for n in ("presence_penalty", "frequency_penalty", "logit_bias") if getattr(sampling, n))
            raise bad(name, f"{name} is not supported with speculative decoding on this server")
        rid = request_id or uuid.uuid4().hex
        stream = OutputStream()
        req = Request(id=rid, prompt=list(ids), max_tokens=max_tokens, sampling=sampling, top_logprobs=top_logprobs,
                      stop_token_ids=frozenset(stop_token_ids), emit=stream.emit, images=images)
        if conversation is not None:
            req.conversation, req.start = conversation
        try:
            self.scheduler.submit(req)
        except QueueFull as e:
            self._rejected("queue_full")
            raise ApiError(429, str(e), None, type="rate_limit_error", code="queue_full") from None
        except Draining as e:
            self._rejected("draining")
            raise ApiError(503, str(e), None, type="server_error", code="draining") from None
        except ValueError as e:
            raise bad("request_id", str(e)) from None
        return rid, stream

    async def conversation(self, key: str | None, tenant: str, ids: list[int],
                           deadline_left_s: float | None = None) -> tuple[str, object] | None:
        """(conversation id, where its KV starts) for a named conversation on a server with KV handoff; None
        otherwise. The id is HMAC'd with the cluster secret and the tenant (the API key's hash). A pull from a peer
        never outlasts `deadline_left_s` (the gRPC deadline)."""
        if not key or self.kv is None:
            return None
        cid = self.kv.conversation(tenant, key)
        return cid, await self.kv.prepare(cid, ids, deadline_left_s)

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        return self.scheduler.abort(request_id, reason)

    def _rejected(self, reason: str) -> None:
        if self.metrics:
            self.metrics.rejected.labels(reason=reason).inc()
