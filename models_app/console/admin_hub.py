"""The model admin's hub actions (issue 28): Check for updates says whether a pinned revision has
moved (old and new commit, changed files); Update pins the new commit, which the engines swap to."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin, messages
from django.core.exceptions import ValidationError

from models_app.catalogue import hub_pins, services
from models_app.models import ModelInstance

if TYPE_CHECKING:
    from django.db.models import QuerySet
    from django.http import HttpRequest

    from models_app.models import Model

HUB_ACTIONS = ("check_hub_updates", "update_hub_pin")
NOT_HUB = "{names}: local folders have no hub revision."


class HubPinActions:
    """Mixed into the model admin: its two hub actions, each model's outcome a message."""

    @admin.action(description="Check for updates (hub models)", permissions=["view"])
    def check_hub_updates(self, request: HttpRequest, queryset: QuerySet[Model]) -> None:
        for model in self._hub_models(request, queryset):
            try:
                update = hub_pins.model_hub_check(model=model)
            except ValidationError as exc:
                messages.error(request, f"{model.name}: {'; '.join(exc.messages)}")
                continue
            level = messages.WARNING if update.moved else messages.INFO
            hint = " Use Update to serve it." if update.moved else ""
            messages.add_message(request, level, update.describe() + hint)

    @admin.action(description="Update to the revision's newest commit (hub models)", permissions=["change"])
    def update_hub_pin(self, request: HttpRequest, queryset: QuerySet[Model]) -> None:
        for model in self._hub_models(request, queryset):
            try:
                update = services.model_hub_update(model=model, actor=request.user)
            except ValidationError as exc:
                messages.error(request, f"{model.name}: {'; '.join(exc.messages)}")
                continue
            if not update.moved:
                messages.info(request, update.describe())
                continue
            messages.success(
                request,
                f"{update.describe()} Now instance #{model.instance_id}: the old one serves until the "
                "new commit is loaded.",
            )

    def _hub_models(self, request: HttpRequest, queryset: QuerySet[Model]) -> list[Model]:
        hub = [m for m in queryset if m.source_kind == ModelInstance.SourceKind.HUB]
        local = [m.name for m in queryset if m.source_kind != ModelInstance.SourceKind.HUB]
        if local:
            messages.info(request, NOT_HUB.format(names=", ".join(local)))
        return hub
