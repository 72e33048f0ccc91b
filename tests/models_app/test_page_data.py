"""The staff pages' script data is strict JSON: a non-finite number is null, never `NaN`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from django.conf import settings
from django.template import Context, Template

from models_app.catalogue import control
from tests.models_app.test_dashboard import engine_status, staff_client, tiny_enabled  # noqa: F401

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_engine_status")]


def _strict(text: str):
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _script(page: str, element_id: str):
    found = re.search(rf'<script id="{element_id}" type="application/json">(.*?)</script>', page, re.S)
    assert found, f"no #{element_id} script data"
    return _strict(found.group(1))


@pytest.mark.parametrize("url", ["/dashboard/", "/dashboard/models/"])
def test_a_nan_in_the_status_reaches_the_page_as_null(staff_client, tiny_enabled, url):  # noqa: F811
    """Was `"ttft_ms": NaN` in #initial-status, which the page's `JSON.parse` refuses."""
    control.status_publish(engine_status(ttft_ms=float("nan"), tokens_per_s=float("inf")))
    response = staff_client.get(url)
    assert response.status_code == 200
    (instance,) = _script(response.content.decode(), "initial-status")[0]["instances"]
    assert instance["ttft_ms"] is None and instance["tokens_per_s"] is None
    assert instance["decode_tps"] == 50.0


def test_the_filter_escapes_as_json_script_does():
    value = {"a": float("-inf"), "b": [1.5, float("nan")], "c": "</script><!--"}
    html = Template('{% load mlxhost_pages %}{{ v|strict_json_script:"x" }}').render(Context({"v": value}))
    assert "</script><!--" not in html
    assert _script(html, "x") == {"a": None, "b": [1.5, None], "c": "</script><!--"}


def test_no_template_writes_script_data_with_plain_json_script():
    templates = Path(settings.BASE_DIR) / "templates"
    plain = [p for p in templates.rglob("*.html") if re.search(r"\|json_script\b", p.read_text())]
    assert plain == []
