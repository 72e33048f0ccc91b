"""The usage recorder and its writes (KEY-1, KEY-2): tallies in memory, one row per key per day,
incremented in place; failures kept for the next flush; the reports the admin reads (KEY-3)."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest
from django.db.models.query import QuerySet

from mlxhost.engine import Done, Failed, Timings, Usage
from models_app.accounting import usage
from models_app.catalogue import services
from models_app.models import ApiKey, UsageDay
from tests.support import FakeClock

pytestmark = [pytest.mark.django_db]

NOON = datetime(2026, 3, 4, 12, tzinfo=UTC).timestamp()
TIMINGS = Timings(0.0, 0.0, 0.0, 0.0)


def done(prompt: int, output: int, cached: int = 0, finish: str = "stop") -> Done:
    return Done(finish_reason=finish, usage=Usage(prompt, output, cached), timings=TIMINGS)  # type: ignore[arg-type]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(NOON)


@pytest.fixture
def recorder(clock):
    store = usage.UsageRecorder(flush_interval_s=3600, clock=clock)
    yield store
    store.close()


@pytest.fixture
def key(user) -> ApiKey:
    return services.apikey_create(owner=user, name="laptop")[0]


def counts(row: UsageDay) -> tuple[int, int, int, int]:
    return row.requests, row.prompt_tokens, row.cached_tokens, row.output_tokens


def test_turns_are_tallied_per_key_and_day_and_written_as_one_row(recorder, clock, key, user):
    """KEY-2: turns add up in memory; the flush writes one row per key per UTC day, and adds to it
    in place on the next flush (F() expressions), never a second row."""
    recorder.turn_ended(done(10, 4, cached=6), owner_id=user.pk, key_id=key.pk)
    recorder.turn_ended(done(12, 5), owner_id=user.pk, key_id=key.pk)
    recorder.turn_ended(done(3, 2), owner_id=user.pk, key_id=None)  # the same user's browser session
    assert UsageDay.objects.count() == 0
    recorder.flush_sync()
    rows = {row.key_id: row for row in UsageDay.objects.all()}
    assert counts(rows[key.pk]) == (2, 22, 6, 9)
    assert counts(rows[None]) == (1, 3, 0, 2)
    assert rows[key.pk].day == date(2026, 3, 4)

    recorder.turn_ended(done(1, 1), owner_id=user.pk, key_id=key.pk)
    recorder.turn_ended(done(1, 1), owner_id=user.pk, key_id=None)
    recorder.flush_sync()
    assert UsageDay.objects.count() == 2
    assert counts(UsageDay.objects.get(key=key)) == (3, 23, 6, 10)
    assert counts(UsageDay.objects.get(key=None)) == (2, 4, 0, 3)

    clock.advance(12 * 3600)  # the next UTC day starts a new row
    recorder.turn_ended(done(2, 2), owner_id=user.pk, key_id=key.pk)
    recorder.flush_sync()
    assert sorted(UsageDay.objects.filter(key=key).values_list("day", flat=True)) == [
        date(2026, 3, 4),
        date(2026, 3, 5),
    ]


def test_a_requests_later_choices_add_only_their_completion_tokens(recorder, key, user):
    """KEY-2 with `n` choices: the request and its prompt count once, with choice 0; every
    choice's completion tokens add up, as the answer's usage does."""
    for choice, output in enumerate((4, 6, 5)):
        recorder.turn_ended(done(10, output, cached=3), owner_id=user.pk, key_id=key.pk, choice=choice)
    recorder.flush_sync()
    assert counts(UsageDay.objects.get(key=key)) == (1, 10, 3, 15)


def test_turns_that_never_reached_the_model_count_nothing(recorder, key, user):
    """KEY-2: a failed turn, or one cancelled while it waited (no tokens), is not a request."""
    recorder.turn_ended(Failed(code="queue_timeout", message="x"), owner_id=user.pk, key_id=key.pk)
    recorder.turn_ended(done(0, 0, finish="cancelled"), owner_id=user.pk, key_id=key.pk)
    assert recorder.pending() == {}
    recorder.turn_ended(done(9, 3, finish="cancelled"), owner_id=user.pk, key_id=key.pk)  # it ran
    recorder.flush_sync()
    assert counts(UsageDay.objects.get()) == (1, 9, 0, 3)


def test_a_failed_write_keeps_the_tallies_for_the_next_flush(recorder, key, user, monkeypatch):
    """KEY-2: a database error loses nothing: the tallies go back and the next flush writes them."""
    real = usage.usage_add
    failures = iter([RuntimeError("database is down")])

    def flaky(**kwargs):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        real(**kwargs)

    monkeypatch.setattr(usage, "usage_add", flaky)
    recorder.turn_ended(done(10, 4), owner_id=user.pk, key_id=key.pk)
    recorder.flush_sync()
    assert UsageDay.objects.count() == 0
    recorder.turn_ended(done(1, 1), owner_id=user.pk, key_id=key.pk)
    recorder.flush_sync()
    assert counts(UsageDay.objects.get()) == (2, 11, 0, 5)


def test_embeddings_counts_and_refusals_are_tallied_with_the_turns(recorder, key, user):
    """KEY-2: an embedding request is a request and its input tokens; a count_tokens call a count
    of its own; refusals by the key's limits and by a busy model are counted apart; all in the
    key's one row for the day."""
    recorder.turn_ended(done(10, 5), owner_id=user.pk, key_id=key.pk)
    recorder.embedded(7, owner_id=user.pk, key_id=key.pk)
    recorder.counted(owner_id=user.pk, key_id=key.pk)
    recorder.counted(owner_id=user.pk, key_id=key.pk)
    recorder.refused("rate_limited", owner_id=user.pk, key_id=key.pk)
    recorder.refused("overloaded", owner_id=user.pk, key_id=None)  # a browser session's turn
    recorder.flush_sync()
    row = UsageDay.objects.get(key=key)
    assert counts(row) == (2, 17, 0, 5)
    assert (row.count_requests, row.rate_limited, row.overloaded) == (2, 1, 0)
    session = UsageDay.objects.get(key=None)
    assert (session.requests, session.overloaded) == (0, 1)


