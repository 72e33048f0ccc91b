"""Edit benchmark (issue 27): a Python file back with one function renamed, Predicted Outputs, 8 stories at once.

mlx_lm.server and mlxhost on the same weights, side by side, interleaved, medians of runs; with a
third system, mlxhost with speculation off, when the alias has a `speculation` setting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from _common import (
    ALIAS,
    DEFAULT_MODELS_ROOT,
    MODELS,
    ROOT,
    Servers,
    SseStream,
    ensure_model,
    loadavg,
    manage,
    render,
    state_env,
    text_bias,
)
from _edit_report import BASELINE, NO_SPEC, OURS, EditReport, Wave
from _edit_workload import EDITS, edit_messages, story_messages
from mlx_lm.utils import load_tokenizer

NO_SPEC_ALIAS = "bench-nospec"
ALIAS_CONCURRENCY = 8  # the 8 stories share one batch
METRIC = re.compile(r"^(mlxhost_speculation_\w+)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN)$")
# Registers the aliases. The speculation setting is looked up on ModelAlias at run time: the main
# alias keeps its default (on, with prompt lookup), the second one gets the field's "off" value.
REGISTER = """\
import json
from django.contrib.auth import get_user_model
from django.db import models as dm
from models_app.catalogue import services
from models_app.models import ModelAlias
settings = {settings!r}
user = get_user_model().objects.create_user('bench')
services.alias_register(name={alias!r}, local_path={folder!r}, source_kind='local', pinned=True, **settings)
field = next((f for f in ModelAlias._meta.get_fields() if f.name == 'speculation'), None)
off = {off!r}
if field is not None and off is None:
    if isinstance(field, dm.BooleanField):
        off = [False]
    elif field.choices:
        off = [v for v, _ in field.choices if str(v).lower() in ('off', 'none', 'disabled', 'no', 'false')][:1]
    off = off[0] if off else None
if field is not None and off is not None:
    services.alias_register(name={nospec!r}, local_path={folder!r}, source_kind='local', speculation=off,
                            **settings)
on = ModelAlias.objects.get(name={alias!r})
related = sorted(f.name for f in ModelAlias._meta.get_fields() if f.name.startswith('specul'))
print('SPEC=' + json.dumps({{'field': field is not None, 'on': getattr(on, 'speculation', None), 'off': off,
                            'fields': related}}, default=str))
