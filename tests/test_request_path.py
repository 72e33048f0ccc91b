"""One streamed chat request, followed through the product's files (issue 26 "Prove it").

A profiler hook on every thread (the event loop, the sync-view thread, the tokenizer pool and the
model's worker) records each call from one product function into another while a second request
runs (the first loads the model, binds the alias and warms every lazy path). From those calls:

- the files the request crosses, from the view until the worker starts its job;
- the file-level call graph inside `mlxhost/engine/`: a cycle there means a module that called out
  is called back (through a callback or a pass-through) before the request is done, which is the
  "re-enters an engine module it has left" the engine's shape forbids.

`python -m pytest tests/test_request_path.py -s` prints both for the note on issue 26.
"""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.api.support import post_chat

pytestmark = [pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = tuple(str(ROOT / package) + "/" for package in ("mlxhost", "api", "models_app"))
ENGINE = str(ROOT / "mlxhost" / "engine") + "/"
WORKER_FILES = ("mlxhost/engine/worker.py", "mlxhost/engine/scheduling/")
WORKER_THREAD = "mlxhost-worker-"


class PathRecorder:
    """Product-to-product calls, in order, on every thread, while `recording`."""

    def __init__(self) -> None:
        self.recording = False
        self.calls: list[tuple[str, str, str]] = []  # (thread, caller file, callee file)
        self.files: list[str] = []  # callee files in first-call order
        self.named: list[tuple[str, str, str, str]] = []  # the calls with the callee's name
        self._lock = threading.Lock()

    def hook(self, frame: Any, event: str, _arg: Any) -> None:
        if event != "call" or not self.recording:
            return
        callee = frame.f_code.co_filename
        if not callee.startswith(PRODUCT):
            return
        caller_frame = frame.f_back
        while caller_frame is not None and not caller_frame.f_code.co_filename.startswith(PRODUCT):
            caller_frame = caller_frame.f_back  # through asyncio, Django and the stdlib
        caller = caller_frame.f_code.co_filename if caller_frame is not None else ""
        with self._lock:
            thread = threading.current_thread().name
            self.calls.append((thread, caller, callee))
            self.named.append((thread, caller, callee, frame.f_code.co_qualname))
            if callee not in self.files:
                self.files.append(callee)


def relative(path: str) -> str:
    return str(Path(path).relative_to(ROOT))


def files_until_the_worker(recorder: PathRecorder) -> dict[str, str]:
    """The product files in first-call order, off the worker's thread, up to the hand-off: the
    first call into the worker's files from another thread (the job's submit). Each with the
    call that first entered it, as "caller file -> function"."""
    crossed: dict[str, str] = {}
    for thread, caller, callee, name in recorder.named:
        if thread.startswith(WORKER_THREAD):
            continue
        if relative(callee) not in crossed:
            crossed[relative(callee)] = f"{relative(caller) if caller else '(outside)'} -> {name}"
        if relative(callee).startswith(WORKER_FILES):
            break
    return crossed


def cycle_edges(recorder: PathRecorder, group: list[str]) -> list[str]:
    """The calls between the files of one cycle, as "caller -> callee (function)"."""
    edges = set()
    for _thread, caller, callee, name in recorder.named:
        if caller and caller != callee and relative(caller) in group and relative(callee) in group:
            edges.add(f"{relative(caller)} -> {relative(callee)} ({name})")
    return sorted(edges)


def engine_cycles(recorder: PathRecorder) -> list[list[str]]:
    """Strongly connected groups (more than one file) of the engine's file-level call graph."""
    graph: dict[str, set[str]] = defaultdict(set)
    for _thread, caller, callee in recorder.calls:
        if caller != callee and caller.startswith(ENGINE) and callee.startswith(ENGINE):
            graph[relative(caller)].add(relative(callee))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in list(graph):
        if node not in index:
            visit(node)
    return groups


@pytest.fixture
def recorder():
    recorder = PathRecorder()
    threading.setprofile(recorder.hook)  # threads started from now on: the worker, the pools
    sys.setprofile(recorder.hook)
    try:
        yield recorder
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]  # None removes it, as sys.setprofile


async def test_one_chat_request_crosses_few_files_and_no_engine_module_twice(
    recorder, tiny_alias, api_key, mlx_engine
):
    warm = await post_chat(api_key, stream=True, max_tokens=4)  # loads, binds, warms lazy paths
    assert warm.status_code == 200
    b"".join([chunk async for chunk in warm.streaming_content])  # it ends before the recording
    recorder.recording = True
    response = await post_chat(api_key, stream=True, max_tokens=4)
    assert response.status_code == 200
    b"".join([chunk async for chunk in response.streaming_content])  # the whole stream
    recorder.recording = False
    crossed = files_until_the_worker(recorder)
    cycles = engine_cycles(recorder)
    print(f"\nfiles from the view to the worker: {len(crossed)}")  # noqa: T201 (the note's figure)
    print("\n".join(f"  {path}  ({entry})" for path, entry in crossed.items()))  # noqa: T201
    print(f"files over the whole request: {len(recorder.files)}")  # noqa: T201
    print(f"threads: {sorted({thread for thread, _, _ in recorder.calls})}")  # noqa: T201
    for group in cycles:
        print("cycle:\n" + "\n".join(f"  {edge}" for edge in cycle_edges(recorder, group)))  # noqa: T201
    assert list(crossed)[-1].startswith(WORKER_FILES), crossed
    assert cycles == [], [cycle_edges(recorder, group) for group in cycles]
