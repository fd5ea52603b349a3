"""The engine's waiting room: bounded, per-tenant shares, round-robin across tenants.

One tenant flooding the server cannot starve another: a tenant may hold at most `tenant_share` of
the `capacity` waiting places (more is refused at once, so the gateway answers 429 while other
tenants still get in), and `get` serves the waiting tenant that was served least recently (never
served first), oldest job first within a tenant. A tenant that already holds `batch_share` running
sequences is passed over while another tenant waits; the worker can also hold a tenant back
entirely (`allowed`), to keep the batch's last place for another tenant.

Invariant: `size` == total jobs in `waiting`, and no deque in `waiting` is empty. Any thread may put;
only the engine's worker gets. Tenants are told apart by their cache salt (one per tenant), so
`last_served` holds one number per configured tenant.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable


class QueueFull(Exception):
    """No waiting place: the whole queue is full, or this tenant holds its share of it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason  # "queue_full" | "tenant_share"


class FairQueue:
    def __init__(self, capacity: int, tenant_share: int):
        self.capacity = capacity
        self.tenant_share = tenant_share
        self.waiting: OrderedDict[bytes, deque] = OrderedDict()  # tenant -> its jobs, in arrival order of tenants
        self.last_served: dict[bytes, int] = {}  # tenant -> the `served` count when it was last served
        self.served = 0
        self.size = 0
        self.closed = False  # close() was called: get() returns None once the queue is drained of turns
        self.nudged = False  # nudge() was called: a blocked get() returns (None) once, to look at other work
        self.changed = threading.Condition()

    def put(self, tenant: bytes, job) -> None:
        with self.changed:
            if self.size >= self.capacity:
                raise QueueFull("queue_full")
            jobs = self.waiting.get(tenant)
            if jobs is not None and len(jobs) >= self.tenant_share:
                raise QueueFull("tenant_share")
            self.waiting.setdefault(tenant, deque()).append(job)
            self.size += 1
            self.changed.notify()

    def get(
        self,
        block: bool,
        passed_over: Callable[[bytes], bool] = lambda tenant: False,
        allowed: Callable[[bytes], bool] = lambda tenant: True,
        timeout_s: float | None = None,
    ):
        """The next job in tenant turn order (None when closed, when not blocking and none waits, or
        when none came within timeout_s).
        A tenant for which `passed_over` is true is skipped while another tenant has a job waiting;
        one for which `allowed` is false is not served now at all (None if no other waits)."""
        with self.changed:
            while not self.waiting and not self.closed and not self.nudged:
                if not block or not self.changed.wait(timeout_s):
                    return None
            self.nudged = False
            if self.closed or not self.waiting:
                return None
            candidates = [tenant for tenant in self.waiting if allowed(tenant)]
            if not candidates:
                return None
            eligible = [tenant for tenant in candidates if not passed_over(tenant)] or candidates
            tenant = min(eligible, key=lambda t: self.last_served.get(t, -1))  # ties: the earliest to arrive
            jobs = self.waiting[tenant]
            job = jobs.popleft()
            if not jobs:
                del self.waiting[tenant]
            self.served += 1
            self.last_served[tenant] = self.served
            self.size -= 1
            return job

    def drain(self) -> list:
        """Remove and return every waiting job."""
        with self.changed:
            jobs = [job for waiting in self.waiting.values() for job in waiting]
            self.waiting.clear()
            self.size = 0
            return jobs

    def nudge(self) -> None:
        """Wake a worker blocked in get() without a job: other work has arrived for it."""
        with self.changed:
            self.nudged = True
            self.changed.notify_all()

    def close(self) -> None:
        """Wake the worker: get() returns None from now on."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def num_tenants_served(self) -> int:
        return len(self.last_served)

    def qsize(self) -> int:
        return self.size