def test_a_deleted_key_or_user_drops_its_tallies(recorder, key, user, django_user_model):
    other = django_user_model.objects.create_user(username="gone", password="pw-gone-123")
    gone, _ = services.apikey_create(owner=other, name="gone")
    recorder.turn_ended(done(5, 5), owner_id=other.pk, key_id=gone.pk)
    recorder.turn_ended(done(1, 1), owner_id=user.pk, key_id=key.pk)
    other.delete()
    recorder.flush_sync()
    assert list(UsageDay.objects.values_list("key_id", flat=True)) == [key.pk]


def test_a_row_another_process_created_meanwhile_is_added_to(key, user, monkeypatch):
    """KEY-2: when the day's row appears between our UPDATE and INSERT (another process made it),
    the unique constraint refuses the second row and the increment lands on the first."""
    day = date(2026, 3, 4)
    UsageDay.objects.create(day=day, owner=user, key=key, requests=5, prompt_tokens=50)
    real_update = QuerySet.update
    calls = []

    def first_update_misses(self, **kwargs):
        calls.append(kwargs)
        return 0 if len(calls) == 1 else real_update(self, **kwargs)

    monkeypatch.setattr(QuerySet, "update", first_update_misses)
    usage.usage_add(tallies={(day, user.pk, key.pk): usage.Tally(1, 10, 0, 2)})
    monkeypatch.undo()
    assert counts(UsageDay.objects.get()) == (6, 60, 0, 2)
    assert len(calls) == 2


