"""Logging filters."""

from __future__ import annotations

import logging

PROBE_PATHS = ("/readyz", "/healthz")


class QuietProbes(logging.Filter):
    """Drop Django's per-request error lines for health probes: a 503 while loading is expected."""

    def filter(self, record: logging.LogRecord) -> bool:
        request = getattr(record, "request", None)
        return not (record.name == "django.request" and getattr(request, "path", "") in PROBE_PATHS)
