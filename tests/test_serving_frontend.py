"""The serving front ends and scheduler over a scripted engine (no model, no compiles): streamed tool calls and
reasoning from the DSML parser through the official `openai` client, stop strings, back-pressure (429 and
RESOURCE_EXHAUSTED), aborts of queued requests, graceful drain (503 / NOT_SERVING) — plus the pieces on their
own: request validation, the API key, stop-string text, the flags, the memory check and the committed stubs."""

import concurrent.futures
import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

import grpc
import pytest

from dsjax.errors import ConfigError
from dsjax.serving.auth import ApiKey
from dsjax.serving.config import ServeConfig
from dsjax.serving.engine import StepOutput
from dsjax.serving.metrics import Metrics
from dsjax.serving.openai_protocol import ApiError, Limits, parse_chat, parse_completion, reasoning_effort_for
from dsjax.serving.scheduler import Request, RequestOutput, Scheduler
from dsjax.serving.server import ServerThread
from dsjax.serving.service import ModelInfo, Service
from dsjax.serving.text import OutputText
from dsjax.tokenizer import EOS, load_tokenizer

pytestmark = pytest.mark.xdist_group("serving")

TOK = load_tokenizer("v4")
CALLS = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
         '<｜DSML｜parameter name="city" string="true">杭州</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
         '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
SCRIPT = TOK.encode("Let me check.</think>Checking the weather." + CALLS + EOS)


class ScriptedEngine:
    """SlotEngine's interface; every request "generates" SCRIPT (or counting tokens for completions of
    token-id prompts ending in 7), `per_dispatch` tokens per decode step, `hold` seconds per step. While `paused`
    is set no row advances, but the scheduler keeps admitting and aborting (tests wait on states, not sleeps)."""

    def __init__(self, slots=2, per_dispatch=3):
        self.slots, self.per_dispatch, self.hold = slots, per_dispatch, 0.0
        self.rows: dict[int, dict] = {}
        self.steps = 0
        self.paused = threading.Event()

    def free_slots(self):
        return [b for b in range(self.slots) if b not in self.rows]

    def join(self, slot, prompt, max_new, sampling, top_logprobs=0):
        counting = prompt[-1] == 7
        script = list(range(100, 100 + max_new)) if counting else SCRIPT
        self.rows[slot] = {"script": script[:max_new], "at": 0, "stop": not counting and len(script) <= max_new}

    def leave(self, slot):
        self.rows.pop(slot, None)

    def busy(self):
        return bool(self.rows)

    def reset_all(self):
        self.rows.clear()

    def warm_up(self):
        pass

    def prefill_step(self):
        return []

    def decode_step(self):
        if not self.rows:
            return []
        if self.paused.is_set():
            time.sleep(0.001)
            return []
        time.sleep(self.hold)
        self.steps += 1
        out = []
        for b, r in list(self.rows.items()):
            new = r["script"][r["at"]:r["at"] + self.per_dispatch]
            r["at"] += len(new)
            done = r["at"] >= len(r["script"])
            finished = ("stop" if r["stop"] else "length") if done else None
            out.append(StepOutput(b, new, [-0.5] * len(new), [[(t, -0.5)] for t in new], finished))
            if done:
                del self.rows[b]
        return out


KEY = "k"


def _wait_for(condition, timeout=30.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out waiting for the server"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def fake():
    engine = ScriptedEngine()
    metrics = Metrics("fake")
    sched = Scheduler(engine, max_queue=2, metrics=metrics)
    info = ModelInfo(id="fake", source="scripted", family="v4", max_model_len=512, max_num_seqs=2,
                     vocab_size=TOK.vocab_size, eos_token_id=1)
    svc = Service(info, TOK, sched, Limits(max_model_len=512, max_logprobs=5), default_thinking=True, metrics=metrics)
    cfg = ServeConfig(model="fake", port=0, grpc_port=0, api_key=KEY, max_request_bytes=1 << 16, drain_timeout=5)
    st = ServerThread(cfg, svc).start(timeout=60)
    yield st, engine
    if not sched.draining:
        st.stop()


@pytest.fixture(scope="module")
def client(fake):
    import openai
    return openai.OpenAI(base_url=f"http://127.0.0.1:{fake[0].server.http_port}/v1", api_key=KEY, timeout=20,
                         max_retries=0)


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]
MESSAGES = [{"role": "user", "content": "Weather in Hangzhou?"}]


