"""Real processes for the KV handoff tests: a `redis-server` and `dsjax serve` processes on free loopback ports.

Every wait is bounded; every process is stopped by its own pid. The servers share one compilation cache directory,
so only the first one compiles (the others load the programs from disk).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx2 as httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check, timeout: float, what: str, proc: subprocess.Popen | None = None, log: str | None = None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            tail = open(log).read()[-3000:] if log else ""
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}\n{tail}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready after {timeout} s")


class Redis:
    def __init__(self, workdir: str):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server; `make venv` does it)")
        self.exe, self.workdir, self.proc = exe, workdir, None
        for attempt in range(3):    # a chosen free port can be taken before redis binds it: fresh ports, bounded
            self.port = free_port()
            self.url = f"redis://127.0.0.1:{self.port}/0"
            try:
                self.start()
                break
            except RuntimeError:
                if attempt == 2:
                    raise

    def start(self) -> None:
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.workdir], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        import redis
        _wait(lambda: redis.Redis.from_url(self.url, socket_timeout=0.5).ping(), 20, "redis-server", self.proc)

    def client(self):
        import redis
        return redis.Redis.from_url(self.url, socket_timeout=2, decode_responses=True)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class ServeProcess:
    """`dsjax serve` in its own process; `url` once /health says ok."""

    def __init__(self, name: str, workdir: str, *, redis_url: str, token_file: str, api_key: str, cache_dir: str,
                 extra: tuple[str, ...] = (), env: dict | None = None):
        self.name = name
        self.log = os.path.join(workdir, f"{name}.log")
        self._flags = ["--model", "tiny-v4", "--numerics", "transformers", "--host", "127.0.0.1",
                       "--redis-url", redis_url, "--server-id", name, "--cluster-token-file", token_file,
                       "--api-key", api_key, "--compilation-cache", cache_dir, "--kv-store-bytes", str(16 << 20),
                       "--log-level", "info", *extra]
        self._env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "JAX_PLATFORMS": "cpu", **(env or {})}
        self._start("w")

    def _start(self, mode: str) -> None:
        """Fresh free ports, then the process (its log appended to on a restart)."""
        self.http, self.grpc, self.kv_peer = free_port(), free_port(), free_port()
        args = [sys.executable, "-m", "dsjax.serving.server", *self._flags, "--port", str(self.http),
                "--grpc-port", str(self.grpc), "--kv-peer-port", str(self.kv_peer)]
        with open(self.log, mode) as f:
            self.proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=self._env)
        self.url = f"http://127.0.0.1:{self.http}"

    def wait_ready(self, timeout: float = 300, attempts: int = 3) -> "ServeProcess":
        """A port `free_port` chose can be taken before the server binds it (CI, 2026-12-01: server A's gRPC
        port, by another listener on an ephemeral port — its own UCX agent, started just before, or in-process
        server B binding port 0): that start is retried on fresh ports, at most `attempts` times."""
        for attempt in range(attempts):
            try:
                _wait(lambda: httpx.get(self.url + "/health", timeout=2).status_code == 200, timeout,
                      f"server {self.name}", self.proc, self.log)
                return self
            except RuntimeError:
                with open(self.log) as f:
                    taken = "address already in use" in f.read().lower()    # gRPC's and uvicorn's words
                if not taken or attempt == attempts - 1:
                    raise
                self._start("a")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("dsjax_")}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
