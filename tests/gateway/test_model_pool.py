"""ModelPool alone, with a fake loader (the one class under test): loads on demand, unloads the least
recently used idle model under the memory limit, never a pinned one or one with requests running,
fails a waiting request with the load's reason, and serves loaded models while another loads."""

from __future__ import annotations

import threading
import time

import pytest

from gateway.engine.model_pool import (
    ModelLoadFailed,
    ModelPool,
    ModelSpec,
    ModelUnavailable,
    UnknownModel,
)

GIB = 1 << 30


class FakeModel:
    def __init__(self, name: str, nbytes: int):
        self.name, self.nbytes, self.stopped = name, nbytes, False
        self.busy = False  # its engine still runs jobs (a stream whose use() has ended)

    def stop(self) -> None:
        self.stopped = True


class Loader:
    """Loads instantly unless a gate for the name is set; can be told to fail."""

    def __init__(self):
        self.loads: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.failing: set[str] = set()

    def __call__(self, spec: ModelSpec) -> FakeModel:
        self.loads.append(spec.name)
        if spec.name in self.gates:
            assert self.gates[spec.name].wait(10)
        if spec.name in self.failing:
            raise OSError("config.json: no such file")
        return FakeModel(spec.name, spec.estimate_bytes)


def _pool(*specs: ModelSpec, limit: int = 2 * GIB) -> tuple[ModelPool, Loader]:
    loader = Loader()
    return ModelPool(list(specs), loader, limit), loader


def _spec(name: str, **kw) -> ModelSpec:
    return ModelSpec(name, f"/models/{name}", kw.pop("estimate_bytes", GIB), **kw)


def _states(pool: ModelPool) -> dict[str, str]:
    return {s.name: s.state for s in pool.statuses()}


def test_a_model_loads_on_first_use_and_is_reused():
    pool, loader = _pool(_spec("coder"), _spec("vision"))
    assert _states(pool) == {"coder": "unloaded", "vision": "unloaded"}
    with pool.use("coder", 5) as first:
        assert first.name == "coder" and _states(pool)["coder"] == "loaded"
    with pool.use("coder", 5) as again:
        assert again is first
    assert loader.loads == ["coder"]
    with pytest.raises(UnknownModel), pool.use("gpt-5", 5):
        pass


def test_under_a_limit_for_two_of_three_the_least_recently_used_idle_model_is_unloaded():
    pool, loader = _pool(_spec("a"), _spec("b"), _spec("c"))
    with pool.use("a", 5):
        pass
    with pool.use("b", 5) as b:
        pass
    with pool.use("a", 5):  # b is now the least recently used
        pass
    with pool.use("c", 5):
        assert _states(pool) == {"a": "loaded", "b": "unloaded", "c": "loaded"} and b.stopped
    assert sum(s.nbytes for s in pool.statuses()) <= 2 * GIB
    assert loader.loads == ["a", "b", "c"]


def test_a_pinned_model_is_never_unloaded_and_a_busy_one_only_after_its_requests_end():
    pool, _ = _pool(_spec("pinned", pinned=True), _spec("busy"), _spec("third"))
    with pool.use("pinned", 5):
        pass
    with pool.use("busy", 5):
        with pytest.raises(ModelUnavailable, match="in use or pinned: pinned, busy"), pool.use("third", 0.2):
            pass
        assert _states(pool)["busy"] == "loaded"
    # the request on `busy` ended: now it is the one to go, never the pinned one
    with pool.use("third", 5):
        assert _states(pool) == {"pinned": "loaded", "busy": "unloaded", "third": "loaded"}


def test_a_model_whose_engine_still_runs_jobs_is_not_unloaded_until_they_end():
    """A stream outlives the use() that started its job: the engine's own busy flag keeps it loaded."""
    pool, _ = _pool(_spec("a"), _spec("b"), limit=GIB)
    with pool.use("a", 5) as a:
        a.busy = True
    with pytest.raises(ModelUnavailable, match="in use or pinned: a"), pool.use("b", 0.3):
        pass
    a.busy = False
    with pool.use("b", 5):
        assert _states(pool) == {"a": "unloaded", "b": "loaded"}