def test_openai_tool_calls_and_reasoning(client):
    full = client.chat.completions.create(model="fake", messages=MESSAGES, tools=TOOLS)
    msg = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content == "Let me check." and msg.content == "Checking the weather."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [("get_weather", {"city": "杭州", "days": 3})]
    assert full.usage.completion_tokens == len(SCRIPT)
    assert full.usage.completion_tokens_details.reasoning_tokens == len(TOK.encode("Let me check.</think>"))
    chunks = list(client.chat.completions.create(model="fake", messages=MESSAGES, tools=TOOLS, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Let me check."
    assert "".join(d.content or "" for d in deltas) == "Checking the weather."
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "杭州", "days": 3}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + len(SCRIPT)


def test_n_choices(client):
    """n=2: two requests (seeds seed, seed+1), one response; streamed choices carry their index."""
    full = client.chat.completions.create(model="fake", messages=MESSAGES, tools=TOOLS, n=2)
    assert [c.index for c in full.choices] == [0, 1]
    assert all(c.message.tool_calls[0].function.name == "get_weather" for c in full.choices)
    assert full.usage.completion_tokens == 2 * len(SCRIPT) and full.usage.prompt_tokens < len(SCRIPT) * 10
    chunks = list(client.completions.create(model="fake", prompt=[0, 7], max_tokens=5, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    finish = {c.choices[0].index: c.choices[0].finish_reason
              for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finish == {0: "length", 1: "length"} and chunks[-1].usage.completion_tokens == 10


def test_stop_string_ends_output_and_frees_slot(fake, client):
    st, engine = fake
    r = client.chat.completions.create(model="fake", messages=MESSAGES, stop=["weather"],
                                       extra_body={"thinking": {"type": "enabled"}})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == "Checking the " and not r.choices[0].message.tool_calls
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="fake", prompt="x", max_tokens=40, stop=["weather"], stream=True) if c.choices)
    assert text.endswith("Checking the ")
    _wait_for(lambda: not engine.rows)


def test_queue_full_gets_429_and_resource_exhausted(fake, client):
    """2 slots + a queue of 2: while 4 long requests hold everything, the 5th is refused at once; Abort ends
    queued and running requests alike."""
    import openai
    from dsjax.serving.proto import engine_pb2 as pb, engine_pb2_grpc as pb_grpc

    st, engine = fake
    sched = st.svc.scheduler
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            engine.paused.set()  # nothing finishes: the slots fill, then the queue (admission is not instant)
            futures = [pool.submit(client.completions.create, model="fake", prompt=[0, 7], max_tokens=500)
                       for _ in range(2)]
            _wait_for(lambda: sched.running() == 2)
            futures += [pool.submit(client.completions.create, model="fake", prompt=[0, 7], max_tokens=500)
                        for _ in range(2)]
            _wait_for(lambda: sched.queue_depth() == 2)
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model="fake", prompt=[0, 7], max_tokens=5)
            assert "queue is full" in e.value.message
            with grpc.insecure_channel(f"127.0.0.1:{st.server.grpc_port}") as ch:
                req = pb.GenerateRequest(max_tokens=3, input_ids=pb.TokenIds(ids=[0, 7]))
                with pytest.raises(grpc.RpcError) as g:
                    list(pb_grpc.EngineStub(ch).Generate(req, metadata=(("x-api-key", KEY),), timeout=10))
                assert g.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                ids = st.svc.scheduler.request_ids()
                assert len(ids) == 4
                for rid in ids:
                    assert pb_grpc.EngineStub(ch).Abort(pb.AbortRequest(request_id=rid),
                                                        metadata=(("x-api-key", KEY),), timeout=10).found
            results = [f.result(timeout=30) for f in futures]
    finally:
        engine.paused.clear()
    assert [r.choices[0].finish_reason for r in results] == ["abort"] * 4
    assert [r.usage.completion_tokens for r in results] == [0] * 4


def test_grpc_text_in_stop_string_out(fake):
    from dsjax.serving.proto import engine_pb2 as pb, engine_pb2_grpc as pb_grpc

    st, _ = fake
    with grpc.insecure_channel(f"127.0.0.1:{st.server.grpc_port}") as ch:
        stub = pb_grpc.EngineStub(ch)
        req = pb.GenerateRequest(text="hello", stop=["weather"], max_tokens=100)
        out = list(stub.Generate(req, metadata=(("authorization", f"Bearer {KEY}"),), timeout=10))
        assert "".join(r.chunk.text for r in out if r.HasField("chunk")) == "Let me check.</think>Checking the "
        assert out[-1].complete.finish_reason == pb.STOP_STRING
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(), metadata=(("x-api-key", KEY),), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_drain_finishes_running_then_refuses(fake, client):
    """Last in this module: drain lets the running request finish, health goes NOT_SERVING / 503."""
    import httpx2 as httpx
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    st, engine = fake
    # earlier tests' requests must be gone first, or one of them could pass for the running one below and the drain
    # would start before ours is submitted (seen once on a loaded CI machine: ours got 503)
    _wait_for(st.svc.scheduler.idle)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        engine.paused.set()  # the request stays in flight until the checks below are done
        running = pool.submit(client.completions.create, model="fake", prompt=[0, 7], max_tokens=30)
        _wait_for(lambda: st.svc.scheduler.running() == 1)
        try:
            stopper = threading.Thread(target=st.stop)
            stopper.start()
            _wait_for(lambda: st.svc.scheduler.draining)
            base = f"http://127.0.0.1:{st.server.http_port}"
            health = httpx.get(base + "/health", timeout=5)
            refused = httpx.post(base + "/v1/completions", json={"model": "fake", "prompt": "x"}, timeout=5,
                                 headers={"Authorization": f"Bearer {KEY}"})
            with grpc.insecure_channel(f"127.0.0.1:{st.server.grpc_port}") as ch:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        finally:
            engine.paused.clear()
        assert running.result(timeout=30).usage.completion_tokens == 30
    stopper.join(30)
    assert (health.status_code, health.json()["status"]) == (503, "draining")
    assert refused.status_code == 503
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_on_both_ports(tmp_path):
    """--ssl-certfile/--ssl-keyfile: HTTPS and gRPC over TLS, verified against the self-signed certificate."""
    import ssl

    import httpx2 as httpx
    from dsjax.serving.proto import engine_pb2 as pb, engine_pb2_grpc as pb_grpc

    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=30)
    engine = ScriptedEngine()
    sched = Scheduler(engine, max_queue=2)
    info = ModelInfo(id="fake", source="scripted", family="v4", max_model_len=512, max_num_seqs=2,
                     vocab_size=TOK.vocab_size, eos_token_id=1)
    svc = Service(info, TOK, sched, Limits(max_model_len=512))
    cfg = ServeConfig(model="fake", port=0, grpc_port=0, ssl_certfile=cert, ssl_keyfile=key).validate()
    st = ServerThread(cfg, svc).start(timeout=60)
    try:
        ctx = ssl.create_default_context(cafile=cert)
        r = httpx.post(f"https://127.0.0.1:{st.server.http_port}/v1/completions", verify=ctx, timeout=10,
                       json={"model": "fake", "prompt": [0, 7], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"https://127.0.0.1:{st.server.http_port}/health", timeout=10)  # unknown CA: refused
        with open(cert, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        with grpc.secure_channel(f"localhost:{st.server.grpc_port}", creds) as ch:
            out = list(pb_grpc.EngineStub(ch).Generate(pb.GenerateRequest(input_ids=pb.TokenIds(ids=[0, 7]),
                                                                          max_tokens=3), timeout=10))
            assert out[-1].complete.usage.completion_tokens == 3
    finally:
        st.stop()


SIGTERM_CHILD = """
import asyncio, sys, time
sys.path.insert(0, {tests!r})
from test_serving_frontend import ScriptedEngine, TOK
from dsjax.serving.config import ServeConfig
from dsjax.serving.metrics import Metrics
from dsjax.serving.openai_protocol import Limits
from dsjax.serving.scheduler import Scheduler
from dsjax.serving.server import _log_to_stderr, _run
from dsjax.serving.service import ModelInfo, Service
engine = ScriptedEngine()
engine.hold = 0.02
info = ModelInfo(id="fake", source="scripted", family="v4", max_model_len=512, max_num_seqs=2,
                 vocab_size=TOK.vocab_size, eos_token_id=1)
metrics = Metrics("fake")
svc = Service(info, TOK, Scheduler(engine, max_queue=4, metrics=metrics), Limits(max_model_len=512), metrics=metrics)
_log_to_stderr("info")
asyncio.run(_run(ServeConfig(model="fake", port=0, grpc_port=0, drain_timeout=10), svc, time.perf_counter()))
"""


def test_sigterm_drains_the_process_and_exits_0():
    """The real signal path of `dsjax serve` (its `_run`), over the scripted engine: ports, ready line, a request
    running when SIGTERM arrives finishes, then the process exits 0."""
    import re
    import signal
    import sys

    import httpx2 as httpx

    code = SIGTERM_CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "ready in" in line:
                break
        port = int(re.search(r"HTTP 127\.0\.0\.1:(\d+)", "".join(lines)).group(1))
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(httpx.post, base + "/v1/completions", timeout=30,
                                  json={"model": "fake", "prompt": [0, 7], "max_tokens": 40})
            end = time.monotonic() + 20
            while "dsjax_running_slots 1.0" not in httpx.get(base + "/metrics", timeout=10).text:
                assert time.monotonic() < end, "the request never started"
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            assert running.result(timeout=30).json()["usage"]["completion_tokens"] == 40
        assert proc.wait(timeout=30) == 0
        rest = proc.stderr.read()
        assert "draining: 1 running" in rest and "stopped" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


# ---- pieces on their own ----

LIMITS = Limits(max_model_len=64, max_logprobs=5)


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "on"}}, "thinking"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
     "stream_options"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, "top_p"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": "7"}, "seed"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}, "logit_bias"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"five": 1}}, "logit_bias"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": [5]}, "logit_bias"),
])
def test_chat_validation_names_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat(body, LIMITS)
    assert e.value.status == 400 and e.value.param == param


