"""API test fixtures."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from django.db import connections


@pytest.fixture(autouse=True)
async def close_executor_connections():
    """Async views reach the ORM on asgiref's executor thread; close that thread's connections too."""
    yield
    await sync_to_async(connections.close_all)()
