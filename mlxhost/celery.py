"""The Celery app (`celery -A mlxhost.celery worker --beat`); kept out of mlxhost/__init__.py."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar, cast

from celery import Celery

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mlxhost.settings")

app = Celery("mlxhost")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["models_app.persistence", "models_app.catalogue"])  # their tasks.py

P = ParamSpec("P")
R = TypeVar("R", covariant=True)


class TypedTask(Protocol[P, R]):
    """What mypy sees of a Celery task: the parts this project uses. Celery ships no type
    information, so `app.task` alone would leave each task function untyped."""

    name: str
    app: Celery

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def apply(self, args: Sequence[Any] = (), *, throw: bool = False) -> Any: ...

    def delay(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...


def task(**options: Any) -> Callable[[Callable[P, R]], TypedTask[P, R]]:
    """`app.task(**options)`, typed: the decorated function keeps its signature for mypy."""
    return cast("Callable[[Callable[P, R]], TypedTask[P, R]]", app.task(**options))
