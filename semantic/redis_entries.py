"""Semantic entries in Redis: the EntryStore contract (semantic/entries.py), shared by every replica
that points at the same server, plus the change feed each replica's faiss index follows.

Layout under `prefix` (default "strata:semantic:"):
    next           the last entry id handed out (INCR)
    e:<id>         hash: partition, q, tenant, scope, prompt, answer, finish_reason, completion_tokens,
                   prompt_tokens, created_at, expires_at ("" for never), hit_count, status, vector
    q:<digest>     the id of (partition, prompt): their keyed digest under the tenant's key (EntryCipher.key),
                   so a newer answer replaces the entry; prompt, answer (base64) and vector are sealed
    o:<id>         set of its owners, each JSON [session, end user]
    t:<tenant>     set of the tenant's ids        s:<status>   set of the ids with that review status
    all            set of every id                 exp          sorted set id -> expires_at
    parts          hash partition -> its number of entries (stats)
    changes        stream of {op: add|remove, id, partition}, trimmed to about MAX_CHANGES

Writes that touch several keys run as one Lua script, so an entry, its indexes and its change
record appear and disappear together, and two replicas storing the same question at once end with
one entry. Scripts name their keys from the prefix (one Redis server, not Redis Cluster).

Expiry is logical, as in SQLite: an entry past expires_at is never served and is deleted by the
first replica that meets it or sweeps (`expired_ids`); entries carry no Redis TTL, so the index sets
never name a hash Redis dropped on its own. Status changes need no change record: every lookup reads
its candidates back from here. A follower more than MAX_CHANGES behind would miss changes; followers
read continuously, and one that lost the connection rebuilds its index from the entries instead.
"""

from __future__ import annotations

import base64
import json

import numpy as np

from .entries import STATUSES, EntryCipher, SemanticEntry, valid_id
from .owners import Owner, Selector
from .redis_store import SOCKET_TIMEOUT_S, RedisLink, _owner, release_owners
from .scope import Scope
from .sealing import NO_SEALING, Sealer
from .store import Answer

MAX_CHANGES = 100_000  # change records kept in the stream (~100 bytes each)
SCAN_BATCH = 1000

_PUT = """
local p, id = ARGV[1], redis.call('GET', ARGV[1] .. 'q:' .. ARGV[2])
local fields = cjson.decode(ARGV[3])
if id and redis.call('EXISTS', p .. 'e:' .. id) == 1 then
  local old = redis.call('HGET', p .. 'e:' .. id, 'status')
  redis.call('SMOVE', p .. 's:' .. old, p .. 's:unreviewed', id)
  redis.call('HSET', p .. 'e:' .. id, 'answer', fields.answer, 'finish_reason', fields.finish_reason,
             'completion_tokens', fields.completion_tokens, 'prompt_tokens', fields.prompt_tokens,
             'created_at', fields.created_at, 'expires_at', fields.expires_at, 'hit_count', 0, 'status', 'unreviewed')
  if fields.expires_at == '' then redis.call('ZREM', p .. 'exp', id)
  else redis.call('ZADD', p .. 'exp', fields.expires_at, id) end
  return {tonumber(id), 0}
end
id = redis.call('INCR', p .. 'next')
redis.call('SET', p .. 'q:' .. ARGV[2], id)
redis.call('HSET', p .. 'e:' .. id, 'partition', fields.partition, 'q', ARGV[2], 'tenant', fields.tenant,
           'scope', fields.scope, 'prompt', fields.prompt, 'answer', fields.answer,
           'finish_reason', fields.finish_reason, 'completion_tokens', fields.completion_tokens,
           'prompt_tokens', fields.prompt_tokens, 'created_at', fields.created_at, 'expires_at', fields.expires_at,
           'hit_count', 0, 'status', 'unreviewed', 'vector', ARGV[4])
redis.call('SADD', p .. 'all', id)
redis.call('SADD', p .. 't:' .. fields.tenant, id)
redis.call('SADD', p .. 's:unreviewed', id)
redis.call('HINCRBY', p .. 'parts', fields.partition, 1)
if fields.expires_at ~= '' then redis.call('ZADD', p .. 'exp', fields.expires_at, id) end
redis.call('XADD', p .. 'changes', 'MAXLEN', '~', ARGV[5], '*', 'op', 'add', 'id', id, 'partition', fields.partition)
return {id, 1}
"""

