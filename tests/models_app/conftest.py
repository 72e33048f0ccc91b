"""models_app test fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_engine_status():
    """The test starts and ends with no engine process reporting (the cache outlives tests)."""
    from django.core.cache import cache

    cache.clear()
    yield
    cache.clear()
