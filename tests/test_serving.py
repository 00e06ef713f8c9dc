"""`dsjax serve` end to end on the tiny model, with real clients on 127.0.0.1: the official `openai` package,
a gRPC client that finds the service by reflection, 16 concurrent streams against offline greedy output,
cancellation and deadlines freeing slots, and bad input answered with the right status while serving goes on.

One server for the module (one model load, one warm-up; tiny-v4 cut to 3 layers). numerics="transformers" is
batch-invariant, so a request's tokens cannot depend on its slot, its neighbours or how its prompt was chunked:
served greedy output must equal `Model.generate` exactly. The offline runs use the server's decode shapes (4 slots,
16 steps per dispatch, 5 top logprobs; the server's loop also carries penalties, so the two compile separately);
16 streams over 4 slots also exercise the queue and requests joining a running batch.
"""

import concurrent.futures
import json
import time

import grpc
import numpy as np
import pytest

import dsjax
from dsjax.params import init_params
from dsjax.serving.config import ServeConfig
from dsjax.serving.server import ServerThread, build

pytestmark = pytest.mark.xdist_group("serving")

KEY = "test-key-0123456789"
SLOTS, STEPS, MAX_LEN, TOP, NEW = 4, 16, 128, 5, 8


# tiny-v4 cut to one layer of each kind (window + hash routing, CSA, HCA) and the MTP layer, with its real vocabulary
# (the tokenizer's): nothing here depends on depth, which only added compile time to the warm-up and offline runs
SMALL = dict(n_layers=3, compress_ratios=(0, 4, 16, 0), n_hash_layers=1)


@pytest.fixture(scope="module")
def served():
    cfg = dsjax.preset("tiny-v4", **SMALL).with_numerics("transformers")
    model = dsjax.Model(cfg, init_params(cfg, 0), source="test", max_seq_len=MAX_LEN, max_batch=SLOTS)
    cfg = ServeConfig(model="tiny-v4", numerics="transformers", max_num_seqs=SLOTS, max_model_len=MAX_LEN, port=0,
                      grpc_port=0, api_key=KEY, prefill_chunk=32, steps_per_dispatch=STEPS, max_logprobs=TOP,
                      max_request_bytes=64 << 10, compilation_cache="none")
    t0 = time.perf_counter()
    st = ServerThread(cfg, build(cfg, model=model)).start(timeout=300)
    print(f"\n[serving] ready after {time.perf_counter() - t0:.1f} s (warm-up compiles)")
    yield model, st
    st.stop()


@pytest.fixture(scope="module")
def base(served):
    return f"http://127.0.0.1:{served[1].server.http_port}"


@pytest.fixture(scope="module")
def client(base):
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=60, max_retries=0)


def _prompts(n, seed=1):
    rng = np.random.default_rng(seed)  # 17..32 tokens: one prefill bucket offline
    return [[0] + rng.integers(3, 120_000, size=int(rng.integers(16, 32))).tolist() for _ in range(n)]


PROMPTS = _prompts(16)


@pytest.fixture(scope="module")
def offline(served):
    """Greedy `Model.generate` of PROMPTS, in batches of the server's slot count."""
    model = served[0]
    out = []
    for i in range(0, len(PROMPTS), SLOTS):
        out += model.generate(PROMPTS[i:i + SLOTS], NEW, temperature=0.0, steps_per_dispatch=STEPS, logprobs=TOP)
    return out


def _wait_idle(svc, timeout=60.0):  # returns as soon as idle; a dispatch may take seconds on a loaded CPU
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if svc.scheduler.running() == 0 and svc.scheduler.queue_depth() == 0:
            return True
        time.sleep(0.02)
    return False


def test_concurrent_streams_equal_offline_greedy(served, client, offline):
    """16 streams at once over 4 slots (they queue, then join while others decode) == offline greedy."""
    model, st = served
    prompts = PROMPTS

    def one(p):
        ids, finish = [], None
        stream = client.completions.create(model="tiny-v4", prompt=p, max_tokens=NEW, temperature=0, stream=True,
                                           logprobs=1, extra_body={"stop_token_ids": []})
        for chunk in stream:
            c = chunk.choices[0]
            if c.logprobs and c.logprobs.tokens:
                ids.extend(c.logprobs.tokens)
            finish = c.finish_reason or finish
        return ids, finish

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        served_out = list(pool.map(one, prompts, timeout=120))
    tok = st.svc.tokenizer
    for i, ((pieces, finish), g) in enumerate(zip(served_out, offline)):
        assert pieces == [tok.decode([t]) for t in g.tokens], f"prompt {i}"
        assert finish == g.finish_reason, f"prompt {i}"
    assert _wait_idle(st.svc)


