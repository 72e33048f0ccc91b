"""App config for the API surfaces."""

from django.apps import AppConfig


class ApiConfig(AppConfig):
    name = "api"
    verbose_name = "API"
