"""Ensure a staff login and an API key exist, and print them (once, when generated)."""

from __future__ import annotations

import os
import secrets
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction

from models_app import services
from models_app.models import ApiKey

BOOTSTRAP_KEY_NAME = "bootstrap"


class Command(BaseCommand):
    help = (
        "Create the staff login (DJANGO_SUPERUSER_USERNAME/PASSWORD or generated) and an API key "
        "(MLXHOST_BOOTSTRAP_API_KEY or generated), printing generated secrets once."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--new-key", action="store_true", help="Always mint and print a fresh API key.")
        parser.add_argument("--port", default=os.environ.get("PORT", "8000"))

    @transaction.atomic
    def handle(self, *args: Any, **options: Any) -> None:
        user, password = self._ensure_user()
        key_text = self._ensure_key(user, force_new=options["new_key"])
        base = f"http://127.0.0.1:{options['port']}"
        lines = [
            "",
            "=" * 72,
            f"  Admin:    {base}/admin/",
            f"  Login:    {user.get_username()} / {password}",
            f"  API key:  {key_text}",
            f"  OpenAI:   base_url={base}/v1   model=smollm2",
            f"  Embed:    POST {base}/v1/embeddings   model=minilm",
            "=" * 72,
            "",
        ]
        self.stdout.write("\n".join(lines))

    def _ensure_user(self) -> tuple[Any, str]:
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
        return user, "(printed when it was created; reset: .venv/bin/python manage.py changepassword)"

    def _ensure_key(self, user: Any, *, force_new: bool) -> str:
        raw = os.environ.get("MLXHOST_BOOTSTRAP_API_KEY")
        if raw:
            services.apikey_ensure(owner=user, raw_key=raw, name=BOOTSTRAP_KEY_NAME)
            return "(from MLXHOST_BOOTSTRAP_API_KEY)"
        exists = ApiKey.objects.filter(owner=user, name=BOOTSTRAP_KEY_NAME, revoked_at__isnull=True).exists()
        if exists and not force_new:
            return "(printed on first run; mint another: make api-key)"
        _, raw = services.apikey_create(owner=user, name=BOOTSTRAP_KEY_NAME)
        return raw
