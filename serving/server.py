"""`dsjax serve`: load, check memory, warm up, then serve HTTP and gRPC from one process until SIGTERM drains it.

Start-up order: the ports open first (health says NOT_SERVING / 503 "starting"), warm-up compiles every
program the engine runs (persistent compilation cache on), then health turns SERVING and the time to ready is
logged. SIGTERM or SIGINT: health turns NOT_SERVING, new requests get 503 / UNAVAILABLE, running requests
finish (up to --drain-timeout, then they are aborted), and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time

from dsjax.serving.auth import ApiKey
from dsjax.serving.config import ServeConfig, add_serve_args, from_args
from dsjax.serving.engine import SlotEngine
from dsjax.serving.metrics import Metrics
from dsjax.serving.openai_protocol import Limits
from dsjax.serving.scheduler import Scheduler
from dsjax.serving.service import ModelInfo, Service

log = logging.getLogger("dsjax.serving")


def check_memory(cfg: ServeConfig, model_cfg, max_model_len: int) -> str:
    """Refuse a max-num-seqs x max-model-len that does not fit (dsjax.plan's estimate vs this device's memory)."""
    import jax

    from dsjax.errors import ConfigError
    from dsjax.plan import mem_policy, plan

    p = plan(model_cfg, tp=cfg.tensor_parallel_size, dp=cfg.data_parallel_size, max_seq_len=max_model_len,
             batch=cfg.max_num_seqs, mem_fraction=cfg.mem_fraction)
    need = p.get("per_device_total")
    if need is None:
        return f"memory check skipped: {'; '.join(p['notes'])}"
    need += cfg.prefix_cache_entries * p["state"]["per_device_total"] // p["slots_per_device"]  # cached rows
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    if stats.get("bytes_limit"):
        have, where = int(stats["bytes_limit"]), f"{dev.device_kind} allocator limit"
    else:  # CPU: what the host can still give
        have, where = _host_available(), "host memory available"
        have = int(have * mem_policy(cfg.mem_fraction)["mem_fraction"]) if cfg.mem_fraction else have
    msg = (f"plan: {need / 1e9:.2f} GB per device for {cfg.max_num_seqs} sequences x {max_model_len} tokens "
           f"(weights, decode state, workspace, {cfg.prefix_cache_entries} prefix-cache rows); "
           f"{where}: {have / 1e9:.2f} GB")
    if need > have and not cfg.skip_memory_check:
        raise ConfigError(f"--max-num-seqs {cfg.max_num_seqs} x --max-model-len {max_model_len} does not fit: {msg}. "
                          "Lower either, add devices (--tensor-parallel-size), or pass --skip-memory-check")
    return msg


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _model_config(cfg: ServeConfig):
    import dsjax
    from dsjax import checkpoint, orbax_io
    from dsjax.assets import BUNDLED, resolve
    from dsjax.config import PRESETS
    from dsjax.errors import ConfigError

    path = resolve(cfg.model)
    if cfg.model in PRESETS:
        base = dsjax.preset(cfg.model)
    elif not os.path.isdir(path):
        raise ConfigError(f"--model {cfg.model!r} is neither a checkpoint directory, a bundled checkpoint "
                          f"({', '.join(BUNDLED)}) nor a known preset; presets: {', '.join(sorted(PRESETS))}")
    elif orbax_io.is_orbax_dir(path):
        base = orbax_io.read_config(path)
    else:
        base = checkpoint.checkpoint_config(path)
    return base.with_numerics(cfg.numerics)


def build(cfg: ServeConfig, model=None):
    """Everything but the sockets: model, engine, scheduler, service. `model` skips loading (tests)."""
    import dsjax
    from dsjax.api import DEFAULT_COMPILATION_CACHE
    from dsjax.tokenizer import load_tokenizer

    if model is None:
        model_cfg = _model_config(cfg)
        max_len = cfg.max_model_len or min(model_cfg.max_position_embeddings, 4096)
        log.info(check_memory(cfg, model_cfg, max_len))
        cache = {"default": DEFAULT_COMPILATION_CACHE, "none": None}.get(cfg.compilation_cache, cfg.compilation_cache)
        mesh = None
        if cfg.tensor_parallel_size * cfg.data_parallel_size > 1:
            mesh = dsjax.make_mesh(tp=cfg.tensor_parallel_size, dp=cfg.data_parallel_size)
        model = dsjax.load(cfg.model, mesh=mesh, numerics=cfg.numerics, kernels=cfg.kernels, max_seq_len=max_len,
                           max_batch=cfg.max_num_seqs, seed=cfg.weights_seed, compilation_cache=cache)
    family = "v4.1" if model.cfg.family == "v4.1" else "v4"
    tokenizer = load_tokenizer(family)
    metrics = Metrics(cfg.model_id)
    metrics.slots.set(cfg.max_num_seqs)
    k = cfg.num_speculative_tokens
    if k and (family != "v4" or not model.cfg.n_mtp_layers):
        from dsjax.errors import ConfigError
        raise ConfigError(f"--speculative-config: {model.cfg.name} has no MTP head the server can draft with "
                          "(V4 family with n_mtp_layers > 0)")
    engine = SlotEngine(model, slots=cfg.max_num_seqs, prefill_chunk=cfg.prefill_chunk,
                        steps_per_dispatch=cfg.steps_per_dispatch, max_top_logprobs=cfg.max_logprobs,
                        prefix_cache_entries=cfg.prefix_cache_entries, num_speculative_tokens=k,
                        prefill_schedule=cfg.prefill_schedule)
    kv = _kv_handoff(cfg, model, engine, metrics) if cfg.kv_peer_port >= 0 else None
    scheduler = Scheduler(engine, max_queue=cfg.max_queue, metrics=metrics, kv=kv)
    info = ModelInfo(id=cfg.model_id, source=model.source, family=family, max_model_len=model.max_seq_len,
                     max_num_seqs=cfg.max_num_seqs, vocab_size=model.cfg.vocab_size,
                     eos_token_id=model.cfg.eos_token_id)
    limits = Limits(max_model_len=model.max_seq_len, max_logprobs=0 if k else cfg.max_logprobs, speculative=k > 0,
                    fetch_remote_images=cfg.allow_remote_images)
    return Service(info, tokenizer, scheduler, limits, default_thinking=cfg.default_thinking, metrics=metrics, kv=kv,
                   vision_cfg=model.cfg if model.cfg.vision_enabled else None)


def _kv_handoff(cfg: ServeConfig, model, engine, metrics):
    """The host KV store, its byte layout (compat hash over model, weights and state layout) and the optional
    NIXL endpoint; Redis ownership is attached once the KvPeer port is bound (Server.start)."""
    import jax
    import jax.numpy as jnp

    from dsjax.errors import ConfigError
    from dsjax.serving import kv_nixl
    from dsjax.serving.kv_handoff import KvHandoff
    from dsjax.serving.kv_layout import Layout
    from dsjax.serving.kv_store import HostKvStore
    from dsjax.serving.prefix_cache import take_row

    template = jax.eval_shape(take_row, engine.state, jnp.int32(0))
    layout = Layout(template, engine.max_seq, f"{model.cfg!r}|{model.source}")
    store = HostKvStore(cfg.kv_store_bytes, lease_ttl_s=cfg.kv_lease_seconds)
    nixl = None
    if cfg.kv_transport == "nixl" and not kv_nixl.available():
        raise ConfigError("--kv-transport nixl: nixl_cu13 is not installed (pip install --no-deps nixl-cu13==1.5.1)")
    if cfg.kv_transport != "grpc" and kv_nixl.available():
        nixl = kv_nixl.NixlEndpoint(f"{_server_id(cfg)}-{os.getpid()}", store.arena, cfg.kv_store_bytes)
    log.info("KV handoff: store %.0f MB, data path %s, layout %s", cfg.kv_store_bytes / 1e6,
             "NIXL + chunked gRPC" if nixl else "chunked gRPC", layout.compat[:12])
    return KvHandoff(layout, store, None, token=cfg.cluster_token, server_id=_server_id(cfg), nixl=nixl,
                     metrics=metrics, budget_s=cfg.kv_handoff_timeout, alpha=cfg.kv_handoff_alpha,
                     floor_s=cfg.kv_handoff_floor, prefill_chunk=cfg.prefill_chunk)


def _server_id(cfg: ServeConfig) -> str:
    return cfg.server_id or f"{socket.gethostname()}-{os.getpid()}"


class _Uvicorn:
    """uvicorn without its own signal handling (the server drains on SIGTERM itself)."""

    def __init__(self, app, sock: socket.socket, cfg: ServeConfig):
        import uvicorn

        class Server(uvicorn.Server):
            def capture_signals(self):
                return contextlib.nullcontext()

        conf = uvicorn.Config(app, log_level="warning", lifespan="off", ssl_certfile=cfg.ssl_certfile,
                              ssl_keyfile=cfg.ssl_keyfile, timeout_graceful_shutdown=5, access_log=False)
        self.server, self.sock = Server(conf), sock

    async def serve(self):
        await self.server.serve(sockets=[self.sock])

    def stop(self):
        self.server.should_exit = True


class Server:
    """One process: HTTP + gRPC over one Service. `start` returns once the ports are open; `ready` after warm-up."""

    def __init__(self, cfg: ServeConfig, svc: Service):
        from dsjax.serving.grpc_service import GrpcServer
        from dsjax.serving.http_app import build_app

        self.cfg, self.svc = cfg, svc
        key = ApiKey(cfg.api_key)
        self.app = build_app(svc, api_key=key, max_request_bytes=cfg.max_request_bytes, metrics=svc.metrics)
        self.grpc = None
        if cfg.grpc_port >= 0:
            self.grpc = GrpcServer(svc, key, max_request_bytes=cfg.max_request_bytes, metrics=svc.metrics)
        self.http_port = self.grpc_port = self.kv_peer_port = None
        self.kv_peer = None
        self._stopped = None
        self._tasks = []

    async def start(self) -> None:
        import grpc

        self._stopped = asyncio.Event()
        family = socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.cfg.host, self.cfg.port))
        sock.listen(1024)
        sock.setblocking(False)
        self.http_port = sock.getsockname()[1]
        self.http = _Uvicorn(self.app, sock, self.cfg)
        self._tasks.append(asyncio.create_task(self.http.serve()))
        if self.grpc:
            creds = None
            if self.cfg.ssl_certfile:
                with open(self.cfg.ssl_certfile, "rb") as c, open(self.cfg.ssl_keyfile, "rb") as k:
                    creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            self.grpc_port = self.grpc.bind(self.cfg.host, self.cfg.grpc_port, creds)
            await self.grpc.set_serving(False)
            await self.grpc.server.start()
        if self.svc.kv is not None:
            await self._start_kv_peer()
        log.info("listening: HTTP %s:%s, gRPC %s, KvPeer %s", self.cfg.host, self.http_port,
                 f"{self.cfg.host}:{self.grpc_port}" if self.grpc else "off",
                 f"{self.cfg.host}:{self.kv_peer_port}" if self.kv_peer else "off")

    async def _start_kv_peer(self) -> None:
        import uuid

        from dsjax.serving.kv_ownership import Ownership
        from dsjax.serving.kv_peer import KvPeerServer, KvPeerServicer

        kv, boot = self.svc.kv, uuid.uuid4().hex[:12]
        servicer = KvPeerServicer(kv.store, kv.layout, self.cfg.cluster_token, boot, nixl=kv.nixl,
                                  chunk_bytes=self.cfg.kv_chunk_bytes, chunk_delay_s=self.cfg.kv_test_chunk_delay)
        self.kv_peer = KvPeerServer(servicer)
        self.kv_peer_port = self.kv_peer.bind(self.cfg.host, self.cfg.kv_peer_port)
        await self.kv_peer.server.start()
        if self.cfg.redis_url:
            host = self.cfg.host if self.cfg.host not in ("0.0.0.0", "::") else socket.gethostbyname(socket.gethostname())
            kv.ownership = Ownership(self.cfg.redis_url, kv.server_id, boot, f"{host}:{self.kv_peer_port}")

    async def warm_up(self, t0: float) -> None:
        await asyncio.to_thread(self.svc.scheduler.engine.warm_up)
        self.svc.scheduler.start()
        if self.svc.kv is not None and self.svc.kv.ownership is not None:
            self.svc.kv.ownership.start_heartbeat()
        self.svc.ready = True
        if self.grpc:
            await self.grpc.set_serving(True)
        log.info("ready in %.1f s (%s, %d slots x %d tokens)", time.perf_counter() - t0, self.svc.info.id,
                 self.svc.info.max_num_seqs, self.svc.info.max_model_len)

    async def drain(self) -> None:
        """Stop taking requests, let running ones finish (up to drain_timeout), then close everything."""
        sched = self.svc.scheduler
        sched.draining = True
        self.svc.ready = False
        log.info("draining: %d running, %d queued", sched.running(), sched.queue_depth())
        if self.grpc:
            await self.grpc.health.enter_graceful_shutdown()
        if not await asyncio.to_thread(sched.wait_idle, self.cfg.drain_timeout):
            log.warning("drain timeout: aborting what still runs")
        await asyncio.to_thread(sched.stop)
        await asyncio.sleep(0.05)  # let the last stream frames go out
        self.http.stop()
        if self.grpc:
            await self.grpc.server.stop(grace=1.0)
        if self.kv_peer:
            if self.svc.kv.ownership is not None:
                await asyncio.to_thread(self.svc.kv.ownership.stop)
            await self.kv_peer.server.stop(grace=1.0)
            await self.svc.kv.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def _run(cfg: ServeConfig, svc: Service, t0: float) -> None:
    server = Server(cfg, svc)
    await server.start()
    loop = asyncio.get_running_loop()
    draining = []

    def on_signal():
        if not draining:
            draining.append(asyncio.create_task(server.drain()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await server.warm_up(t0)
    await server.wait_stopped()
    log.info("stopped")


def _log_to_stderr(level: str) -> None:
    """Our own handler: the root logger may already be configured by an imported library (basicConfig no-ops)."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(level.upper())


