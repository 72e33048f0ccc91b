"""Ensure a staff login and an API key exist, and print them (once, when generated)."""

from __future__ import annotations

import os
import secrets
import shlex
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction

from models_app.catalogue import services
from models_app.models import ApiKey

if TYPE_CHECKING:
    from collections.abc import Mapping

BOOTSTRAP_KEY_NAME = "bootstrap"
DEFAULT_PORT = "8000"


def paste_prefix(environ: Mapping[str, str]) -> str:
    """What goes before a command the banner suggests, so that pasted it reaches the database
    this run used: its DATABASE_URL (the fleet's PostgreSQL), else nothing (the default SQLite).
    A URL with a password is referred to, not printed: whoever set it has it in their shell."""
    url = environ.get("DATABASE_URL", "")
    if not url:
        return ""
    if urlsplit(url).password:
        return 'DATABASE_URL="$DATABASE_URL" '
    return f"DATABASE_URL={shlex.quote(url)} "


class Command(BaseCommand):
    help = (
        "Create the staff login (DJANGO_SUPERUSER_USERNAME/PASSWORD or generated) and an API key "
        "(MLXHOST_BOOTSTRAP_API_KEY or generated), printing generated secrets once."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--new-key", action="store_true", help="Always mint and print a fresh API key.")
        parser.add_argument("--port", default=os.environ.get("PORT", DEFAULT_PORT))

    @transaction.atomic
    def handle(self, *args: Any, **options: Any) -> None:
        prefix = paste_prefix(os.environ)
        port = str(options["port"])
        make_port = "" if port == DEFAULT_PORT else f" PORT={port}"
        user, password = self._ensure_user(f"{prefix}.venv/bin/python manage.py changepassword")
        key_text = self._ensure_key(
            user, force_new=options["new_key"], mint=f"{prefix}make api-key{make_port}"
        )
        base = f"http://127.0.0.1:{options['port']}"
        lines = [
            "",
            "=" * 72,
            f"  Admin:     {base}/admin/",
            f"  Login:     {user.get_username()} / {password}",
            f"  API key:   {key_text}",
            f"  Chat:      {base}/dashboard/chat/",
            f"  OpenAI:    base_url={base}/v1   model=smollm2",
            f"  Anthropic: base_url={base}   model=smollm2",
            f"  Embed:     POST {base}/v1/embeddings   model=minilm",
            "=" * 72,
            "",
        ]
        self.stdout.write("\n".join(lines))

    def _ensure_user(self, changepassword: str) -> tuple[Any, str]:
        User = get_user_model()
        username = os.environ.get("DJANGO_SUPERUSER_USERNAME") or "admin"
        password = os.environ.get("DJANGO_SUPERUSER_PASSWORD")
        user = User.objects.filter(username=username).first()
        if user is None:
            generated = password or secrets.token_urlsafe(12)
            user = User.objects.create_superuser(username=username, email="", password=generated)
            return user, generated if not password else "(from DJANGO_SUPERUSER_PASSWORD)"
        if password:
            user.set_password(password)
            user.is_staff = user.is_superuser = user.is_active = True
            user.save()
            return user, "(from DJANGO_SUPERUSER_PASSWORD)"
        return user, f"(printed when it was created; reset: {changepassword} {shlex.quote(username)})"

    def _ensure_key(self, user: Any, *, force_new: bool, mint: str) -> str:
        raw = os.environ.get("MLXHOST_BOOTSTRAP_API_KEY")
        if raw:
            services.apikey_ensure(owner=user, raw_key=raw, name=BOOTSTRAP_KEY_NAME)
            return "(from MLXHOST_BOOTSTRAP_API_KEY)"
        exists = ApiKey.objects.filter(owner=user, name=BOOTSTRAP_KEY_NAME, revoked_at__isnull=True).exists()
        if exists and not force_new:
            return f"(printed on first run; mint another: {mint})"
        _, raw = services.apikey_create(owner=user, name=BOOTSTRAP_KEY_NAME)
        return raw
