"""Review evidence in Redis: the calibration Journal (semantic/calibration.py) shared by every replica
of a Redis-backed semantic cache, so an admin's verdict on one replica moves the tenant's cut on all.

Layout under `prefix` (default "strata:calibration:"):
    s:<entry id>   sorted set of the entry's hits awaiting a review, scored by P(same answer); members
                   JSON [tenant, group, probability, nonce]; the MAX_SERVED_PER_ENTRY lowest are kept
    e:<tenant>     list of the tenant's evidence, JSON [group, probability, right 0|1, entry id]
    f:<tenant>     hash "<entry id>:<group>" -> the lowest probability at which that entry was approved
    v:<tenant>     the tenant's version: bumped by each verdict and purge (replicas refit when it moves)
    v              bumped by a purge of everything          tenants   set of tenants with evidence

A verdict moves an entry's hits into the evidence in one Lua script, so two replicas never count a
hit twice. Probabilities travel as their repr text, so a floor compares exactly. Only numbers,
entry ids and tenant names are stored, never a question or an answer.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterable

from .calibration import MAX_SERVED_PER_ENTRY, Evidence
from .redis_store import SOCKET_TIMEOUT_S, RedisLink

_REVIEWED = """
local p, id, tenant, right = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local moved = 0
for _, member in ipairs(redis.call('ZRANGE', p .. 's:' .. id, 0, -1)) do
  local hit = cjson.decode(member)
  local owner, group, probability = hit[1], hit[2], hit[3]
  if owner == tenant then
    redis.call('RPUSH', p .. 'e:' .. tenant, cjson.encode({group, probability, right, id}))
    if right == '1' then
      local field = id .. ':' .. group
      local old = redis.call('HGET', p .. 'f:' .. tenant, field)
      if not old or tonumber(probability) < tonumber(old) then
        redis.call('HSET', p .. 'f:' .. tenant, field, probability)
      end
    end
    moved = moved + 1
  end
end
redis.call('DEL', p .. 's:' .. id)
if moved > 0 then redis.call('SADD', p .. 'tenants', tenant) end
redis.call('INCR', p .. 'v:' .. tenant)
return moved
"""


class RedisJournal:
    def __init__(self, url: str, prefix: str = "strata:calibration:", socket_timeout_s: float = SOCKET_TIMEOUT_S):
        self.prefix = prefix
        self.link = RedisLink(url, socket_timeout_s)
        self.client = self.link.client
        self.reviewed_script = self.client.register_script(_REVIEWED)

    def served(self, tenant: str, entry_id: int, group: str, probability: float) -> None:
        key = f"{self.prefix}s:{entry_id}"
        member = json.dumps([tenant, group, repr(probability), uuid.uuid4().hex[:12]])  # repr: exact in text

        def write(pipe) -> None:
            pipe.zadd(key, {member: probability})
            pipe.zremrangebyrank(key, MAX_SERVED_PER_ENTRY, -1)

        self.link.transaction(write)

    def reviewed(self, tenant: str, entry_id: int, right: bool) -> int:
        return int(self.link.call(self.reviewed_script, args=[self.prefix, entry_id, tenant, int(right)]))

    def evidence(self, tenant: str) -> list[Evidence]:
        rows = self.link.call(self.client.lrange, f"{self.prefix}e:{tenant}", 0, -1)
        out = []
        for row in rows:
            group, probability, right, _ = json.loads(row)
            out.append(Evidence(group, float(probability), right == "1"))
        return out

    def floor(self, tenant: str, entry_id: int, group: str) -> float:
        value = self.link.call(self.client.hget, f"{self.prefix}f:{tenant}", f"{entry_id}:{group}")
        return math.inf if value is None else float(value)

    def tenants(self) -> set[str]:
        return {t.decode() for t in self.link.call(self.client.smembers, self.prefix + "tenants")}

    def version(self, tenant: str) -> object:
        return tuple(self.link.call(self.client.mget, self.prefix + "v", f"{self.prefix}v:{tenant}"))

    def forget(self, entry_ids: Iterable[int], tenant: str | None = None) -> None:
        ids = list(entry_ids)

        def write(pipe) -> None:
            for entry_id in ids:
                pipe.delete(f"{self.prefix}s:{entry_id}")
            if tenant is not None:
                pipe.delete(f"{self.prefix}e:{tenant}", f"{self.prefix}f:{tenant}")
                pipe.srem(self.prefix + "tenants", tenant)
                pipe.incr(f"{self.prefix}v:{tenant}")

        self.link.transaction(write)

    def forget_all(self) -> None:
        """Every key under the prefix but the global version, which is then bumped."""
        keys = [
            key
            for key in self.link.call(lambda: list(self.client.scan_iter(match=self.prefix + "*", count=1000)))
            if key.decode() != self.prefix + "v"
        ]

        def write(pipe) -> None:
            if keys:
                pipe.delete(*keys)
            pipe.incr(self.prefix + "v")

        self.link.transaction(write)

    def close(self) -> None:
        self.link.close()
