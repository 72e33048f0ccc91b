"""App config for the API surfaces."""

from django.apps import AppConfig


class ApiConfig(AppConfig):
    name = "api"
    verbose_name = "API"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_logged_out
        from django.core import checks

        from mlxhost.middleware import check_protections

        checks.register(check_protections, checks.Tags.security, deploy=True)

        from models_app.catalogue.control import session_sockets_close

        # Django owns logout; its signal is the one place every logout passes through.
        user_logged_out.connect(session_sockets_close, dispatch_uid="mlxhost.session_sockets_close")
