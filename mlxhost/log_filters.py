"""Logging filters."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

PROBE_PATHS = ("/readyz", "/healthz")
# Django logs a client's bad request (SuspiciousOperation: a bad Host, a body over the limit, …)
# on these loggers with the whole traceback (issue 25).
CLIENT_ERROR_LOGGERS = ("django.security.",)


class QuietProbes(logging.Filter):
    """Drop Django's per-request error lines for health probes: a 503 while loading is expected."""

    def filter(self, record: logging.LogRecord) -> bool:
        request = getattr(record, "request", None)
        return not (record.name == "django.request" and getattr(request, "path", "") in PROBE_PATHS)


class ClientErrorsOneLine(logging.Filter):
    """A client error is one line with its request id, never a traceback (API-4, OPS-6): the
    exception info of Django's records about a client's bad request is dropped here."""

    # The running request's id, or None: `mlxhost.request_log` installs its own (it imports this
    # module, so this one cannot import it).
    request_id: Callable[[], str | None] = staticmethod(lambda: None)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith(CLIENT_ERROR_LOGGERS) and (record.exc_info or record.stack_info):
            record.exc_info, record.exc_text, record.stack_info = None, None, None
            if (request_id := self.request_id()) is not None:
                record.msg = f"{record.getMessage()} (request id {request_id})"
                record.args = None
        return True
