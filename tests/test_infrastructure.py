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


def test_daphne_writes_a_reason_phrase_for_529():
    """Issue 25: the status line of an Anthropic overload reads `529 Overloaded`, not
    `529 Unknown Status` (Twisted's table lacks 529; asgi.py adds it)."""
    from twisted.web import http
    from twisted.web.test.requesthelper import DummyChannel

    import mlxhost.asgi  # noqa: F401  (configures daphne as the server would)

    request = http.Request(DummyChannel(), False)
    request.setResponseCode(529)
    assert request.code_message == b"Overloaded"


async def test_the_disconnect_listener_ends_without_an_exception_nobody_reads():
    """OPS-5 (issue 25): when daphne cancels a request's task at shutdown, Django's disconnect
    listener task is orphaned; it must end without an exception (asyncio logged "Task exception
    was never retrieved … RequestAborted" with a traceback for each stream)."""
    from mlxhost.handlers import ApiASGIHandler

    async def receive():
        return {"type": "http.disconnect"}

    assert await ApiASGIHandler().listen_for_disconnect(receive) is None


async def test_shutdown_waits_for_each_closed_socket_to_finish_its_handshake():
    """OPS-5 (issue 25): the close frames must leave before the reactor drops the connections;
    `wait_for_closes` returns once every closed socket's handshake ended, or says how many did not."""
    import asyncio

    from mlxhost import daphne_options

    class Protocol:  # autobahn's states
        STATE_CLOSED, STATE_CLOSING = 0, 2

        def __init__(self) -> None:
            self.state = self.STATE_CLOSING

    slow, fast = Protocol(), Protocol()
    daphne_options._closing.update({slow, fast})
    fast.state = fast.STATE_CLOSED
    assert await daphne_options.wait_for_closes(0.05) == 1  # `slow` never answered
    asyncio.get_running_loop().call_later(0.05, setattr, slow, "state", slow.STATE_CLOSED)
    assert await daphne_options.wait_for_closes(10) == 0


def test_a_client_error_is_logged_as_one_line_with_its_request_id():
    """API-4, OPS-6 (issue 25): Django logs a bad Host (a SuspiciousOperation) with its whole
    traceback; the console's filter leaves one line naming the request id."""
    import logging
    import sys

    from mlxhost import request_log
    from mlxhost.log_filters import ClientErrorsOneLine

    try:
        raise ValueError("bad host")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord(
        "django.security.DisallowedHost", logging.ERROR, __file__, 1, "Invalid HTTP_HOST %r", ("x",), exc_info
    )
    with request_log.recording(method="GET", path="/v1/models"):
        request_id = request_log.running_request_id()
        assert ClientErrorsOneLine().filter(record)
    line = logging.Formatter().format(record)
    assert line == f"Invalid HTTP_HOST 'x' (request id {request_id})"
