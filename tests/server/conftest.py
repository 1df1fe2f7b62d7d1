"""Fixtures for the server tests: one shared live server with keys and small limits."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from server_testutils import (
    ADMIN_KEY,
    API_KEY,
    API_KEY_2,
    MAX_BODY,
    MAX_FLOPS,
    MAX_ROWS,
    LiveServer,
)


@pytest.fixture(scope="session")
def main_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server with two API keys, an admin key, a 1 MiB body limit, 4096 rows and 2 GFLOP
    per request, and a 2 ms batch delay (so concurrent tests merge)."""
    data = tmp_path_factory.mktemp("main") / "data"
    server = LiveServer(
        data, "--api-key", API_KEY, "--api-key", API_KEY_2, "--admin-key", ADMIN_KEY,
        "--max-body-bytes", str(MAX_BODY), "--max-rows", str(MAX_ROWS),
        "--max-flops", str(MAX_FLOPS), "--batch-delay-us", "2000", "--log-level", "info",
    )
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def reader(main_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=main_server.url, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="session")
def admin(main_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=main_server.url, timeout=30,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        yield c
