"""Several models in one process: which are loaded, loading on demand, unloading under a memory limit.

    pool = ModelPool(specs, load, limit_bytes)
    with pool.use(name, timeout_s) as model:    # waits while it loads (or while room is made for it)
        ...                                      # UnknownModel / ModelUnavailable / ModelLoadFailed
    pool.statuses() -> list[ModelStatus]         # name, state, pinned, bytes held, running requests
    pool.poll(name, attempt) -> (model | None, attempt)   # the same without blocking (an event loop polls it)
    pool.release(name)                           # the end of what poll() handed out
    pool.expire_idle()                           # unload the models idle past their TTL (a sweeper calls it)
    pool.adopt(name, model)                      # a model its caller loaded (the server's default one)
    pool.loaded_models()
    pool.close(keep=None)                        # stop every loaded model (but keep)

A model is loaded on a thread of its own when a request first asks for it; requests for the models
already loaded never wait for that (the lock is held only for bookkeeping, never across a load or an
unload). When a load would pass the memory limit, idle models go first, least recently used first,
never a pinned one and never one with requests running (inside use(), or jobs its engine still
runs: `Loaded.busy`); if even that is not enough, the request
waits for running requests to end, up to its timeout. A model that fails to load fails the requests
waiting for that attempt with the reason; the next request tries again.

Memory is booked, not measured live: a model holds its spec's `estimate_bytes` (weights, KV and
vision budgets) while it loads, then what the loaded model reports (`Loaded.nbytes`). Invariant
(under `lock`): the bytes booked by loading and loaded models never exceed `limit_bytes`; a load
starts only after the models it displaces have stopped, so the process never holds both.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class Loaded(Protocol):
    @property
    def nbytes(self) -> int: ...  # what the loaded model holds: weights, KV and vision budgets

    @property
    def busy(self) -> bool: ...  # jobs queued or running on it (a stream outlives the use() that started it)

    def stop(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str  # the id clients send as "model"
    path: str  # a model folder or hub id
    estimate_bytes: int  # booked against the limit while it loads
    pinned: bool = False  # never unloaded
    idle_ttl_s: float = 0.0  # unloaded after this long without a request (0: only to make room)


def weights_bytes(model_path: Path) -> int:
    """A model folder's weight files' bytes: what loading it will take before its caches fill."""
    return sum(path.stat().st_size for path in Path(model_path).glob("*.safetensors"))


BUSY_POLL_S = 0.1  # how often a request waiting for room looks whether a busy engine has gone idle


class UnknownModel(LookupError):
    pass


class ModelUnavailable(RuntimeError):
    """Not loaded in time: no room could be made before the timeout, or it can never fit."""


class ModelLoadFailed(RuntimeError):
    """The load this request waited for failed (the reason is the message)."""


@dataclass(frozen=True, slots=True)
class ModelStatus:
    name: str
    state: str  # unloaded | loading | loaded | unloading
    pinned: bool
    nbytes: int  # booked against the limit (0 when unloaded)
    running: int
    last_error: str


@dataclass(slots=True)
class _Slot:
    spec: ModelSpec
    state: str = "unloaded"
    model: Loaded | None = None
    nbytes: int = 0  # booked while loading or loaded
    running: int = 0  # requests inside use(); > 0 only while loaded
    last_used: float = 0.0  # clock time of the last use() to start or end
    attempt: int = 0  # loads started
    failed_attempt: int = 0  # the last attempt that failed
    error: str = ""

    @property
    def unloadable(self) -> bool:
        """Loaded, idle and not pinned: it may be unloaded (to make room, or past its TTL)."""
        idle = not self.running and not (self.model is not None and self.model.busy)
        return self.state == "loaded" and idle and not self.spec.pinned


class ModelPool:
    def __init__(
        self,
        specs: Sequence[ModelSpec],
        load: Callable[[ModelSpec], Loaded],
        limit_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        after_unload: Callable[[], None] = lambda: None,
    ):
        self.load = load
        self.after_unload = after_unload  # once a stopped model is dropped (returns its memory)
        self.limit_bytes = limit_bytes
        self.clock = clock
        self.slots = {spec.name: _Slot(spec) for spec in specs}
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified whenever a slot changes state or running

    @contextlib.contextmanager
    def use(self, name: str, timeout_s: float) -> Iterator[Loaded]:
        model = self._acquire(name, self.clock() + timeout_s)
        try:
            yield model
        finally:
            self.release(name)

    def release(self, name: str) -> None:
        with self.changed:
            slot = self.slots[name]
            slot.running -= 1
            slot.last_used = self.clock()
            self.changed.notify_all()

    def _acquire(self, name: str, deadline: float) -> Loaded:
        attempt = 0
        with self.changed:
            while True:
                model, attempt = self._poll(name, attempt)
                if model is not None:
                    return model
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise ModelUnavailable(self._why_waiting(self.slots[name]))
                # an engine's jobs ending (busy) notifies nobody: look again every so often
                self.changed.wait(min(remaining, BUSY_POLL_S))

    def poll(self, name: str, attempt: int) -> tuple[Loaded | None, int]:
        """One look without blocking: the model (counted as running until release(name)), or None and
        the load attempt to wait for (pass it back next time). UnknownModel, ModelLoadFailed (the
        attempt waited for failed), ModelUnavailable (it can never fit)."""
        with self.changed:
            return self._poll(name, attempt)

    def why_waiting(self, name: str) -> str:
        with self.lock:
            return self._why_waiting(self.slots[name])

    def _poll(self, name: str, waited_for: int) -> tuple[Loaded | None, int]:
        slot = self.slots.get(name)
        if slot is None:
            raise UnknownModel(name)
        if slot.state == "loaded" and slot.model is not None:
            slot.running += 1
            slot.last_used = self.clock()
            return slot.model, waited_for
        if waited_for and slot.failed_attempt == waited_for:
            raise ModelLoadFailed(f"model {name!r} failed to load: {slot.error}")
        if slot.state == "unloaded":
            victims = self._room_for(slot.spec)
            if victims is not None:
                self._start_load(slot, victims)
        return None, slot.attempt if slot.state == "loading" else waited_for

    def _room_for(self, spec: ModelSpec) -> list[_Slot] | None:
        """The idle models to unload (least recently used first) so spec fits; None when it cannot
        fit now (caller holds the lock). ModelUnavailable when it could never fit."""
        if spec.estimate_bytes > self.limit_bytes:
            raise ModelUnavailable(
                f"model {spec.name!r} needs ~{spec.estimate_bytes} bytes, more than the limit of {self.limit_bytes}"
            )
        free = self.limit_bytes - sum(s.nbytes for s in self.slots.values() if s.state in ("loading", "loaded"))
        victims = []
        idle = sorted(
            (s for s in self.slots.values() if s.unloadable),
            key=lambda s: s.last_used,
        )
        for slot in idle:
            if free >= spec.estimate_bytes:
                break
            victims.append(slot)
            free += slot.nbytes
        return victims if free >= spec.estimate_bytes else None

    def _start_load(self, slot: _Slot, victims: list[_Slot]) -> None:
        for victim in victims:
            victim.state = "unloading"
        slot.state, slot.nbytes, slot.attempt = "loading", slot.spec.estimate_bytes, slot.attempt + 1
        threading.Thread(target=self._load, args=(slot, victims), name=f"strata-load-{slot.spec.name}").start()

    def _load(self, slot: _Slot, victims: list[_Slot]) -> None:
        """On its own thread: stop the displaced models, then load (no lock held across either)."""
        for victim in victims:
            self._stop(victim)
        try:
            model = self.load(slot.spec)
        except Exception as exc:  # noqa: BLE001 - any failure to load is the waiting requests' answer
            with self.changed:
                slot.state, slot.nbytes = "unloaded", 0
                slot.failed_attempt, slot.error = slot.attempt, f"{type(exc).__name__}: {exc}"
                self.changed.notify_all()
            return
        with self.changed:
            slot.state, slot.model, slot.nbytes, slot.error = "loaded", model, model.nbytes, ""
            slot.last_used = self.clock()
            self.changed.notify_all()

    def _stop(self, slot: _Slot) -> None:
        """Stop an unloading model and give its bytes back (its caller marked it unloading)."""
        model = slot.model
        if model is not None:
            model.stop()
        with self.changed:
            slot.state, slot.model, slot.nbytes = "unloaded", None, 0
            self.changed.notify_all()
        del model
        self.after_unload()

    def _why_waiting(self, slot: _Slot) -> str:
        if slot.state == "loading":
            return f"model {slot.spec.name!r} is still loading"
        busy = [s.spec.name for s in self.slots.values() if s.state == "loaded" and not s.unloadable]
        return f"no room for model {slot.spec.name!r} under the memory limit: in use or pinned: {', '.join(busy)}"

    def expire_idle(self) -> list[str]:
        """Unload the models idle past their TTL (never a pinned one): their names."""
        now = self.clock()
        with self.changed:
            expired = [
                s
                for s in self.slots.values()
                if s.unloadable and s.spec.idle_ttl_s and now - s.last_used > s.spec.idle_ttl_s
            ]
            for slot in expired:
                slot.state = "unloading"
        for slot in expired:
            self._stop(slot)
        return [s.spec.name for s in expired]

    def adopt(self, name: str, model: Loaded) -> None:
        """Book a model loaded by the caller (the one a server loads before it serves) as loaded."""
        with self.changed:
            slot = self.slots[name]
            slot.state, slot.model, slot.nbytes, slot.last_used = "loaded", model, model.nbytes, self.clock()
            self.changed.notify_all()

    def loaded_models(self) -> list[Loaded]:
        with self.lock:
            return [s.model for s in self.slots.values() if s.state == "loaded" and s.model is not None]

    def statuses(self) -> list[ModelStatus]:
        with self.lock:
            return [
                ModelStatus(s.spec.name, s.state, s.spec.pinned, s.nbytes, s.running, s.error)
                for s in self.slots.values()
            ]

    def close(self, keep: Loaded | None = None) -> None:
        """Stop every loaded model but `keep` (at shutdown, after requests have drained)."""
        with self.changed:
            loaded = [s for s in self.slots.values() if s.state == "loaded" and s.model is not keep]
            for slot in loaded:
                slot.state = "unloading"
        for slot in loaded:
            self._stop(slot)