def test_poll_hands_out_a_loaded_model_without_blocking_and_release_returns_it():
    pool, loader = _pool(_spec("a"))
    gate = loader.gates["a"] = threading.Event()
    model, attempt = pool.poll("a", 0)
    assert model is None and attempt == 1 and _states(pool) == {"a": "loading"}
    gate.set()
    for _ in range(100):
        model, attempt = pool.poll("a", attempt)
        if model is not None:
            break
        time.sleep(0.02)
    assert model is not None and pool.statuses()[0].running == 1
    pool.release("a")
    assert pool.statuses()[0].running == 0
    with pytest.raises(UnknownModel):
        pool.poll("nope", 0)


def test_a_waiting_request_gets_its_turn_when_a_running_request_ends():
    pool, _ = _pool(_spec("a"), _spec("b"), limit=GIB)
    outcome: list[str] = []
    with pool.use("a", 5):
        waiter = threading.Thread(target=lambda: outcome.append(_use(pool, "b", 5)))
        waiter.start()
        time.sleep(0.2)
        assert not outcome and _states(pool)["a"] == "loaded"  # a is running: b waits
    waiter.join(5)
    assert outcome == ["b"] and _states(pool) == {"a": "unloaded", "b": "loaded"}


def _use(pool: ModelPool, name: str, timeout_s: float) -> str:
    with pool.use(name, timeout_s) as model:
        return model.name


@pytest.mark.serial
def test_a_loaded_model_serves_while_another_loads():
    pool, loader = _pool(_spec("fast"), _spec("slow"))
    loader.gates["slow"] = threading.Event()
    with pool.use("fast", 5):
        pass
    waiter = threading.Thread(target=lambda: _use(pool, "slow", 10))
    waiter.start()
    time.sleep(0.1)
    assert _states(pool)["slow"] == "loading"
    started = time.monotonic()
    for _ in range(100):
        assert _use(pool, "fast", 5) == "fast"
    assert time.monotonic() - started < 0.5  # not one of them waited for the load
    loader.gates["slow"].set()
    waiter.join(5)
    assert _states(pool)["slow"] == "loaded"


def test_a_failed_load_fails_its_waiters_with_the_reason_and_the_next_request_tries_again():
    pool, loader = _pool(_spec("broken"), _spec("fine"))
    loader.failing.add("broken")
    with pytest.raises(ModelLoadFailed, match="no such file"), pool.use("broken", 5):
        pass
    assert _use(pool, "fine", 5) == "fine"
    status = {s.name: s for s in pool.statuses()}["broken"]
    assert status.state == "unloaded" and status.nbytes == 0 and "no such file" in status.last_error
    loader.failing.clear()
    assert _use(pool, "broken", 5) == "broken" and loader.loads.count("broken") == 2


def test_a_model_larger_than_the_limit_is_refused_at_once():
    pool, loader = _pool(_spec("huge", estimate_bytes=3 * GIB))
    with pytest.raises(ModelUnavailable, match="more than the limit"), pool.use("huge", 5):
        pass
    assert loader.loads == []


def test_idle_models_expire_after_their_ttl_but_not_pinned_or_running_ones():
    now = [0.0]
    loader = Loader()
    specs = [_spec("idle", idle_ttl_s=60), _spec("pinned", idle_ttl_s=60, pinned=True), _spec("busy", idle_ttl_s=60)]
    pool = ModelPool(specs, loader, 3 * GIB, clock=lambda: now[0])
    for name in ("idle", "pinned"):
        _use(pool, name, 5)
    with pool.use("busy", 5):
        now[0] = 120.0
        assert pool.expire_idle() == ["idle"]
    assert _states(pool) == {"idle": "unloaded", "pinned": "loaded", "busy": "loaded"}
    pool.close()
    assert set(_states(pool).values()) == {"unloaded"}
