"""bench_edit.py's requests: four small Python files to edit (one function renamed each) and eight story prompts.

Every file is ~250 tokens with SmolLM2's tokenizer (bench_edit.py prints the counts): imports,
a dataclass or constants, four or five functions with docstrings, the kind of file an editor's
"apply this edit" sends. The answer is the same file with one name changed, so most of it can be
copied from the prompt (what prompt lookup drafts from).
"""

from __future__ import annotations

EDIT_SYSTEM = "You are a careful code editor. Reply with the complete edited file in one Python code block."
STORY_SYSTEM = "You are a storyteller. Write vivid, original short stories."

# (file, function to rename, its new name)
EDITS: list[tuple[str, str, str]] = [
    (
        '''\
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Parcel:
    code: str
    weight_kg: float
    destination: str


def load_parcels(path: Path) -> list[Parcel]:
    """Read parcels from a JSON file."""
    rows = json.loads(path.read_text())
    return [Parcel(row["code"], float(row["weight_kg"]), row["destination"]) for row in rows]


def total_weight(parcels: list[Parcel]) -> float:
    """The weight of all parcels together."""
    return sum(parcel.weight_kg for parcel in parcels)


def heaviest(parcels: list[Parcel]) -> Parcel | None:
    """The heaviest parcel, or None for no parcels."""
    if not parcels:
        return None
    return max(parcels, key=lambda parcel: parcel.weight_kg)

''',
        "total_weight",
        "combined_weight",
    ),
    (
        '''\
import csv
import statistics
from pathlib import Path

HEADER = ("station", "day", "temperature_c")


def read_readings(path: Path) -> list[tuple[str, str, float]]:
    """Read (station, day, temperature) rows from a CSV file with a header."""
    with path.open(newline="") as handle:
        rows = csv.DictReader(handle)
        return [(row["station"], row["day"], float(row["temperature_c"])) for row in rows]


def mean_temperature(readings: list[tuple[str, str, float]]) -> float:
    """The mean temperature over all readings."""
    return statistics.fmean(value for _, _, value in readings)


def warmest_day(readings: list[tuple[str, str, float]]) -> str:
    """The day of the highest reading."""
    return max(readings, key=lambda row: row[2])[1]


def stations(readings: list[tuple[str, str, float]]) -> set[str]:
    """Every station that reported at least once."""
    return {station for station, _, _ in readings}

''',
        "warmest_day",
        "hottest_day",
    ),
    (
        '''\
import re
from collections import Counter

WORD = re.compile(r"[a-z']+")
STOP_WORDS = {"the", "a", "an", "and", "or", "of", "to", "in"}


def words(text: str) -> list[str]:
    """The lower-case words of `text`, in order."""
    return WORD.findall(text.lower())


def content_words(text: str) -> list[str]:
    """The words of `text` without the stop words."""
    return [word for word in words(text) if word not in STOP_WORDS]


def top_words(text: str, count: int = 10) -> list[tuple[str, int]]:
    """The `count` most frequent content words, with how often each occurs."""
    return Counter(content_words(text)).most_common(count)


def reading_time(text: str, words_per_minute: int = 200) -> float:
    """Minutes a reader needs for `text`."""
    return len(words(text)) / words_per_minute

''',
        "top_words",
        "frequent_words",
    ),
    (
        '''\
from dataclasses import dataclass, field
from datetime import date, timedelta


@dataclass
class Task:
    title: str
    due: date
    done: bool = False
    tags: list[str] = field(default_factory=list)


def overdue(tasks: list[Task], today: date) -> list[Task]:
    """Tasks not done whose due date has passed."""
    return [task for task in tasks if not task.done and task.due < today]


def due_this_week(tasks: list[Task], today: date) -> list[Task]:
    """Tasks not done that are due in the next seven days."""
    end = today + timedelta(days=7)
    return [task for task in tasks if not task.done and today <= task.due <= end]


def with_tag(tasks: list[Task], tag: str) -> list[Task]:
    """Tasks that carry `tag`."""
    return [task for task in tasks if tag in task.tags]

''',
        "due_this_week",
        "due_soon",
    ),
]

STORIES = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a short story about a robot that learns to bake bread in a small village.",
    "Write a short story about two friends lost in a snowstorm on a mountain pass.",
    "Write a short story about a girl who can hear what the trees are saying.",
    "Write a short story about the last train of the night and its only passenger.",
    "Write a short story about a fisherman who catches a fish made of gold.",
    "Write a short story about a cat that runs a bookshop after the owner goes home.",
    "Write a short story about a city where it has not rained for a hundred years.",
]


def edit_messages(index: int, tag: str) -> list[dict[str, str]]:
    """User `index`'s edit request. `tag` (in the system prompt, so the answer does not copy it)
    is the same for every system within a run, so their answers can be compared, and new each
    run, so no system replays a cached prompt."""
    source, old, new = EDITS[index % len(EDITS)]
    ask = f"Rename the function `{old}` to `{new}` and give me the whole file back, nothing else."
    return [
        {"role": "system", "content": f"{EDIT_SYSTEM} (session {tag}-{index})"},
        {"role": "user", "content": f"{ask}\n\n```python\n{source}```"},
    ]


def story_messages(index: int, tag: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"[{tag}-{index}] {STORY_SYSTEM}"},
        {"role": "user", "content": STORIES[index % len(STORIES)]},
    ]
