"""Data path A: a NIXL READ of the owner's arena blocks into this server's pre-registered receive buffer.

Optional: `nixl-cu13==1.5.1` installed with --no-deps (its declared deps pull CUDA torch), imported lazily as
`nixl_cu13`. UCX picks the transport (TCP or CMA on one host, RDMA on a fabric; `UCX_TLS` / `UCX_NET_DEVICES`).
Both buffers are registered once at start-up and never deregistered while the server lives, so a descriptor can
never point at unmapped memory; the bytes are still verified (digest, generation) before import, because a
transport-level DONE does not prove the owner did not reuse the memory (serving-kv-handoff.md §2.1). Agent
metadata travels over the authenticated KvPeer call, never through NIXL's 0.0.0.0 listener, never pickled.

NIXL's own progress thread spins a core (measured: ~0.8 core per idle agent), so it is off: the puller progresses
its READ by polling it, and the owner — whose progress a GET emulated over TCP needs — polls only while one of
its NIXL leases lives (`progress_while`).
"""

from __future__ import annotations

import threading
import time

import numpy as np


def available() -> bool:
    try:
        import nixl_cu13  # noqa: F401
    except ImportError:
        return False
    return True


class NixlError(RuntimeError):
    """A NIXL transfer failed or timed out: the caller falls back (once) to the chunked path."""


class NixlEndpoint:
    def __init__(self, name: str, arena: np.ndarray, recv_bytes: int):
        from nixl_cu13._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.name = name
        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False,
                                                        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        self.arena, self.recv = arena, np.zeros(recv_bytes, np.uint8)
        for buf in (arena, self.recv):
            self.agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        self._peers: dict[str, bytes] = {}
        self._lock = threading.Lock()  # one READ at a time into the receive buffer
        self._serving: list = []       # owner side: predicates "a NIXL lease still lives"
        self._serving_lock = threading.Lock()

    def progress_while(self, alive) -> None:
        """Owner side: drive this agent's progress (every ~50 µs) until `alive()` is false for every caller."""
        with self._serving_lock:
            self._serving.append(alive)
            if len(self._serving) > 1:
                return
        threading.Thread(target=self._progress, name="dsjax-nixl-progress", daemon=True).start()

    def _progress(self) -> None:
        while True:
            with self._serving_lock:
                self._serving = [alive for alive in self._serving if alive()]
                if not self._serving:
                    return
            self.agent.get_new_notifs()  # progresses the UCX worker (no progress thread)
            time.sleep(0.00005)

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def _connect(self, agent: str, metadata: bytes) -> None:
        if self._peers.get(agent) != metadata:  # new peer, or the owner restarted under the same name
            if agent in self._peers:
                self.forget(agent)
            self.agent.add_remote_agent(metadata)
            self._peers[agent] = metadata

    def forget(self, agent: str) -> None:
        """After a failure: drop the peer so the next contact handshakes again (no stuck dead agents)."""
        self._peers.pop(agent, None)
        try:
            self.agent.remove_remote_agent(agent)
        except Exception:
            pass

    def read(self, agent: str, metadata: bytes, segments: list[tuple[int, int]], timeout_s: float) -> bytes:
        total = sum(n for _, n in segments)
        if total > self.recv.size:
            raise NixlError(f"{total} bytes exceed the {self.recv.size}-byte receive buffer")
        with self._lock:
            try:
                self._connect(agent, metadata)
                local, at = [], self.recv.ctypes.data
                for _, n in segments:
                    local.append((at, n, 0))
                    at += n
                handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                                    self.agent.get_xfer_descs([(a, n, 0) for a, n in segments],
                                                                              "DRAM"), agent)
                try:
                    state, end = self.agent.transfer(handle), time.monotonic() + timeout_s
                    while state not in ("DONE", "ERR"):
                        if time.monotonic() > end:
                            raise NixlError(f"NIXL READ from {agent} timed out after {timeout_s:.2f} s")
                        time.sleep(0.0005)
                        state = self.agent.check_xfer_state(handle)
                    if state != "DONE":
                        raise NixlError(f"NIXL READ from {agent} failed")
                finally:
                    self.agent.release_xfer_handle(handle)
            except NixlError:
                self.forget(agent)
                raise
            except Exception as e:  # nixlRemoteDisconnectError & co
                self.forget(agent)
                raise NixlError(f"NIXL READ from {agent}: {type(e).__name__}: {e}") from None
            return self.recv[:total].tobytes()
