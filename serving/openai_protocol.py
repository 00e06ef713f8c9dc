"""OpenAI request bodies -> validated generation parameters, once, at the edge.

Every field is either supported or rejected with a 400 naming it (`ApiError.param`); unknown fields are
rejected too, so a client never believes a setting took effect when it did not.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from typing import Any

from dsjax.serving.engine import RowSampling


class ApiError(Exception):
    """An error a client can act on: HTTP status, OpenAI error type, the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param)


@dataclasses.dataclass
class Limits:
    max_model_len: int
    max_logprobs: int = 20
    max_stop: int = 16
    max_stop_len: int = 256
    max_messages: int = 1024
    max_n: int = 16
    max_logit_bias: int = 300     # entries, as OpenAI
    speculative: bool = False     # the server decodes with MTP drafts: penalties and top_logprobs are refused
    max_images: int = 8           # image_url parts per request
    fetch_remote_images: bool = False  # http(s) image URLs are fetched only when the server enables it


@dataclasses.dataclass
class GenParams:
    """What one request asks for, validated. `prompt_ids` is filled by the caller after encoding."""

    model: str
    stream: bool = False
    n: int = 1
    include_usage: bool = False
    max_tokens: int | None = None
    sampling: RowSampling = RowSampling()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    # chat only
    messages: list[dict] | None = None
    thinking: bool | None = None
    reasoning_effort: Any = None
    tools: list[dict] | None = None
    images: list | None = None        # decoded RGB arrays of the image_url parts, in order (V4.1 vision)
    conversation: str | None = None  # prompt_cache_key (or the X-Conversation-Id header): names the KV to reuse
    # completions only
    prompt: str | list[int] | None = None


_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
           "stop", "stop_token_ids", "n", "presence_penalty", "frequency_penalty", "user", "logit_bias", "logprobs",
           "prompt_cache_key"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "thinking", "chat_template_kwargs", "reasoning_effort",
                         "response_format", "store", "metadata"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
        raise bad(name, f"{name} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if not math.isfinite(v) or not lo <= v <= hi:
        raise bad(name, f"{name} must lie in [{lo}, {hi}], got {v!r}")
    return int(v) if integer else float(v)


def _flag(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false, got {v!r}")
    return v


def _common(body: dict, allowed: set[str], limits: Limits) -> GenParams:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    for name in body:
        if name not in allowed:
            raise bad(name, f"Unsupported parameter: {name!r} is not supported by this server")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required: a model id from /v1/models")
    penalties = {name: _number(body, name, 0.0, -2.0, 2.0) for name in ("presence_penalty", "frequency_penalty")}
    logit_bias = _logit_bias(body.get("logit_bias"), limits)
    if limits.speculative:
        for name, v in (*penalties.items(), ("logit_bias", logit_bias)):
            if v:
                raise bad(name, f"{name} is not supported with speculative decoding on this server (only "
                                "plain decoding applies it)")
    n = _number(body, "n", 1, 1, limits.max_n, integer=True)
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options", "stream_options is only allowed with stream=true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise bad("stream_options", "stream_options supports only include_usage")
        include_usage = _flag(opts, "include_usage")
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbelow(2**31)
    elif isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64:
        raise bad("seed", f"seed must be an integer, got {seed!r}")
    sampling = RowSampling(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                           top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
                           top_k=_number(body, "top_k", 0, -1, 1 << 20, integer=True),
                           min_p=_number(body, "min_p", 0.0, 0.0, 1.0), seed=int(seed), logit_bias=logit_bias,
                           **penalties)
    if sampling.top_p == 0.0:  # OpenAI allows 0; the sampler needs a non-empty nucleus: 0 means greedy
        sampling = dataclasses.replace(sampling, temperature=0.0, top_p=1.0)
    if sampling.top_k < 0:     # vLLM's "-1 = off"
        sampling = dataclasses.replace(sampling, top_k=0)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop", "stop must be a string or a list of strings")
    if len(stop) > limits.max_stop or any(len(s) > limits.max_stop_len for s in stop):
        raise bad("stop", f"at most {limits.max_stop} stop strings of up to {limits.max_stop_len} characters")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise bad("stop_token_ids", "stop_token_ids must be a list of token ids")
    if len(stop_ids) > limits.max_stop:
        raise bad("stop_token_ids", f"at most {limits.max_stop} stop token ids")
    key = body.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= 256):
        raise bad("prompt_cache_key", "prompt_cache_key must be a non-empty string of at most 256 characters")
    return GenParams(model=model, stream=stream, n=n, include_usage=include_usage, sampling=sampling,
                     stop=tuple(stop), stop_token_ids=tuple(stop_ids), conversation=key)


def _logit_bias(value, limits: Limits) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias in [-100, 100]} -> sorted (id, bias) pairs (ids checked against the vocabulary
    by the service)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad("logit_bias", "logit_bias must be an object mapping token ids to biases in [-100, 100]")
    if len(value) > limits.max_logit_bias:
        raise bad("logit_bias", f"at most {limits.max_logit_bias} logit_bias entries")
    out = {}
    for key, v in value.items():
        if not (isinstance(key, str) and key.isdigit()) and not (isinstance(key, int) and key >= 0):
            raise bad("logit_bias", f"logit_bias key {key!r} is not a token id")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not -100 <= v <= 100:
            raise bad("logit_bias", f"logit_bias[{key}] must be a number in [-100, 100], got {v!r}")
        out[int(key)] = float(v)
    return tuple(sorted(out.items()))