def serve(cfg: ServeConfig) -> int:
    _log_to_stderr(cfg.log_level)
    t0 = time.perf_counter()
    svc = build(cfg)
    asyncio.run(_run(cfg, svc, t0))
    return 0


class ServerThread:
    """A server on its own event loop in a daemon thread (tests, notebooks): `ServerThread(cfg, svc).start()`."""

    def __init__(self, cfg: ServeConfig, svc: Service):
        self.cfg, self.svc = cfg, svc
        self.server: Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._up = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout: float = 600) -> "ServerThread":
        self._thread = threading.Thread(target=self._main, name="dsjax-serve", daemon=True)
        self._thread.start()
        if not self._up.wait(timeout):
            raise TimeoutError("the server did not become ready")
        if self._error:
            raise self._error
        return self

    def _main(self):
        async def main():
            try:
                self.server = Server(self.cfg, self.svc)
                await self.server.start()
                self.loop = asyncio.get_running_loop()
                await self.server.warm_up(time.perf_counter())
            except BaseException as e:  # surfaced by start()
                self._error = e
                self._up.set()
                return
            self._up.set()
            await self.server.wait_stopped()
        asyncio.run(main())

    def stop(self, timeout: float = 60) -> None:
        if self.loop and self.server:
            asyncio.run_coroutine_threadsafe(self.server.drain(), self.loop).result(timeout)
        self._thread.join(timeout)


def main(argv=None) -> int:
    """`dsjax-serve` (the same flags as `dsjax serve`)."""
    from dsjax.errors import DsjaxError

    p = argparse.ArgumentParser(prog="dsjax-serve", description=__doc__.split("\n")[0])
    add_serve_args(p)
    args = p.parse_args(argv)
    try:
        return serve(from_args(args))
    except (DsjaxError, NotImplementedError) as e:  # as `dsjax serve`: e.g. a V4.1 model, not runnable yet
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
