"""Redis as a hint of who owns a conversation's KV (serving-kv-handoff.md §8.3). The owner is the authority:
any Redis failure, timeout or stale entry means "recompute", never wrong tokens.

Keys (the `{cid}` hash tag keeps one conversation's keys in one Cluster slot, so each Lua script touches one slot):
- `kv:{cid}:own`   hash {srv, epoch, gen, ntok, compat}, PX = retention, rewritten by the owner after each turn;
- `kv:{cid}:epoch` INCR fencing counter: every claim gets a larger epoch (last writer wins, ordered);
- `srv:<id>`       hash {kvpeer, boot}, PX ~10 s, renewed every ~3 s by each live server.
Conversation ids are HMAC(cluster secret, tenant ‖ client key): tenants never share a name.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading

import redis

log = logging.getLogger("dsjax.serving")

_CLAIM = """
local epoch = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'srv', ARGV[1], 'epoch', epoch, 'gen', ARGV[2], 'ntok', ARGV[3], 'compat', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return epoch
"""
_DROP_IF = """
if redis.call('HGET', KEYS[1], 'srv') == ARGV[1] and redis.call('HGET', KEYS[1], 'epoch') == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
_LOOKUP = """
local own = redis.call('HGETALL', KEYS[1])
if #own == 0 then return {own, {}} end
local srv = nil
for i = 1, #own, 2 do if own[i] == 'srv' then srv = own[i + 1] end end
return {own, redis.call('HGETALL', 'srv:' .. srv)}
"""


def conversation_id(secret: bytes, tenant: str, key: str) -> str:
    return hmac.new(secret, f"{tenant}\x00{key}".encode(), hashlib.sha256).hexdigest()[:32]


def _pairs(flat) -> dict:
    flat = [x.decode() if isinstance(x, bytes) else x for x in flat]
    return dict(zip(flat[::2], flat[1::2]))


class Ownership:
    """One server's view of Redis. Every call is bounded by `timeout_s`; failures raise `redis.RedisError`."""

    def __init__(self, url: str, server_id: str, boot_id: str, kvpeer_addr: str, *, timeout_s: float = 0.05,
                 retention_ms: int = 30 * 60 * 1000, liveness_ms: int = 10_000):
        self.r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.server_id, self.boot_id, self.kvpeer_addr = server_id, boot_id, kvpeer_addr
        self.retention_ms, self.liveness_ms = retention_ms, liveness_ms
        self._claim, self._drop_if, self._lookup = (self.r.register_script(s) for s in (_CLAIM, _DROP_IF, _LOOKUP))
        self._stop = threading.Event()

    def claim(self, cid: str, gen: int, ntok: int, compat: str) -> int:
        return int(self._claim(keys=[f"kv:{{{cid}}}:own", f"kv:{{{cid}}}:epoch"],
                               args=[self.server_id, gen, ntok, compat, self.retention_ms]))

    def drop_if(self, cid: str, srv: str, epoch: str) -> bool:
        """Compare-and-delete: only the entry still naming `srv` at `epoch` goes (a newer claim survives)."""
        return bool(self._drop_if(keys=[f"kv:{{{cid}}}:own"], args=[srv, epoch]))

    def lookup(self, cid: str) -> tuple[dict, dict]:
        """(owner record, owner's liveness record); empty dicts when absent or the owner is not alive."""
        own, srv = self._lookup(keys=[f"kv:{{{cid}}}:own"])
        return _pairs(own), _pairs(srv)

    def heartbeat(self) -> None:
        key = f"srv:{self.server_id}"
        with self.r.pipeline() as p:
            p.hset(key, mapping={"kvpeer": self.kvpeer_addr, "boot": self.boot_id})
            p.pexpire(key, self.liveness_ms)
            p.execute()

    def start_heartbeat(self, every_s: float = 3.0) -> None:
        def loop():
            while not self._stop.is_set():
                try:
                    self.heartbeat()
                except redis.RedisError as e:
                    log.warning("redis heartbeat failed: %s", e)
                self._stop.wait(every_s)
        threading.Thread(target=loop, name="dsjax-kv-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self.r.delete(f"srv:{self.server_id}")
        except redis.RedisError:
            pass