def test_request_mapping():
    p = parse_chat({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]},
                                               {"role": "user", "content": "b"}],
                    "max_tokens": 9, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "x",
                    "chat_template_kwargs": {"thinking": False}, "stream": True,
                    "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}, LIMITS)
    assert p.messages[0] == {"role": "system", "content": "a"} and p.thinking is False
    assert (p.max_tokens, p.sampling.temperature, p.sampling.top_p, p.sampling.seed) == (9, 0.0, 0.5, 3)
    assert p.stop == ("x",) and p.include_usage and p.top_logprobs == 2
    pen = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5,
                      "frequency_penalty": -1, "logit_bias": {"7": 3, "2": -100}}, LIMITS).sampling
    assert (pen.presence_penalty, pen.frequency_penalty, pen.logit_bias) == (0.5, -1.0, ((2, -100.0), (7, 3.0)))
    spec = dataclasses.replace(LIMITS, speculative=True)
    for field, value in (("presence_penalty", 1), ("logit_bias", {"7": 1})):
        with pytest.raises(ApiError) as e:  # a speculative server refuses what only the plain sampler applies
            parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], field: value}, spec)
        assert e.value.param == field
    c = parse_completion({"model": "m", "prompt": [[0, 5]], "logprobs": 3}, LIMITS)
    assert c.prompt == [0, 5] and c.max_tokens == 16 and c.top_logprobs == 3
    assert [reasoning_effort_for("v4", e) for e in ("low", "medium", "high", "xhigh", "max")] == \
        ["high", "high", "high", "max", "max"]
    assert reasoning_effort_for("v4.1", 30) == 30 and reasoning_effort_for("v4.1", "low") == "low"
    with pytest.raises(ApiError):
        reasoning_effort_for("v4.1", 101)