def _max_tokens(body: dict, names: tuple[str, ...], limits: Limits) -> int | None:
    for name in names:
        if body.get(name) is not None:
            v = body[name]
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(name, f"{name} must be an integer, got {v!r}")
            if v < 1:
                raise bad(name, f"{name} must be at least 1, got {v}")
            if v >= limits.max_model_len:
                raise bad(name, f"{name} is {v}; this model's context is {limits.max_model_len} tokens")
            return v
    return None


def parse_chat(body: dict, limits: Limits) -> GenParams:
    p = _common(body, CHAT_FIELDS, limits)
    p.max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), limits)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list")
    if len(messages) > limits.max_messages:
        raise bad("messages", f"at most {limits.max_messages} messages")
    images: list = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}]", "each message needs a role: system, developer, user, assistant or tool")
        content = m.get("content")
        if isinstance(content, list):  # text and image_url parts
            for j, c in enumerate(content):
                if isinstance(c, dict) and c.get("type") == "image_url":
                    images.append(_image_part(c, f"messages[{i}].content[{j}]", limits, len(images)))
                elif not (isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)):
                    raise bad(f"messages[{i}].content[{j}]", "content parts must be {type: text, text} or "
                                                             "{type: image_url, image_url: {url}}")
        elif content is not None and not isinstance(content, str):
            raise bad(f"messages[{i}].content", "content must be a string or a list of text / image_url parts")
    p.messages = [_plain_message(m) for m in messages]
    p.images = images or None
    p.logprobs = _flag(body, "logprobs")
    p.top_logprobs = _number(body, "top_logprobs", 0, 0, 20, integer=True)
    if p.top_logprobs and not p.logprobs:
        raise bad("top_logprobs", "top_logprobs needs logprobs=true")
    if p.top_logprobs > limits.max_logprobs:
        raise bad("top_logprobs", f"top_logprobs must be at most {limits.max_logprobs} on this server"
                  + (" (speculative decoding reports the chosen token's logprob only)" if limits.speculative else ""))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                                  and isinstance(t.get("function"), dict)
                                                  and isinstance(t["function"].get("name"), str) for t in tools):
            raise bad("tools", "tools must be a list of {type: function, function: {name, description, parameters}}")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise bad("tool_choice", "tool_choice supports 'auto' and 'none' (forcing a tool call is not supported)")
    p.tools = tools if tools and choice != "none" else None
    if body.get("response_format") not in (None, {"type": "text"}):
        raise bad("response_format", "only response_format {type: text} is supported")
    p.thinking = _thinking(body)
    p.reasoning_effort = body.get("reasoning_effort")
    return p


def _image_part(part: dict, where: str, limits: Limits, count: int):
    """An OpenAI image_url part -> uint8 [H, W, 3]: data URLs decoded here; http(s) URLs fetched only when the server
    allows it. Bad images are a 400 naming the part."""
    from dsjax.errors import ImageError
    from dsjax.vision.decode import MAX_BYTES, data_url_bytes, decode_image

    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise bad(f"{where}.image_url", "image_url must be {url: 'data:image/png;base64,...'}")
    if count >= limits.max_images:
        raise bad(where, f"at most {limits.max_images} images per request")
    try:
        if url.startswith("data:"):
            data = data_url_bytes(url, name=f"{where}.image_url")
        elif url.startswith(("http://", "https://")):
            if not limits.fetch_remote_images:
                raise bad(f"{where}.image_url", "remote image URLs are not fetched by this server; send the image "
                                                "inline as a data URL (data:image/png;base64,...), or start the "
                                                "server with --allow-remote-images")
            data = _fetch(url, MAX_BYTES, f"{where}.image_url")
        else:
            raise bad(f"{where}.image_url", "image_url must be a data: URL (data:image/png;base64,...)"
                                            + (" or an http(s) URL" if limits.fetch_remote_images else ""))
        return decode_image(data, name=f"{where}.image_url")
    except ImageError as e:
        raise bad(f"{where}.image_url", str(e)) from None


