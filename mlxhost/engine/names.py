"""The names the engine binds for itself, beside aliases (REG-2).

Weights loaded by instance id are bound as `instance:<id>`, and new weights loading beside the
old ones during a reload as `reload:<id>`. An alias (a slug) never has a colon, so the two
kinds never meet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxhost.engine.types import ModelSpec

INTERNAL_NAME_MARK = ":"


def default_name(spec: ModelSpec) -> str:
    """The binding of weights loaded without an alias: by their instance id."""
    return f"instance:{spec.instance_id}"


def staging_name(spec: ModelSpec) -> str:
    """The binding new weights load under during a reload, before every name moves to them."""
    return f"reload:{spec.instance_id}"


def instance_id_of_name(name: str) -> int | None:
    """The instance id a binding by id names (`instance:<id>`, a load with no alias); else None."""
    kind, _, number = name.partition(INTERNAL_NAME_MARK)
    return int(number) if kind == "instance" and number.isdigit() else None


def is_internal_name(name: str) -> bool:
    """Whether a bound name is one of the engine's own (by instance id, a reload's staging)."""
    return INTERNAL_NAME_MARK in name