def test_api_key_and_stop_text():
    key = ApiKey("s3cret")
    assert key.accepts("s3cret") and not key.accepts("s3cre") and not key.accepts(None) and not key.accepts("")
    assert key.accepts_bearer("Bearer s3cret") and key.accepts_bearer("bearer s3cret")
    assert not key.accepts_bearer("Basic s3cret") and not key.accepts_bearer(None)
    assert ApiKey(None).accepts(None) and not ApiKey(None).required
    ids = TOK.encode("Hello world, stop here please")
    text = OutputText(TOK, ("stop",))
    out = "".join(text.add([t]) for t in ids) + text.flush()
    assert out == "Hello world, " and text.stopped and text.tokens_used < len(ids)
    emoji = TOK.encode("a😀b")
    whole = OutputText(TOK, ())
    assert "".join(whole.add([t]) for t in emoji) + whole.flush() == "a😀b"


def test_flags_memory_check_and_cli():
    from dsjax import cli
    from dsjax.serving.config import from_args
    from dsjax.serving.server import check_memory, _model_config

    args = cli.build_parser().parse_args(["serve", "--max-num-seqs", "4", "--max-model-len", "256", "--port", "0",
                                          "--grpc-port", "-1", "--no-thinking"])
    cfg = from_args(args)
    assert (cfg.max_num_seqs, cfg.max_model_len, cfg.grpc_port, cfg.default_thinking) == (4, 256, -1, False)
    spec = from_args(cli.build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']))
    assert spec.num_speculative_tokens == 3
    for bad_spec, needle in (('{"method": "eagle"}', "method"), ('{"num_speculative_tokens": 0}', "integer"),
                             ('{"model": "x"}', "unsupported key"), ("[1]", "object"), ("{", "not JSON")):
        with pytest.raises(ConfigError, match=needle):
            from_args(cli.build_parser().parse_args(["serve", "--speculative-config", bad_spec]))
    with pytest.raises(ConfigError, match="multiple"):
        ServeConfig(max_num_seqs=3, data_parallel_size=2).validate()
    with tempfile.NamedTemporaryFile("w", suffix=".key", delete=False) as f:
        f.write("from-file\n")
    try:
        assert from_args(cli.build_parser().parse_args(["serve", "--api-key-file", f.name])).api_key == "from-file"
    finally:
        os.unlink(f.name)
    big = ServeConfig(model="v4-flash", max_num_seqs=256, max_model_len=1 << 20)
    with pytest.raises(ConfigError, match="does not fit"):
        check_memory(big, _model_config(big), 1 << 20)
    small = ServeConfig(model="tiny-v4", max_num_seqs=2, max_model_len=128)
    assert "GB per device" in check_memory(small, _model_config(small), 128)


def test_committed_stubs_match_the_proto(tmp_path):
    from dsjax.serving.proto import generate

    generate.generate(str(tmp_path))
    for name in generate.OUTPUTS:
        with open(os.path.join(generate.HERE, name)) as a, open(tmp_path / name) as b:
            assert a.read() == b.read(), f"{name} is stale: run python -m dsjax.serving.proto.generate"


def test_scheduler_abort_in_queue_and_failed_step():
    """Without sockets: an aborted queued request ends with "abort"; a raising engine step fails the running
    requests with "error" and the scheduler keeps serving."""

    class Failing(ScriptedEngine):
        fail = True

        def decode_step(self):
            if self.fail:
                self.fail = False
                raise RuntimeError("device lost")
            return super().decode_step()

    engine = Failing(slots=1)
    sched = Scheduler(engine, max_queue=4)
    got: dict[str, list[RequestOutput]] = {}

    def req(rid, prompt):
        got[rid] = []
        return Request(id=rid, prompt=prompt, max_tokens=5, emit=got[rid].append)

    sched.submit(req("a", [0, 7]))
    sched.submit(req("b", [0, 7]))
    sched.abort("b")
    sched.start()
    try:
        assert sched.wait_idle(10)
        assert got["a"][-1].finish_reason == "error" and "device lost" in got["a"][-1].error
        assert got["b"][-1].finish_reason == "abort"
        sched.submit(req("c", [0, 7]))
        assert sched.wait_idle(10)
        assert [t for o in got["c"] for t in o.tokens] == list(range(100, 105))
        assert got["c"][-1].finish_reason == "length"
    finally:
        sched.stop()
