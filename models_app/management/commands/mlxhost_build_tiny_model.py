"""Build the deterministic tiny random-weights test model under MODELS_ROOT (offline, idempotent)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from mlxhost.engine import VISION_EXTRA, resolve_under, vision_extra_installed


class Command(BaseCommand):
    help = "Build a tiny deterministic llama model (random weights, ~0.5 MB) for tests and smoke checks."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--folder", default="tiny-llama", help="Folder name under MODELS_ROOT.")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--alias", default="", help="Also register an alias with this name.")
        parser.add_argument(
            "--vision",
            action="store_true",
            help="A tiny LLaVA (CLIP vision tower, 16 image tokens per image) for the vision kind; "
            "needs the vision extra (make install-vision). Default folder: tiny-llava.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from mlxhost.engine.backends.mlx.tiny import build_tiny_model
        from models_app.catalogue import services

        folder = options["folder"]
        if options["vision"] and folder == "tiny-llama":
            folder = "tiny-llava"
        dest = resolve_under(Path(settings.MODELS_ROOT), folder)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if options["vision"]:
            if not vision_extra_installed():
                raise CommandError(VISION_EXTRA)
            from mlxhost.engine.backends.mlx.tiny_vision import build_tiny_vision_model

            build_tiny_vision_model(dest, seed=options["seed"])
        else:
            build_tiny_model(dest, seed=options["seed"])
        self.stdout.write(f"tiny model ready at {dest}")
        if options["alias"]:
            alias = services.alias_register(name=options["alias"], source_kind="local", local_path=folder)
            self.stdout.write(f"alias {alias.name!r} -> instance #{alias.instance_id}")
