"""Root URL configuration: the admin, the API surfaces and the landing page."""

from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

admin.site.site_header = "mlxhost"
admin.site.site_title = "mlxhost admin"
# No "View site" link: "/" is this admin; the header links the dashboard, models and chat pages.
admin.site.site_url = None
admin.site.index_title = "Models, keys and stored responses"

# Unknown /v1/ routes, and requests Django refuses before any view (a Host outside
# ALLOWED_HOSTS), answer JSON in the API's envelope; other paths get Django's page.
handler400 = "api.errors.bad_request"
handler404 = "api.errors.page_not_found"

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    # Browsers ask for it on every page; the admin's pages name the SVG in their head.
    path(
        "favicon.ico", RedirectView.as_view(url=f"{settings.STATIC_URL}mlxhost/favicon.svg", permanent=True)
    ),
    path("admin/", admin.site.urls),
    path("dashboard/", include("models_app.console.urls")),
    path("", include("api.urls")),
]