def test_grpc_reflection_generate_equals_offline(served, offline):
    """A client that knows nothing but the address: reflection -> descriptors -> Generate; health; model info."""
    from google.protobuf import descriptor_pool, message_factory
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    model, st = served
    with grpc.insecure_channel(f"127.0.0.1:{st.server.grpc_port}") as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        names = set(db.get_services())
        assert {"dsjax.serving.v1.Engine", "grpc.health.v1.Health"} <= names
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        service = descriptor_pool.DescriptorPool(db).FindServiceByName("dsjax.serving.v1.Engine")

        def rpc(name, kind):
            m = service.methods_by_name[name]
            req, resp = (message_factory.GetMessageClass(t) for t in (m.input_type, m.output_type))
            call = getattr(ch, kind)(f"/{service.full_name}/{name}", request_serializer=req.SerializeToString,
                                     response_deserializer=resp.FromString)
            return req, call

        auth = (("authorization", f"Bearer {KEY}"),)
        Info, info = rpc("GetModelInfo", "unary_unary")
        got = info(Info(), metadata=auth, timeout=10)
        assert (got.model_id, got.max_model_len, got.max_num_seqs) == ("tiny-v4", MAX_LEN, SLOTS)
        with pytest.raises(grpc.RpcError) as e:
            info(Info(), metadata=(("authorization", "Bearer wrong"),), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

        Gen, generate = rpc("Generate", "unary_stream")
        prompt = PROMPTS[3]
        req = Gen(request_id="grpc-1", max_tokens=NEW, top_logprobs=2)
        req.input_ids.ids.extend(prompt)
        req.sampling.temperature = 0.0
        ids, complete, usage = [], None, None
        for r in generate(req, metadata=auth, timeout=60):
            assert r.request_id == "grpc-1"
            if r.WhichOneof("response") == "chunk":
                ids += list(r.chunk.token_ids)
                assert len(r.chunk.logprobs) == len(r.chunk.token_ids)
                assert all(len(lp.top) == 2 for lp in r.chunk.logprobs)
                usage = r.chunk.usage
            else:
                complete = r.complete
        assert ids == offline[3].tokens
        assert complete is not None and complete.usage.completion_tokens == len(ids) == usage.completion_tokens
        assert complete.usage.prompt_tokens == len(prompt)

        bad = Gen(max_tokens=5)
        bad.input_ids.ids.extend([0] * MAX_LEN)
        with pytest.raises(grpc.RpcError) as e:
            list(generate(bad, metadata=auth, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in e.value.details()

        # a deadline that expires mid-generation aborts the request and frees its slot
        long = Gen()  # max_tokens 0: up to the context
        long.input_ids.ids.extend(prompt)
        long.sampling.temperature = 0.0
        with pytest.raises(grpc.RpcError) as e:
            for _ in generate(long, metadata=auth, timeout=0.3, wait_for_ready=True):
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert _wait_idle(st.svc), "the expired request still holds a slot"

        # client cancellation after the first chunk; then Abort of an unknown id says not found
        call = generate(long, metadata=auth, timeout=60)
        next(call)
        call.cancel()
        assert _wait_idle(st.svc), "the cancelled request still holds a slot"
        Abort, abort = rpc("Abort", "unary_unary")
        assert not abort(Abort(request_id="nope"), metadata=auth, timeout=10).found


def test_openai_chat_stream_usage_logprobs_stop(served, client):
    model, st = served
    messages = [{"role": "user", "content": "Name three rivers."}]
    off = {"thinking": {"type": "disabled"}}
    calls = {  # independent requests at once: they share dispatches (greedy and seeded rows in one batch)
        "full": lambda: client.chat.completions.create(model="tiny-v4", messages=messages, max_tokens=8, temperature=0,
                                                       logprobs=True, top_logprobs=3, extra_body=off),
        "stream": lambda: list(client.chat.completions.create(
            model="tiny-v4", messages=messages, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"chat_template_kwargs": {"thinking": False}})),
        "thought": lambda: client.chat.completions.create(model="tiny-v4", messages=messages, max_tokens=6,
                                                          temperature=0),
        "seed_a": lambda: client.completions.create(model="tiny-v4", prompt="Once", max_tokens=6, temperature=1.0,
                                                    top_p=0.9, seed=123).choices[0].text,
        "seed_b": lambda: client.completions.create(model="tiny-v4", prompt="Once", max_tokens=6, temperature=1.0,
                                                    top_p=0.9, seed=123).choices[0].text,
    }
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        got = dict(zip(calls, pool.map(lambda f: f(), calls.values(), timeout=120)))
    full, chunks, thought = got["full"], got["stream"], got["thought"]
    choice = full.choices[0]
    assert choice.finish_reason in ("length", "stop") and full.usage.completion_tokens == 8
    assert len(choice.logprobs.content) == 8 and all(len(c.top_logprobs) == 3 for c in choice.logprobs.content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in choice.logprobs.content)
    # the same request streamed: same text; the usage chunk has no choices and comes last
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    # thinking on: the text goes to reasoning_content (no </think> from random weights)
    assert thought.choices[0].message.content == "" and thought.usage.completion_tokens_details.reasoning_tokens == 6
    assert getattr(thought.choices[0].message, "reasoning_content", None)
    # seeded sampling is reproducible whatever shares the batch
    assert got["seed_a"] == got["seed_b"]
    # stop: a string from the middle of the greedy text ends the output before it
    cut = text[len(text) // 2:len(text) // 2 + 3]
    if cut.strip():
        stopped = client.chat.completions.create(model="tiny-v4", messages=messages, max_tokens=8, temperature=0,
                                                 stop=[cut], extra_body=off)
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].message.content == text[:text.find(cut)]
    assert [m.id for m in client.models.list().data] == ["tiny-v4"]


def test_http_stream_cancel_frees_slot(served, base):
    import httpx2 as httpx

    st = served[1]
    body = {"model": "tiny-v4", "prompt": "a long story", "max_tokens": MAX_LEN - 20, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            first = next(r.iter_lines())
            assert first.startswith("data: ")
            assert st.svc.scheduler.running() == 1
    assert _wait_idle(st.svc), "the disconnected stream still holds a slot"


BAD = [  # (headers, body bytes or JSON, status, text the message must contain)
    ({}, {"model": "tiny-v4", "prompt": "x"}, 401, "API key"),
    ({"Authorization": "Bearer nope"}, {"model": "tiny-v4", "prompt": "x"}, 401, "API key"),
    (None, b"{not json", 400, "not valid JSON"),
    (None, b'{"model": "tiny-v4", "prompt": "\xff\xfe"}', 400, "UTF-8"),
    (None, {"model": "other", "prompt": "x"}, 404, "does not exist"),
    (None, {"model": "tiny-v4", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (None, {"model": "tiny-v4", "prompt": [0] * MAX_LEN}, 400, "context length"),
    (None, {"model": "tiny-v4", "prompt": "x", "best_of": 1, "frobnicate": True}, 400, "frobnicate"),
    (None, {"model": "tiny-v4", "prompt": "x", "n": 99}, 400, "n must lie in"),
    (None, {"model": "tiny-v4", "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty must lie in"),
    (None, {"model": "tiny-v4", "prompt": "x", "logit_bias": {"999999": 1}}, 400, "out of range"),
    (None, {"model": "tiny-v4", "prompt": "x", "temperature": -1}, 400, "temperature"),
    (None, {"model": "tiny-v4", "prompt": "x" * (70 << 10)}, 413, "limit"),
]


def test_bad_input_gets_right_status_and_server_keeps_serving(served, base):
    import httpx2 as httpx

    with httpx.Client(timeout=30) as c:
        for headers, body, status, needle in BAD:
            h = {"Authorization": f"Bearer {KEY}"} if headers is None else headers
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = c.post(base + "/v1/completions", content=content, headers={**h, "Content-Type": "application/json"})
            assert r.status_code == status, (body if isinstance(body, bytes) else list(body), r.text)
            assert needle in r.json()["error"]["message"], r.text
        r = c.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny-v4", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 9,
                         "logprobs": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        ok = c.post(base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                    json={"model": "tiny-v4", "prompt": "still here", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert c.get(base + "/health").json() == {"status": "ok"}
        metrics = c.get(base + "/metrics").text
        assert "dsjax_time_to_first_token_seconds_count" in metrics and "dsjax_running_slots 0.0" in metrics


def test_prefix_cache_continues_a_conversation(served, client):
    """The next turn extends the last prompt: its state row is reused (cached_tokens), the output is unchanged."""
    model, st = served
    first = PROMPTS[5][:18]
    turn = first + [5, 6, 7, 8]
    client.completions.create(model="tiny-v4", prompt=first, max_tokens=2, temperature=0)
    r = client.completions.create(model="tiny-v4", prompt=turn, max_tokens=NEW, temperature=0, logprobs=1)
    assert r.usage.prompt_tokens_details.cached_tokens == len(first)
    offline = model.generate([turn] + PROMPTS[1:SLOTS], NEW, temperature=0.0, steps_per_dispatch=STEPS,
                             logprobs=TOP)[0]
    assert r.choices[0].logprobs.tokens == [st.svc.tokenizer.decode([t]) for t in offline.tokens]


def test_requests_join_and_leave_without_recompiling(served, client):
    """After warm-up, nothing compiles again: prompts of 1 to 70 tokens (multi-chunk prefill), greedy and sampled
    rows, logprobs or not, stop strings, penalties, a prefix-cache continuation, cancellations — all in one batch."""
    from jax import monitoring

    compiled = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kw.get("fun_name", "?"))

    rng = np.random.default_rng(11)
    prompts = [[0] + rng.integers(3, 120_000, size=n - 1).tolist() for n in (1, 5, 33, 70, 12, 40)]
    kinds = [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=1), dict(temperature=0, logprobs=3),
             dict(temperature=1.0, seed=2, stop=["e"], extra_body={"top_k": 5}), dict(temperature=0),
             dict(temperature=0, frequency_penalty=1.0, logit_bias={"5": 2})]
    monitoring.register_event_duration_secs_listener(listen)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            jobs = [pool.submit(client.completions.create, model="tiny-v4", prompt=p, max_tokens=3, **kw)
                    for p, kw in zip(prompts, kinds)]
            jobs.append(pool.submit(client.completions.create, model="tiny-v4", prompt=prompts[3] + [9, 9],
                                    max_tokens=2, extra_body={"top_k": 3}))
            for j in jobs:
                assert j.result(timeout=120).usage.completion_tokens >= 1
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert compiled == [], f"compiled after warm-up: {compiled}"


def test_penalties_and_logit_bias_follow_the_openai_definition(served, client, offline):
    """Served greedy tokens with presence/frequency penalties and logit_bias (gRPC and HTTP) == argmax of the
    penalised logits computed in numpy from the model's raw logits: mu[j] + bias[j] - c[j]·frequency -
    [c[j] > 0]·presence, c[j] counting token j in the output so far; and != plain greedy output."""
    from dsjax.serving.proto import engine_pb2 as pb
    from dsjax.serving.proto import engine_pb2_grpc as pb_grpc

    model, st = served
    prompt, greedy = PROMPTS[0], offline[0].tokens
    bias = {greedy[0]: -100.0, 7: 2.5}
    presence, frequency = 1.5, 0.75
    req = pb.GenerateRequest(max_tokens=NEW, input_ids=pb.TokenIds(ids=prompt), skip_text=True,
                             sampling=pb.SamplingParams(temperature=0.0, presence_penalty=presence,
                                                        frequency_penalty=frequency, logit_bias=bias))
    with grpc.insecure_channel(f"127.0.0.1:{st.server.grpc_port}") as ch:
        stream = pb_grpc.EngineStub(ch).Generate(req, metadata=(("x-api-key", KEY),), timeout=60)
        out = [t for r in stream if r.WhichOneof("response") == "chunk" for t in r.chunk.token_ids]
    r = client.completions.create(model="tiny-v4", prompt=prompt, max_tokens=NEW, temperature=0, logprobs=0,
                                  presence_penalty=presence, frequency_penalty=frequency,
                                  logit_bias={str(t): v for t, v in bias.items()})
    tok = st.svc.tokenizer
    assert r.choices[0].logprobs.tokens == [tok.decode([t]) for t in out]
    assert len(out) == NEW and out != greedy
    seq = prompt + out[:-1]  # one forward: the raw logits before every output token
    raw = np.asarray(model.logits([seq], positions=range(len(prompt) - 1, len(seq))))[0].astype(np.float64)
    for i in range(NEW):
        c = np.bincount(np.asarray(out[:i], np.int64), minlength=raw.shape[1]).astype(np.float64)
        mu = raw[i] - c * frequency - (c > 0) * presence
        for t, v in bias.items():
            mu[t] += v
        assert int(np.argmax(mu)) == out[i], f"step {i}: numpy picks {int(np.argmax(mu))}, the server {out[i]}"
