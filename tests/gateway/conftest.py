"""Fixtures shared by the gateway's in-process tests: an app with both response layers on (SQLite
exact store, the semantic layer over the session's MiniLM) and the tiny model's engine."""

from __future__ import annotations

import dataclasses

import pytest
from litestar.testing import TestClient

from gateway.http.app import create_app


@pytest.fixture
def cached_settings(settings):
    return dataclasses.replace(settings, exact_store="sqlite", semantic_enabled=True, admin_key="admin-key")


@pytest.fixture
def client(cached_settings, engine, embedder):
    with TestClient(create_app(cached_settings, engine=engine, embedder=embedder)) as test_client:
        yield test_client
