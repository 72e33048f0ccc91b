"""Django settings for mlxhost, read from the environment (see .env.example and docs/configuration.md)."""

from __future__ import annotations

import os
import secrets
from datetime import timedelta
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from mlxhost.runtime.config import runtime_settings_from

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(environ.Env().str("MLXHOST_VAR_DIR", default=str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

env = environ.Env()
if (BASE_DIR / ".env").is_file():
    environ.Env.read_env(BASE_DIR / ".env", overwrite=False)


def _secret_key() -> str:
    # Generated once into a git-ignored file, so sessions survive restarts without configuration.
    path = VAR_DIR / "secret_key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = env.str("SECRET_KEY", default="") or env.str("DJANGO_SECRET_KEY", default="") or _secret_key()
DEBUG = env.bool("DJANGO_DEBUG", default=False)
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "axes",
    "rest_framework",
    "channels",
    "models_app",
    "api",
]

# Django's stock stack, whose hooks run on the event loop for /v1/ requests instead of one hop
# each to asgiref's single sync thread (fast refusals in a burst; see mlxhost/middleware.py).
MIDDLEWARE = [
    # Outermost, so it sees every API answer as it leaves: its id header and its log line (OPS-6).
    "mlxhost.request_log.RequestLogMiddleware",
    # Before the middleware that answer early (a CSRF failure, a redirect, a bad Host): their
    # HTML pages get the policy too (OPS-7).
    "mlxhost.security.ContentSecurityPolicyMiddleware",
    # So every /v1/ answer to an allowed origin carries CORS headers. All three async-capable.
    "api.cors.CorsMiddleware",
    "mlxhost.middleware.InlineSecurityMiddleware",
    "mlxhost.middleware.InlineSessionMiddleware",
    "mlxhost.middleware.InlineCommonMiddleware",
    "mlxhost.middleware.InlineCsrfViewMiddleware",
    "mlxhost.middleware.InlineAuthenticationMiddleware",
    "mlxhost.middleware.InlineMessageMiddleware",
    "mlxhost.middleware.InlineXFrameOptionsMiddleware",
    # Last, as django-axes asks: it turns a lockout into its 429 page.
    "axes.middleware.AxesMiddleware",
]
# Django finds the security, clickjacking and CSRF middleware by dotted path and so misses the
# subclasses above; mlxhost.W001-W003 (mlxhost/middleware.py) check for them by class instead.
SILENCED_SYSTEM_CHECKS = ["security.W001", "security.W002", "security.W003"]

# Admin login throttle (ADM-1): 5 failed logins for one username from one address lock that pair
# out for 15 minutes, even with the right password; a successful login resets the count.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env.int("MLXHOST_LOGIN_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = timedelta(minutes=env.int("MLXHOST_LOGIN_LOCKOUT_MINUTES", default=15))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
# The peer address, or behind MLXHOST_BEHIND_TLS_PROXY the one the proxy appended; never an
# address a client wrote into X-Forwarded-For itself.
AXES_CLIENT_IP_CALLABLE = "mlxhost.security.client_ip"

# Behind a TLS-terminating proxy (`MLXHOST_BEHIND_TLS_PROXY=true`): HTTPS only, secure cookies,
# HSTS, and the scheme and client address from the proxy's X-Forwarded-* headers. Unset, local
# http://127.0.0.1 works as before. The proxy must set X-Forwarded-Proto and X-Forwarded-For.
MLXHOST_BEHIND_TLS_PROXY = env.bool("MLXHOST_BEHIND_TLS_PROXY", default=False)
if MLXHOST_BEHIND_TLS_PROXY:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    # Health probes from the orchestrator speak plain HTTP to the container; they must not be
    # redirected to https (the probe would fail or follow to the proxy).
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env.int("MLXHOST_HSTS_SECONDS", default=365 * 24 * 3600)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("MLXHOST_HSTS_INCLUDE_SUBDOMAINS", default=True)
    SECURE_HSTS_PRELOAD = env.bool("MLXHOST_HSTS_PRELOAD", default=True)
    # Turning either off is a deliberate choice for this host's domain, not an oversight.
    SILENCED_SYSTEM_CHECKS += [
        *([] if SECURE_HSTS_INCLUDE_SUBDOMAINS else ["security.W005"]),
        *([] if SECURE_HSTS_PRELOAD else ["security.W021"]),
    ]

ROOT_URLCONF = "mlxhost.urls"
ASGI_APPLICATION = "mlxhost.asgi.application"
X_FRAME_OPTIONS = "DENY"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'db.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # WAL lets the persist thread write while request handlers read.
    DATABASES["default"].setdefault("OPTIONS", {})["init_command"] = "PRAGMA journal_mode=WAL;"
    DATABASES["default"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env.str("REDIS_URL", default="")
# Processes that share these prefixes (and Redis) see each other's control messages and status.
MLXHOST_SHARED_PREFIX = env.str("MLXHOST_SHARED_PREFIX", default="mlxhost")
# This engine host's number in a fleet (1..255; unset: not in a fleet). Response ids carry it, so
# the balancer sends continuations home (models_app/turns/response_ids.py, deploy/haproxy.cfg).
MLXHOST_HOST_ID: int | None = env.int("MLXHOST_HOST_ID", default=None)
if MLXHOST_HOST_ID is not None and not 1 <= MLXHOST_HOST_ID <= 255:
    raise ImproperlyConfigured("MLXHOST_HOST_ID must be a number from 1 to 255.")
# redis-py 8 gives up on a socket read after 5 s, exactly as long as channels_redis blocks in
# BZPOPMIN waiting for a message, so an idle receiver crashed; and with any finite timeout a
# cancelled receive (a consumer closing) hung on redis-py's cleanup. Redis's own BZPOPMIN timeout
# bounds every read instead.
CHANNEL_LAYER_SOCKET_TIMEOUT_S = None
if REDIS_URL:
    # The channel layer carries admin edits to the engines and engine status to the dashboards (ADM-3).
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                "hosts": [{"address": REDIS_URL, "socket_timeout": CHANNEL_LAYER_SOCKET_TIMEOUT_S}],
                "prefix": f"{MLXHOST_SHARED_PREFIX}:asgi",
            },
        }
    }
    # Engine status for the admin pages of every process.
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": MLXHOST_SHARED_PREFIX,
        }
    }
    CELERY_BROKER_URL = REDIS_URL
    CELERY_TASK_ALWAYS_EAGER = False
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    CELERY_BROKER_URL = "memory://"
    CELERY_TASK_ALWAYS_EAGER = True
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = env.str("MLXHOST_CELERY_QUEUE", default="celery")
# An unacked task (worker killed mid-task) is redelivered after this; the persist task is idempotent.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env.int("MLXHOST_CELERY_VISIBILITY_TIMEOUT_S", default=3600),
}

