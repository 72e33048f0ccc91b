"""Django's admin autodiscovery imports `models_app.admin`: the pages live in `models_app/console/`."""

from models_app.console import admin as admin  # registers the admin pages (ADM-1, KEY-1..4)
