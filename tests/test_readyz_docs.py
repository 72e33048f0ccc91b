"""What the docs say /readyz means matches docs/operations.md: the host is ready while at least
one model can serve, so no page may promise that /readyz waits for one particular model."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# "/readyz answers 200 once it (a model) is resident / loaded / ready"
ONE_MODEL_PROMISE = re.compile(r"/readyz`?\)?[^.]{0,80}\b200\b[^.]{0,40}\bonce\b", re.IGNORECASE)


def test_no_page_says_readyz_waits_for_one_model() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    wrong = [
        f"{page.name}: {match.group(0)!r}"
        for page in pages
        for match in ONE_MODEL_PROMISE.finditer(" ".join(page.read_text().split()))
    ]
    assert not wrong, wrong
