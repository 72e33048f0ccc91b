"""The configured infrastructure: settings switch to PostgreSQL and Redis from the environment."""

from __future__ import annotations

import os

import pytest
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection


async def test_channel_layer_round_trips_a_message():
    """The channel layer in use (Redis when REDIS_URL is set, in-memory otherwise) delivers messages."""
    layer = get_channel_layer()
    channel = await layer.new_channel()
    await layer.send(channel, {"type": "models.changed", "alias": "tiny"})
    assert await layer.receive(channel) == {"type": "models.changed", "alias": "tiny"}


def test_redis_url_selects_redis_for_channels_and_celery():
    backend = settings.CHANNEL_LAYERS["default"]["BACKEND"]
    if os.environ.get("REDIS_URL"):
        assert backend == "channels_redis.core.RedisChannelLayer"
        assert os.environ["REDIS_URL"] == settings.CELERY_BROKER_URL
    else:
        assert backend == "channels.layers.InMemoryChannelLayer"
        assert settings.CELERY_BROKER_URL == "memory://"


@pytest.mark.django_db
def test_database_url_selects_postgresql():
    expected = "postgresql" if os.environ.get("DATABASE_URL", "").startswith("postgres") else "sqlite"
    assert connection.vendor == expected
    if os.environ.get("MLXHOST_REQUIRE_SERVICES") == "1":
        assert connection.vendor == "postgresql"


def test_debug_is_off_by_default():
    if "DJANGO_DEBUG" not in os.environ:
        assert settings.DEBUG is False