_DELETE = """
local p, id = ARGV[1], ARGV[2]
local e = p .. 'e:' .. id
local f = redis.call('HMGET', e, 'tenant', 'partition', 'status', 'q')
if not f[1] then return 0 end
redis.call('DEL', e, p .. 'o:' .. id)
redis.call('SREM', p .. 'all', id)
redis.call('SREM', p .. 't:' .. f[1], id)
redis.call('SREM', p .. 's:' .. f[3], id)
redis.call('ZREM', p .. 'exp', id)
if redis.call('GET', p .. 'q:' .. f[4]) == id then redis.call('DEL', p .. 'q:' .. f[4]) end
if redis.call('HINCRBY', p .. 'parts', f[2], -1) <= 0 then redis.call('HDEL', p .. 'parts', f[2]) end
redis.call('XADD', p .. 'changes', 'MAXLEN', '~', ARGV[3], '*', 'op', 'remove', 'id', id)
return 1
"""

_SET_STATUS = """
local p, id, status = ARGV[1], ARGV[2], ARGV[3]
local old = redis.call('HGET', p .. 'e:' .. id, 'status')
if not old then return 0 end
redis.call('SMOVE', p .. 's:' .. old, p .. 's:' .. status, id)
redis.call('HSET', p .. 'e:' .. id, 'status', status)
return 1
"""

_IF_PRESENT = """
local e = ARGV[1] .. 'e:' .. ARGV[2]
if redis.call('EXISTS', e) == 0 then return 0 end
if ARGV[3] == 'hit' then redis.call('HINCRBY', e, 'hit_count', 1)
else redis.call('SADD', ARGV[1] .. 'o:' .. ARGV[2], ARGV[4]) end
return 1
"""