print('KEY=' + services.apikey_create(owner=user, name='bench')[1])
"""


def register(env: dict[str, str], folder: Path, off: object) -> tuple[str, dict]:
    """Migrate the throwaway DB and register `bench` (and `bench-nospec` when the speculation
    setting exists); return an API key and what was found about the setting."""
    manage(env, "migrate", "--noinput", "-v", "0")
    settings = {
        "temperature": 0.0,
        "repetition_penalty": None,  # the demo alias has 1.1; mlx_lm.server has none
        "concurrency": ALIAS_CONCURRENCY,
        "queue_depth": 64,
    }
    snippet = REGISTER.format(
        settings=settings, alias=ALIAS, folder=folder.name, off=off, nospec=NO_SPEC_ALIAS
    )
    out = manage(env, "shell", "-c", snippet).splitlines()
    key = next(line[4:] for line in out if line.startswith("KEY="))
    return key, json.loads(next(line[5:] for line in out if line.startswith("SPEC=")))


def sampling() -> dict:
    """The same sampling, sent to every system: greedy, no penalties (omitted repetition_penalty is
    none on mlx_lm.server, and the alias has none: mlxhost refuses 0, mlx_lm.server's "off")."""
    return {"temperature": 0, "top_p": 1.0, "presence_penalty": 0, "frequency_penalty": 0}


class Client:
    """One system over HTTP: a wave of streamed chat requests sent at once."""

    def __init__(self, name: str, url: str, key: str = "", alias: str = "") -> None:
        self.name, self.url = name, url
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.model_field = {"model": alias} if alias else {}  # mlx_lm.server serves its one model

    def wave(self, bodies: list[dict]) -> Wave:
        return asyncio.run(self._wave(bodies))

    async def _wave(self, bodies: list[dict]) -> Wave:
        limits = httpx.Limits(max_connections=len(bodies) + 2)
        async with httpx.AsyncClient(
            base_url=self.url, headers=self.headers, timeout=900, limits=limits
        ) as c:
            started = time.perf_counter()
            done = await asyncio.gather(*(self._one(c, body) for body in bodies))
        return Wave(started=started, streams=[s for s, _ in done], errors=[e for _, e in done])

    async def _one(self, client: httpx.AsyncClient, body: dict) -> tuple[SseStream, str]:
        stream = SseStream(started=time.perf_counter())
        try:
            async with client.stream(
                "POST", "/v1/chat/completions", json={**self.model_field, **body}
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return stream, f"HTTP {resp.status_code}: {resp.text[:300]}"
                async for line in resp.aiter_lines():
                    stream.feed(line, time.perf_counter())
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
            return stream, f"{type(exc).__name__}: {exc}"
        stream.ended = time.perf_counter()
        return stream, "" if stream.times else "no content"

    def speculation_counters(self) -> dict[str, float]:
        """mlxhost's `mlxhost_speculation_*` samples from /metrics ({} for mlx_lm.server or none)."""
        if not self.headers:
            return {}
        time.sleep(0.2)  # the counters take a request when it ends: let the last one land
        try:
            text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        except httpx.HTTPError:
            return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            match = METRIC.match(line.strip())
            if match and not match.group(1).endswith(("_created",)):
                out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
        return out


def body(
    messages: list[dict], max_tokens: int, bias: dict[int, float] | None = None, **extra: object
) -> dict:
    out = {
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        **sampling(),
        **extra,
    }
    if bias:
        out["logit_bias"] = {str(k): v for k, v in bias.items()}
    return out


class Bench:
    """The runs: every workload on every system, interleaved, then the Predicted Outputs pair."""

    def __init__(self, systems: dict[str, Client], args: argparse.Namespace, bias: dict, report: EditReport):
        self.systems, self.args, self.bias, self.report = systems, args, bias, report

    def salt(self, client: Client, tag: str) -> dict:
        """mlxhost: a cache domain of its own per system and run, because both mlxhost systems share
        one server and its prefix cache (mlx_lm.server gets nothing it does not know)."""
        return {"cache_salt": f"{tag}-{client.name}"} if client.headers else {}

    def bodies(self, client: Client, workload: str, tag: str, tokens: dict[str, int]) -> list[dict]:
        salt = self.salt(client, tag)
        if workload == "stories":
            return [
                body(story_messages(i, tag), tokens["stories"], self.bias, **salt)
                for i in range(self.args.stories)
            ]
        users = int(workload.split("-")[1])
        return [body(edit_messages(i, tag), tokens["edit"], **salt) for i in range(users)]

    def measure(self, client: Client, workload: str, tag: str, tokens: dict[str, int]) -> Wave:
        before = client.speculation_counters()
        wave = client.wave(self.bodies(client, workload, tag, tokens))
        wave.counters = _deltas(before, client.speculation_counters())
        return wave

    def warm_up(self) -> None:
        tokens = {"edit": 8, "stories": 8}
        for name, client in self.systems.items():
            errors = []
            for workload in ("edit-1", "stories"):
                errors += [e for e in self.measure(client, workload, f"warm-{name}", tokens).errors if e]
            print(f"  {name} warmed up" + (f": FAILED {sorted(set(errors))}" if errors else ""), flush=True)

    def run(self) -> None:
        nonce, names = secrets.token_hex(3), list(self.systems)
        tokens = {"edit": self.args.edit_tokens, "stories": self.args.story_tokens}
        workloads = [f"edit-{u}" for u in self.args.users] + (["stories"] if self.args.stories else [])
        for r in range(self.args.runs):
            order = names[r % len(names) :] + names[: r % len(names)]
            for workload in workloads:
                tag = f"{nonce}-r{r}"  # the same for every system in a run: their texts compare
                for name in order:
                    wave = self.measure(self.systems[name], workload, tag, tokens)
                    self.report.add(workload, name, r, wave)
                    print(f"  run {r + 1}/{self.args.runs} {self.report.line(workload, name, r)}", flush=True)
            if OURS in self.systems and self.args.predicted:
                self.predicted(self.systems[OURS], f"{nonce}-p{r}", r)

    def predicted(self, client: Client, tag: str, run: int) -> None:
        """The 1-user edit without a prediction, then again with its own answer as the prediction."""
        before = client.speculation_counters()
        plain = client.wave([body(edit_messages(0, tag), self.args.edit_tokens, cache_salt=f"{tag}-a")])
        plain.counters = _deltas(before, client.speculation_counters())
        self.report.add("predicted-plain", OURS, run, plain)
        if plain.failures:
            print(f"  run {run + 1} predicted: the plain request failed: {plain.errors}", flush=True)
            return
        answer = "".join(plain.streams[0].parts)
        before = client.speculation_counters()
        with_prediction = client.wave(
            [
                body(
                    edit_messages(0, tag),
                    self.args.edit_tokens,
                    cache_salt=f"{tag}-b",
                    prediction={"type": "content", "content": answer},
                )
            ]
        )
        with_prediction.counters = _deltas(before, client.speculation_counters())
        self.report.add("predicted", OURS, run, with_prediction)
        print(f"  run {run + 1}/{self.args.runs} {self.report.predicted_line(run)}", flush=True)


def _deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        name: after[name] - before.get(name, 0.0) for name in after if after[name] != before.get(name, 0.0)
    }


def run_model(args: argparse.Namespace, report: EditReport) -> None:
    with tempfile.TemporaryDirectory(prefix="mlxhost-bench-edit-") as tmp:
        state = Path(tmp)
        env = state_env(Path(args.models_root).resolve(), state)
        folder = ensure_model(env, args.model)
        key, spec = register(env, folder, json.loads(args.off_setting) if args.off_setting else None)
        report.speculation_setting = spec
        print(f"speculation setting on ModelAlias: {spec}", flush=True)
        tokenizer = tokenizer_of(folder)
        report.prompt_tokens = [len(render(tokenizer, edit_messages(i, "x" * 6))) for i in range(len(EDITS))]
        bias = text_bias(tokenizer, random_weights=args.model != "demo")
        with Servers(folder, state, env) as servers:
            try:
                systems = build_systems(servers, key, spec, args)
                bench = Bench(systems, args, bias, report)
                bench.warm_up()
                bench.run()
            except BaseException:
                print(servers.logs_tail(), file=sys.stderr)
                raise


def build_systems(servers: Servers, key: str, spec: dict, args: argparse.Namespace) -> dict[str, Client]:
    systems: dict[str, Client] = {}
    if BASELINE in args.systems:
        systems[BASELINE] = Client(BASELINE, servers.mlx_lm_server())
    if {OURS, NO_SPEC} & set(args.systems):
        url = servers.mlxhost(key)  # both aliases name the same model: one daphne, one set of weights
        if OURS in args.systems:
            systems[OURS] = Client(OURS, url, key, ALIAS)
        if NO_SPEC in args.systems and spec.get("off") is not None:
            systems[NO_SPEC] = Client(NO_SPEC, url, key, NO_SPEC_ALIAS)
        elif NO_SPEC in args.systems:
            print(f"  no {NO_SPEC!r}: ModelAlias has no usable speculation setting ({spec})", flush=True)
    return systems


def tokenizer_of(folder: Path):
    eos = json.loads((folder / "config.json").read_text()).get("eos_token_id")
    return load_tokenizer(folder, eos_token_ids=eos if isinstance(eos, list) or eos is None else [eos])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model", default="demo", choices=sorted(MODELS), help="weights (default demo: SmolLM2)"
    )
    parser.add_argument("--users", help="comma-separated edit users at once (default 1,4)")
    parser.add_argument("--edit-tokens", type=int, help="max_tokens of an edit answer (default 200)")
    parser.add_argument("--stories", type=int, help="stories at once, 0 for none (default 8)")
    parser.add_argument("--story-tokens", type=int, help="tokens per story, EOS suppressed (default 128)")
    parser.add_argument(
        "--predicted", action=argparse.BooleanOptionalAction, default=True, help="the Predicted Outputs pair"
    )
    parser.add_argument("--systems", default=f"{BASELINE},{OURS},{NO_SPEC}", help="comma-separated subset")
    parser.add_argument(
        "--off-setting", help="JSON value of the alias's `speculation` that turns it off (auto)"
    )
    parser.add_argument("--runs", type=int, help="repeats; medians are reported (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 run, 48/32 tokens, 1 and 4 users")
    parser.add_argument(
        "--write", action=argparse.BooleanOptionalAction, default=False, help="append a section to RESULTS.md"
    )
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    parser.add_argument("--models-root", default=DEFAULT_MODELS_ROOT)
    args = parser.parse_args(argv)
    quick = {"users": "1,4", "edit_tokens": 48, "stories": 8, "story_tokens": 32, "runs": 1}
    full = {"users": "1,4", "edit_tokens": 200, "stories": 8, "story_tokens": 128, "runs": 3}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:  # explicit options win over the mode's defaults
            setattr(args, name, value)
    if args.quick and args.write:
        parser.error("--quick does not write results")
    args.users = [int(u) for u in args.users.split(",") if u.strip()]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if set(args.systems) - {BASELINE, OURS, NO_SPEC}:
        parser.error(f"unknown systems: {sorted(set(args.systems) - {BASELINE, OURS, NO_SPEC})}")
    return args


def main() -> int:
    args = parse_args()
    command = ("python benchmarks/bench_edit.py " + " ".join(sys.argv[1:])).strip()
    report = EditReport(command=command, args=args)
    report.started(datetime.now(UTC), loadavg())
    print(f"model {args.model}: starting mlx_lm.server and mlxhost ...", flush=True)
    run_model(args, report)
    report.finished(loadavg())
    text = report.markdown()
    print("\n" + text)
    if args.write:
        report.append_to(Path(args.results), text)
        print(f"appended to {args.results}")
    failures = report.failures()
    if failures:
        print(f"FAILED: {failures} request(s) failed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
