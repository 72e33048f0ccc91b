"""App config for models_app. `ready()` stays empty: the engine is built lazily by mlxhost/runtime/lifecycle."""

from django.apps import AppConfig


class ModelsAppConfig(AppConfig):
    name = "models_app"
    verbose_name = "Models"