def _fetch(url: str, max_bytes: int, where: str) -> bytes:
    """GET an image (servers started with --allow-remote-images only); 10 s timeout, size-limited."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "dsjax"}), timeout=10) as r:
            data = r.read(max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise bad(where, f"could not fetch {url!r}: {e}") from None
    if len(data) > max_bytes:
        raise bad(where, f"{url!r} is larger than {max_bytes:,} bytes")
    return data


def _plain_message(m: dict) -> dict:
    out = dict(m)
    if out.get("role") == "developer":
        out["role"] = "system"
    if isinstance(out.get("content"), list) and any(part["type"] == "image_url" for part in out["content"]):
        # the chat encoding writes one image placeholder per image part (V4.1; V4 refuses them by name)
        out["content"] = [{"type": "image_url"} if part["type"] == "image_url" else part for part in out["content"]]
    elif isinstance(out.get("content"), list):
        out["content"] = "".join(part["text"] for part in out["content"])
    if out.get("content") is None:
        out["content"] = ""
    return out


def _thinking(body: dict) -> bool | None:
    """DeepSeek's `thinking: {type: enabled|disabled}` and vLLM/SGLang's `chat_template_kwargs.thinking`."""
    found = None
    t = body.get("thinking")
    if t is not None:
        if not isinstance(t, dict) or t.get("type") not in ("enabled", "disabled"):
            raise bad("thinking", "thinking must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"}")
        found = t["type"] == "enabled"
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if not isinstance(kw, dict) or set(kw) - {"thinking", "enable_thinking"}:
            raise bad("chat_template_kwargs", "chat_template_kwargs supports only thinking (bool)")
        for key in ("thinking", "enable_thinking"):
            if key in kw:
                if not isinstance(kw[key], bool):
                    raise bad(f"chat_template_kwargs.{key}", f"{key} must be true or false")
                if found is not None and found != kw[key]:
                    raise bad(f"chat_template_kwargs.{key}", "contradicts the thinking field")
                found = kw[key]
    return found


def reasoning_effort_for(family: str, effort: Any) -> Any:
    """OpenAI/DeepSeek effort words -> what the family's chat encoding takes. V4: high | max (low and medium
    map to high, xhigh to max, as DeepSeek's API does). V4.1: low | high | max or an integer in [1, 100]."""
    if effort is None:
        return None
    if family == "v4":
        mapped = {"minimal": "high", "low": "high", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}
        if effort not in mapped:
            raise bad("reasoning_effort", f"reasoning_effort {effort!r}: use low, medium, high, xhigh or max")
        return mapped[effort]
    if isinstance(effort, int) and not isinstance(effort, bool):
        if not 1 <= effort <= 100:
            raise bad("reasoning_effort", f"a numeric reasoning_effort must lie in [1, 100], got {effort}")
        return effort
    mapped = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}
    if effort not in mapped:
        raise bad("reasoning_effort", f"reasoning_effort {effort!r}: use low, medium, high, xhigh, max or 1-100")
    return mapped[effort]


def parse_completion(body: dict, limits: Limits) -> GenParams:
    p = _common(body, COMPLETION_FIELDS, limits)
    p.max_tokens = _max_tokens(body, ("max_tokens",), limits) or 16  # OpenAI's default for completions
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "prompt is empty")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        pass
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad("prompt", "one prompt per request (a string or a list of token ids)")
    else:
        raise bad("prompt", "prompt must be a non-empty string or a list of token ids")
    p.prompt = prompt
    lp = body.get("logprobs")
    if lp is not None:
        if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= min(5, limits.max_logprobs):
            raise bad("logprobs", f"logprobs must be an integer in [0, {min(5, limits.max_logprobs)}]")
        p.logprobs, p.top_logprobs = True, lp
    if _flag(body, "echo"):
        raise bad("echo", "echo is not supported")
    if body.get("suffix"):
        raise bad("suffix", "suffix is not supported")
    if _number(body, "best_of", 1, 1, 128, integer=True) != 1:
        raise bad("best_of", "only best_of=1 is supported")
    return p