# Stored responses (PER-1..5): the persist timeouts, the breaker's tombstone TTL and the embedded
# sweep interval are parsed in mlxhost/runtime/config.py (`MLXHOST_RUNTIME.persistence`).
MLXHOST_RESPONSE_RETENTION_S = env.int("MLXHOST_RESPONSE_RETENTION_S", default=7 * 24 * 3600)
MLXHOST_RESPONSE_RETENTION_MIN_S = 60
MLXHOST_RESPONSE_RETENTION_MAX_S = 30 * 24 * 3600
# Usage per key (KEY-2) is tallied in memory and written behind this often (and at shutdown).
MLXHOST_USAGE_FLUSH_S = env.float("MLXHOST_USAGE_FLUSH_S", default=2.0)
# Per-key limits (KEY-4) live in Redis under this prefix when REDIS_URL is set.
MLXHOST_LIMITS_PREFIX = env.str("MLXHOST_LIMITS_PREFIX", default=f"{MLXHOST_SHARED_PREFIX}:limits")

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"
# Serve /static/ from the ASGI app (admin CSS, dashboard JS); turn off behind a web server that does it.
MLXHOST_SERVE_STATIC = env.bool("MLXHOST_SERVE_STATIC", default=True)

REST_FRAMEWORK: dict[str, object] = {
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "UNAUTHENTICATED_USER": None,
    # api/openapi.py builds /v1/openapi.json with drf-spectacular from the request serializers.
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
# Chat's `reasoning_effort`, Responses' `reasoning.effort` and Messages' `output_config.effort`
# take one set of values: one schema component.
SPECTACULAR_SETTINGS = {"ENUM_NAME_OVERRIDES": {"EffortEnum": "models_app.catalogue.specs.EFFORTS"}}

# Local model folders must live under this root; a request's `model` is never a path.
MODELS_ROOT = Path(env.str("MODELS_ROOT", default=str(VAR_DIR / "models"))).resolve()

# The engine and the serving process (MLXHOST_RUN_ENGINE, MLXHOST_PRELOAD, MLXHOST_ENGINE_BACKEND,
# sessions, timeouts, memory budget, burst wait): parsed once into frozen dataclasses whose
# defaults live in mlxhost/runtime/config.py and mlxhost/engine/config.py, not here.
MLXHOST_KV_DIR = Path(env.str("MLXHOST_KV_DIR", default=str(VAR_DIR / "kv")))
MLXHOST_RUNTIME = runtime_settings_from(os.environ, kv_dir=MLXHOST_KV_DIR, secret_key=SECRET_KEY)
# /metrics (OPS-1) needs an API key or a staff login unless this is true (scrapers without auth).
MLXHOST_METRICS_PUBLIC = env.bool("MLXHOST_METRICS_PUBLIC", default=False)
MLXHOST_MAX_REQUEST_BYTES = env.int("MLXHOST_MAX_REQUEST_BYTES", default=4 * 1024 * 1024)
# WebSocket /ws/v1/responses (API-3): frame size limit (larger closes with 1009), turns at once
# per socket, and extra origins allowed besides the Host itself (behind a Host-rewriting proxy).
MLXHOST_WS_MAX_FRAME_BYTES = env.int("MLXHOST_WS_MAX_FRAME_BYTES", default=1024 * 1024)
MLXHOST_WS_MAX_TURNS = env.int("MLXHOST_WS_MAX_TURNS", default=1)
MLXHOST_WS_ALLOWED_ORIGINS = env.list("MLXHOST_WS_ALLOWED_ORIGINS", default=[])
# A revoked key or a logout closes its sockets at once (a channel-layer message); this re-check
# of each socket's key or session is the backstop, e.g. for a session that simply expires or a
# logout in a process without a shared channel layer. Every frame a socket sends is checked too.
MLXHOST_WS_AUTH_RECHECK_S = env.float("MLXHOST_WS_AUTH_RECHECK_S", default=5.0)
# An SSE stream idle this long gets a keep-alive (Anthropic `ping`, an SSE comment elsewhere): a long
# prefill must not look like a dead connection to coding agents and proxies (issue 17).
MLXHOST_SSE_KEEPALIVE_S = env.float("MLXHOST_SSE_KEEPALIVE_S", default=5.0)
# The most choices (`n`) one chat or text completion may ask for; each takes a lane slot.
MLXHOST_MAX_CHOICES = env.int("MLXHOST_MAX_CHOICES", default=8)
DATA_UPLOAD_MAX_MEMORY_SIZE = MLXHOST_MAX_REQUEST_BYTES
# Images in requests (docs/api.md#images): one file's bytes, one image's pixels (read from its
# header before decoding), images per request, all image files of a request together, and how many
# images decode at once in this process.
MLXHOST_IMAGE_MAX_BYTES = env.int("MLXHOST_IMAGE_MAX_BYTES", default=5 * 1024 * 1024)
MLXHOST_IMAGE_MAX_PIXELS = env.int("MLXHOST_IMAGE_MAX_PIXELS", default=4096 * 4096)
MLXHOST_IMAGE_MAX_PER_REQUEST = env.int("MLXHOST_IMAGE_MAX_PER_REQUEST", default=8)
MLXHOST_IMAGE_MAX_TOTAL_BYTES = env.int("MLXHOST_IMAGE_MAX_TOTAL_BYTES", default=15 * 1024 * 1024)
MLXHOST_IMAGE_DECODE_THREADS = env.int("MLXHOST_IMAGE_DECODE_THREADS", default=2)
# Browser origins (comma-separated, `*` for any) whose pages may call /v1/ (CORS); empty: none.
MLXHOST_CORS_ORIGINS = [o.rstrip("/") for o in env.list("MLXHOST_CORS_ORIGINS", default=[]) if o]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "filters": {
        "quiet_probes": {"()": "mlxhost.log_filters.QuietProbes"},
        "client_errors": {"()": "mlxhost.log_filters.ClientErrorsOneLine"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "filters": ["quiet_probes", "client_errors"],
        }
    },
    "root": {"handlers": ["console"], "level": env.str("MLXHOST_LOG_LEVEL", default="INFO")},
    "loggers": {
        "django.request": {"level": "ERROR"},
        # django-axes logs "AXES: BEGIN version ..." at INFO on every start, once per manage.py
        # command (four times in `make run`); its lockout warnings come from other loggers.
        "axes.apps": {"level": "WARNING"},
    },
}

# Periodic cleanups run by `celery -A mlxhost.celery worker --beat`.
from celery.schedules import crontab  # noqa: E402

CELERY_BEAT_SCHEDULE = {
    # https://crontab.guru/#17_*_*_*_* : hourly, off the top of the hour
    "responses-purge-expired": {
        "task": "models_app.tasks.responses_purge_expired",
        "schedule": crontab(minute="17"),
    },
    # https://crontab.guru/#*/5_*_*_*_* : every 5 minutes
    "tombstones-purge": {
        "task": "models_app.tasks.tombstones_purge",
        "schedule": crontab(minute="*/5"),
    },
}
