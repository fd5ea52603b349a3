"""The engine's waiting room: bounded, per-tenant shares, tenants served in turn."""

from __future__ import annotations

import threading

import pytest

from gateway.engine.fair_queue import FairQueue, QueueFull

A, B, C = b"tenant-a", b"tenant-b", b"tenant-c"


def test_a_tenant_served_last_waits_behind_one_that_arrives_later():
    waiting = FairQueue(capacity=16, tenant_share=8)
    waiting.put(A, "a1")
    assert waiting.get(block=False) == "a1"
    waiting.put(A, "a2")
    waiting.put(B, "b1")
    assert [waiting.get(block=False), waiting.get(block=False)] == ["b1", "a2"]


def test_tenants_are_served_in_turn_oldest_first_within_a_tenant():
    waiting = FairQueue(capacity=16, tenant_share=8)
    for job in ("a1", "a2", "a3"):
        waiting.put(A, job)
    waiting.put(B, "b1")
    waiting.put(C, "c1")
    waiting.put(B, "b2")
    assert [waiting.get(block=False) for _ in range(6)] == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert waiting.get(block=False) is None and waiting.qsize() == 0


def test_a_tenant_over_its_share_is_refused_while_others_still_get_in():
    waiting = FairQueue(capacity=4, tenant_share=2)
    waiting.put(A, "a1")
    waiting.put(A, "a2")
    with pytest.raises(QueueFull) as refused:
        waiting.put(A, "a3")
    assert refused.value.reason == "tenant_share"
    waiting.put(B, "b1")
    waiting.put(C, "c1")
    with pytest.raises(QueueFull) as full:
        waiting.put(C, "c2")
    assert full.value.reason == "queue_full" and waiting.qsize() == 4


def test_a_tenant_holding_its_batch_share_is_passed_over_while_another_waits():
    waiting = FairQueue(capacity=8, tenant_share=8)
    waiting.put(A, "a1")
    waiting.put(A, "a2")
    waiting.put(B, "b1")
    busy = {A}
    assert waiting.get(block=False, passed_over=lambda tenant: tenant in busy) == "b1"
    assert waiting.get(block=False, passed_over=lambda tenant: tenant in busy) == "a1"  # nobody else waits


def test_close_wakes_a_blocked_worker_and_drain_returns_what_waited():
    waiting = FairQueue(capacity=4, tenant_share=4)
    got = []
    worker = threading.Thread(target=lambda: got.append(waiting.get(block=True)))
    worker.start()
    waiting.close()
    worker.join(5)
    assert not worker.is_alive() and got == [None]
    closed = FairQueue(capacity=4, tenant_share=4)
    closed.put(A, "a1")
    closed.put(B, "b1")
    assert closed.drain() == ["a1", "b1"] and closed.qsize() == 0


def test_a_tenant_held_back_is_not_served_even_when_it_alone_waits():
    waiting = FairQueue(capacity=16, tenant_share=8)
    waiting.put(A, "a1")
    assert waiting.get(block=False, allowed=lambda tenant: tenant != A) is None  # nothing else waits
    waiting.put(B, "b1")
    assert waiting.get(block=False, allowed=lambda tenant: tenant != A) == "b1"
    assert waiting.num_tenants_served() == 1
    assert waiting.get(block=False) == "a1" and waiting.num_tenants_served() == 2