class RedisEntries:
    def __init__(self, url: str, prefix: str = "strata:semantic:", sealer: Sealer = NO_SEALING):
        self.cipher = EntryCipher(sealer)
        self.link = RedisLink(url)
        self.prefix = prefix
        self.follow_link: RedisLink | None = None  # its own connection: a blocking read holds it
        self.url = url
        client = self.link.client
        self.put_script, self.delete_script = client.register_script(_PUT), client.register_script(_DELETE)
        self.status_script, self.present_script = (
            client.register_script(_SET_STATUS),
            client.register_script(_IF_PRESENT),
        )

    # -- the contract --------------------------------------------------------------------------

    def put(
        self,
        partition: str,
        scope: Scope,
        prompt: str,
        answer: Answer,
        now: float,
        expires_at: float | None,
        vector: np.ndarray,
    ) -> tuple[int, bool]:
        tenant, cipher = scope.tenant, self.cipher
        key = cipher.key(tenant, partition, prompt)
        fields = {
            "partition": partition,
            "tenant": tenant,
            "scope": json.dumps(scope.as_dict()),
            "prompt": base64.b64encode(cipher.seal(tenant, key, "prompt", prompt.encode())).decode(),
            "answer": base64.b64encode(cipher.seal(tenant, key, "answer", answer.text.encode())).decode(),
            "finish_reason": answer.finish_reason,
            "completion_tokens": answer.completion_tokens,
            "prompt_tokens": answer.prompt_tokens,
            "created_at": repr(float(now)),
            "expires_at": "" if expires_at is None else repr(float(expires_at)),
        }
        entry_id, created = self.link.call(
            self.put_script,
            args=[
                self.prefix,
                key,
                json.dumps(fields),
                cipher.seal(tenant, key, "vector", np.asarray(vector, dtype=np.float32).tobytes()),
                MAX_CHANGES,
            ],
        )
        return int(entry_id), bool(created)

    def put_many(
        self,
        partition: str,
        scope: Scope,
        prompts: list[str],
        answers: list[str],
        vectors: np.ndarray,
        now: float,
        expires_at: float | None,
    ) -> list[int]:
        return [
            self.put(partition, scope, p, Answer(a), now, expires_at, v)[0]
            for p, a, v in zip(prompts, answers, vectors)
        ]

    def fetch(self, ids: list[int]) -> list[tuple[SemanticEntry, np.ndarray]]:
        ids = [i for i in ids if valid_id(i)]
        if not ids:
            return []

        def read():
            with self.link.client.pipeline(transaction=False) as pipe:
                for entry_id in ids:
                    pipe.hgetall(self._entry(entry_id))
                return pipe.execute()

        parsed = [self._parsed(entry_id, raw) for entry_id, raw in zip(ids, self.link.call(read)) if raw]
        return [found for found in parsed if found is not None]

    def find(self, partition: str, tenant: str, prompt: str) -> int | None:
        key = self.cipher.key(tenant, partition, prompt)
        found = self.link.call(self.link.client.get, f"{self.prefix}q:{key}")
        return (
            int(found)
            if found is not None and self.link.call(self.link.client.exists, self._entry(int(found)))
            else None
        )

    def get(self, entry_id: int) -> SemanticEntry | None:
        found = self.fetch([entry_id])
        return found[0][0] if found else None

    def list_entries(
        self, tenant: str | None = None, status: str | None = None, limit: int = 100
    ) -> list[SemanticEntry]:
        sets = [self.prefix + (f"t:{tenant}" if tenant is not None else "all")]
        if status is not None:
            sets.append(f"{self.prefix}s:{status}")
        ids = sorted((int(i) for i in self.link.call(self.link.client.sinter, sets)), reverse=True)[:limit]
        return sorted((entry for entry, _ in self.fetch(ids)), key=lambda entry: -entry.id)

    def set_status(self, entry_id: int, status: str) -> bool:
        assert status in STATUSES, status
        return valid_id(entry_id) and bool(self.link.call(self.status_script, args=[self.prefix, entry_id, status]))

    def delete(self, entry_id: int) -> bool:
        return valid_id(entry_id) and bool(
            self.link.call(self.delete_script, args=[self.prefix, entry_id, MAX_CHANGES])
        )

    def count_hit(self, entry_id: int) -> None:
        self.link.call(self.present_script, args=[self.prefix, entry_id, "hit", ""])

    def own(self, entry_id: int, owner: Owner) -> None:
        self.link.call(self.present_script, args=[self.prefix, entry_id, "own", _owner(owner)])

    def release(self, selector: Selector) -> tuple[list[int], int]:
        client = self.link.client
        ids = sorted(int(i) for i in self.link.call(client.smembers, f"{self.prefix}t:{selector.tenant}"))
        if not selector.whole_tenant:
            ids = [entry_id for entry_id in ids if self._release(entry_id, selector)]

        def sizes():
            with client.pipeline(transaction=False) as pipe:
                for entry_id in ids:
                    for field in ("prompt", "answer", "vector"):
                        pipe.hstrlen(self._entry(entry_id), field)
                return pipe.execute()

        return ids, sum(self.link.call(sizes)) if ids else 0

    def expired_ids(self, now: float) -> list[int]:
        return [int(i) for i in self.link.call(self.link.client.zrangebyscore, self.prefix + "exp", "-inf", now)]

    def all_ids(self) -> list[int]:
        return sorted(int(i) for i in self.link.call(self.link.client.smembers, self.prefix + "all"))

    def vectors(self) -> list[tuple[int, str, np.ndarray]]:
        ids = self.all_ids()
        out = []
        for start in range(0, len(ids), SCAN_BATCH):
            batch = ids[start : start + SCAN_BATCH]
            for entry_id, (partition, vector) in zip(batch, self._vectors_of(batch)):
                if partition is not None and vector is not None:
                    out.append((entry_id, partition, vector))
        return out

    def stats(self) -> tuple[dict[str, int], int]:
        def read():
            with self.link.client.pipeline(transaction=False) as pipe:
                for status in STATUSES:
                    pipe.scard(f"{self.prefix}s:{status}")
                pipe.hlen(self.prefix + "parts")
                return pipe.execute()

        *counts, num_partitions = self.link.call(read)
        return dict(zip(STATUSES, counts)), num_partitions

    def close(self) -> None:
        self.link.close()
        if self.follow_link is not None:
            self.follow_link.close()

    # -- the change feed -----------------------------------------------------------------------

    def position(self) -> str:
        """Where the feed is now: changes after it are the ones an index built now must still apply."""
        return self.link.stream_end(self.prefix + "changes")

    def changes(self, position: str, wait_s: float) -> tuple[list[tuple], str]:
        """Changes after `position` (waiting up to wait_s for the first): ("add", id, partition,
        vector) for entries still present, ("remove", id); and the new position."""
        if self.follow_link is None:
            self.follow_link = RedisLink(self.url, socket_timeout_s=wait_s + SOCKET_TIMEOUT_S)
        reply = self.follow_link.call(
            self.follow_link.client.xread,
            {self.prefix + "changes": position},
            count=SCAN_BATCH,
            block=max(1, int(wait_s * 1000)),
        )
        records = reply[0][1] if reply else []
        if not records:
            return [], position
        added = [int(fields[b"id"]) for _, fields in records if fields[b"op"] == b"add"]
        present = dict(zip(added, self._vectors_of(added)))
        changes: list[tuple] = []
        for _, fields in records:
            entry_id = int(fields[b"id"])
            if fields[b"op"] == b"remove":
                changes.append(("remove", entry_id))
            elif present[entry_id][0] is not None:
                changes.append(("add", entry_id, *present[entry_id]))
        return changes, records[-1][0].decode()

    # -- parts ---------------------------------------------------------------------------------

    def _vectors_of(self, ids: list[int]) -> list[tuple[str | None, np.ndarray | None]]:
        def read():
            with self.link.client.pipeline(transaction=False) as pipe:
                for entry_id in ids:
                    pipe.hmget(self._entry(entry_id), "partition", "vector", "tenant", "q")
                return pipe.execute()

        found: list[tuple[str | None, np.ndarray | None]] = []
        for partition, sealed, tenant, key in self.link.call(read) if ids else []:
            vector = self.cipher.vector(tenant.decode(), key.decode(), sealed) if partition is not None else None
            found.append((partition.decode(), vector) if vector is not None else (None, None))
        return found

    def _release(self, entry_id: int, selector: Selector) -> bool:
        return release_owners(self.link, f"{self.prefix}o:{entry_id}", selector)

    def _entry(self, entry_id: int) -> str:
        return f"{self.prefix}e:{entry_id}"

    def _parsed(self, entry_id: int, raw: dict) -> tuple[SemanticEntry, np.ndarray] | None:
        """An entry hash with its sealed fields opened (EntryCipher, as SQLite's rows); None when
        they do not open."""
        text = {k.decode(): v for k, v in raw.items()}
        value = {k: v.decode() for k, v in text.items() if k != "vector"}
        tenant, key, expires = value["tenant"], value["q"], value["expires_at"]
        try:
            prompt, answer = base64.b64decode(value["prompt"]), base64.b64decode(value["answer"])
        except ValueError:  # written before entries were sealed
            return None
        row = (
            entry_id,
            tenant,
            value["scope"],
            prompt,
            answer,
            float(value["created_at"]),
            float(expires) if expires else None,
            int(value["hit_count"]),
            value["status"],
            value["finish_reason"],
            int(value["completion_tokens"]),
            int(value["prompt_tokens"]),
            value["partition"],
        )
        entry, vector = self.cipher.entry(row, key), self.cipher.vector(tenant, key, text["vector"])
        return (entry, vector) if entry is not None and vector is not None else None