def test_last_used_at_is_stamped_by_the_flush_at_most_once_a_minute(recorder, clock, key):
    """KEY-1: a key's use is noted in memory; the flush writes `last_used_at`, once a minute."""
    recorder.key_used(key.pk)
    assert ApiKey.objects.get().last_used_at is None
    recorder.flush_sync()
    first = ApiKey.objects.get().last_used_at
    assert first == datetime.fromtimestamp(NOON, UTC)
    clock.advance(30)
    recorder.key_used(key.pk)
    recorder.flush_sync()
    assert ApiKey.objects.get().last_used_at == first
    clock.advance(31)
    recorder.key_used(key.pk)
    recorder.flush_sync()
    assert ApiKey.objects.get().last_used_at == first + timedelta(seconds=61)


def test_another_processs_recent_stamp_is_not_rewritten(key):
    """KEY-1: the guard is in the UPDATE too, so many processes still write about once a minute."""
    stamp = datetime.fromtimestamp(NOON, UTC)
    ApiKey.objects.filter(pk=key.pk).update(last_used_at=stamp)
    usage.apikeys_touch(used_at={key.pk: NOON + 20})
    assert ApiKey.objects.get().last_used_at == stamp
    usage.apikeys_touch(used_at={key.pk: NOON + 61})
    assert ApiKey.objects.get().last_used_at == stamp + timedelta(seconds=61)


def test_reports_sum_per_day_and_per_user_and_export_csv(key, user, django_user_model):
    """KEY-3: the admin's reads: sums per day (oldest first), per user, totals, chart series, CSV."""
    other = django_user_model.objects.create_user(username="bob", password="pw-bob-123")
    bobs, _ = services.apikey_create(owner=other, name="=HYPERLINK(evil)")
    UsageDay.objects.create(
        day=date(2026, 3, 3), owner=user, key=key, requests=2, prompt_tokens=20, output_tokens=5
    )
    UsageDay.objects.create(
        day=date(2026, 3, 4), owner=user, key=key, requests=1, prompt_tokens=7, output_tokens=3
    )
    UsageDay.objects.create(
        day=date(2026, 3, 4),
        owner=other,
        key=bobs,
        requests=4,
        prompt_tokens=40,
        cached_tokens=30,
        count_requests=3,
        rate_limited=2,
        overloaded=1,
    )
    rows = UsageDay.objects.all()
    days = usage.usage_by_day(rows=rows)
    assert [(d["day"], d["requests"], d["total_tokens"]) for d in days] == [
        (date(2026, 3, 3), 2, 25),
        (date(2026, 3, 4), 5, 50),
    ]
    assert usage.usage_totals(rows=rows) == {
        "requests": 7,
        "prompt_tokens": 67,
        "cached_tokens": 30,
        "output_tokens": 8,
        "count_requests": 3,
        "rate_limited": 2,
        "overloaded": 1,
        "total_tokens": 75,
    }
    assert [(u["owner__username"], u["total_tokens"]) for u in usage.usage_by_owner(rows=rows)] == [
        ("bob", 40),
        ("alice", 35),
    ]
    chart = usage.usage_chart_data(days=days)
    assert chart["t"] == [int(datetime(2026, 3, d, tzinfo=UTC).timestamp()) for d in (3, 4)]
    assert chart["prompt"] == [20, 47] and chart["cached"] == [0, 30] and chart["output"] == [5, 3]
    assert chart["refused"] == [0, 3]  # by the key's limits and by a busy model, per day

    lines = list(usage.usage_csv(rows=rows))
    assert lines[0] == (
        "day,user,key,key prefix,requests,prompt_tokens,cached_tokens,output_tokens,total_tokens,"
        "count_requests,rate_limited,overloaded\r\n"  # the newer columns last
    )
    assert lines[1:] == [
        f"2026-03-04,alice,laptop,{key.prefix},1,7,0,3,10,0,0,0\r\n",
        f"2026-03-04,bob,'=HYPERLINK(evil),{bobs.prefix},4,40,30,0,40,3,2,1\r\n",  # never a formula
        f"2026-03-03,alice,laptop,{key.prefix},2,20,0,5,25,0,0,0\r\n",
    ]
