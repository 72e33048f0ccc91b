"""What the admin and the dashboard show for a model held by several fleet hosts (OPS-8, OPS-9, OPS-10)."""

from __future__ import annotations

from models_app.catalogue import control


def status(host_id: int, **view) -> dict:
    base = {
        "instance_id": 7,
        "aliases": ["tiny"],
        "live_state": "resident",
        "label": "resident",
        "active": 0,
        "queued": 0,
        "capacity": 2,
        "tokens_per_s": 0.0,
        "warm_sessions": 1,
        "warm_bytes": 100,
        "cache_tokens_saved": 0,
        "memory_bytes": 1000,
        "requests_finished": 0,
        "cache_hit_rate": None,
        "disk_entries": None,
        "disk_bytes": None,
    }
    return {"boot_id": f"b{host_id}", "host_id": host_id, "instances": [{**base, **view}]}


def test_a_fleet_shows_totals_and_each_host_never_one_hosts_numbers():
    """The case the issue found: A runs 2 and queues 2 while B idles; the model shows 2 / 2 / 4."""
    busy = status(1, active=2, queued=2, requests_finished=30, cache_hit_rate=0.5, tokens_per_s=40.0)
    idle = status(2, requests_finished=10, cache_hit_rate=1.0)
    view = control.instance_views([idle, busy])[7]
    assert (view["active"], view["queued"], view["capacity"]) == (2, 2, 4)
    assert (view["memory_bytes"], view["warm_sessions"], view["tokens_per_s"]) == (2000, 2, 40.0)
    assert view["cache_hit_rate"] == (0.5 * 30 + 1.0 * 10) / 40  # weighted by requests
    assert [(h["host"], h["active"], h["queued"]) for h in view["hosts"]] == [("h01", 2, 2), ("h02", 0, 0)]
    assert view["label"] == "resident"


def test_hosts_in_different_states_show_the_one_that_needs_attention_and_name_each():
    view = control.instance_views([status(1), status(2, live_state="error", label="error")])[7]
    assert view["live_state"] == "error"
    assert view["label"] == "resident on h01; error on h02"


def test_one_engine_is_shown_as_it_reports():
    only = status(1, active=1)
    view = control.instance_views([only])[7]
    assert view["active"] == 1 and [h["host"] for h in view["hosts"]] == ["h01"]


def test_the_fleet_view_lists_every_host_with_its_models_and_a_total():
    """/readyz's `fleet` (OPS-10): each host's models and lanes, and the fleet's sum."""
    fleet = control.fleet_view([status(2, active=1, capacity=4), status(1, queued=3, capacity=2)])
    assert [(h["host"], h["active"], h["queued"], h["capacity"]) for h in fleet["hosts"]] == [
        ("h01", 0, 3, 2),
        ("h02", 1, 0, 4),
    ]
    assert fleet["hosts"][0]["models"][0]["aliases"] == ["tiny"]
    assert {k: fleet["total"][k] for k in ("active", "queued", "capacity", "memory_bytes")} == {
        "active": 1,
        "queued": 3,
        "capacity": 6,
        "memory_bytes": 2000,
    }
