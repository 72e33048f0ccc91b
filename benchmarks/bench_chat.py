"""Multi-user chat benchmark (issue 12): U users x T turns at once on a shared system prompt, mlxhost vs mlx_lm.server."""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
from _chat_report import BASELINE, SYSTEMS, ChatReport, Session, Turn
from _common import (
    ALIAS,
    DEFAULT_MODELS_ROOT,
    MODELS,
    ROOT,
    Servers,
    SseStream,
    chat_body,
    ensure_model,
    loadavg,
    register_alias,
    state_env,
    text_bias,
)
from mlx_lm.utils import load_tokenizer

RANDOM_WEIGHTS = {"mid", "tiny"}  # gibberish models: see text_bias(); they never write the stop string
ALIAS_CONCURRENCY = 8  # as in issue 12's measurement: up to 8 requests share the batch
ENDINGS = ("length", "stop")
# A turn ends at its first full stop. Measured on SmolLM2 (4 users x 2 turns, greedy, EOS suppressed):
# "." came within 56 tokens in 8 of 8 answers, as text and as the token sequence ("." alone is one
# token); "3." in 1 of 8 (the model rarely keeps to a numbered list) and "\n" or "\n\n" not always as
# the token mlx_lm.server looks for. That matters: mlx_lm.server matches stop words as token
# sequences, mlxhost as text.
STOP = "."

# One team's system prompt, shared by every user (334 tokens with SmolLM2's tokenizer, 354 templated).
SYSTEM_PROMPT = """\
You are Atlas, the internal assistant of the Platform team at Northwind Freight, a logistics company that \
runs a parcel-tracking service for about two hundred warehouses. You help engineers, support staff and \
product managers with questions about our services, our tools and good engineering practice.

What you know about us:
- The tracking API is a Django application behind nginx, with PostgreSQL 16 as the main database and Redis \
for caching and Celery queues.
- Services are deployed to Kubernetes through GitLab CI; every merge to main goes to staging, and production \
releases happen on Tuesdays and Thursdays after 10:00.
- On-call rotates weekly. Incidents are declared in the #incidents channel and tracked in the incident log \
with a severity from SEV1 (customers cannot track parcels) to SEV4 (cosmetic).
- Logs go to Loki, metrics to Prometheus, and dashboards live in Grafana under the "Platform" folder.
- Secrets are stored in Vault and must never be pasted into chat, tickets or commit messages.

How to answer:
- Be accurate and practical. If you are not sure, say so and suggest who or what to check.
- Prefer concrete steps, commands and examples over general advice.
- Answer as a numbered list of three to five short points, one line each, and no closing remarks.
- Keep answers short: the people asking are usually in the middle of something.
- Never invent internal URLs, people or ticket numbers."""

QUESTIONS = [  # one conversation per user; users past the eighth reuse them (their tag differs)
    [
        "The tracking API returns 502 errors for a few minutes after every deploy. Where do I start?",
        "The readiness probe only checks that the process is up. What should it check instead?",
        "How do I test the new probe on staging before Thursday's release?",
        "What should the rollback plan look like if the probe is wrong?",
    ],
    [
        "A customer says parcel events show up two hours late. How do I find where they are delayed?",
        "The Celery queue for events has 40,000 messages waiting. What do I check first?",
        "How can I add more workers safely without overloading PostgreSQL?",
        "Which alerts should we add so we notice this before customers do?",
    ],
    [
        "I am new on the team. How should I prepare for my first on-call week?",
        "What do I do in the first ten minutes of a SEV2 incident?",
        "How do I write a good incident summary for the incident log?",
        "What should I hand over to the next person on call?",
    ],
    [
        "Our PostgreSQL disk is 85 percent full. What are the usual suspects?",
        "How do I find the largest tables and indexes?",
        "Is it safe to run VACUUM FULL on the events table during the day?",
        "How do we stop this from happening again next quarter?",
    ],
    [
        "Product wants a delivery-time estimate on the tracking page. How should we approach it?",
        "Which data do we already have that could feed a first version?",
        "How do we roll it out to a few warehouses first?",
        "How will we know whether the estimates are good enough?",
    ],
    [
        "A developer pasted an API token into a merge request comment. What do we do now?",
        "How do I rotate the token in Vault without downtime?",
        "How can we catch secrets in merge requests automatically?",
        "What should we tell the team so it does not happen again?",
    ],
    [
        "Page load on the tracking page got slower this week. How do I find out why?",
        "The slow query log shows a query on parcel_events without an index. What next?",
        "How do I add an index to a large table without locking it?",
        "How do I confirm the fix worked in Grafana?",
    ],
    [
        "We want to upgrade Django to the next LTS release. How should we plan it?",
        "Which deprecation warnings should we fix first?",
        "How do we test the upgrade against production-like data?",
        "What is a sensible order for upgrading the services?",
    ],
]


def question(user: int, index: int, tag: str) -> str:
    """User `user`'s question at turn `index` (1-based); the first ends with the run's tag.

    The tag makes every conversation new to both servers in every run, while the system prompt
    before it stays the same across runs, as a team's does. At the end, the model does not echo it.
    """
    text = QUESTIONS[user % len(QUESTIONS)][(index - 1) % len(QUESTIONS[0])]
    return f"{text} (ref {tag}-u{user})" if index == 1 else text


@dataclass
class ResponsesStream(SseStream):
    """One streamed `/v1/responses` turn: output text deltas, the response id, usage in chat's names."""

    response_id: str = ""

    def feed(self, line: str, now: float) -> None:
        if not line.startswith("data: "):
            return
        event = json.loads(line[6:])
        kind = event.get("type", "")
        if kind == "response.created":
            self.response_id = event["response"]["id"]
        elif kind == "response.output_text.delta" and event.get("delta"):
            self.times.append(now)
            self.parts.append(event["delta"])
        elif kind in ("response.failed", "error"):
            raise RuntimeError(f"{kind}: {event.get('response', event)}")
        elif kind in ("response.completed", "response.incomplete"):
            response = event["response"]
            usage = response.get("usage") or {}
            self.usage = {
                "prompt_tokens": usage.get("input_tokens", 0),
                "completion_tokens": usage.get("output_tokens", 0),
                "prompt_tokens_details": usage.get("input_tokens_details") or {},
            }
            reason = (response.get("incomplete_details") or {}).get("reason")
            self.finish = "length" if reason == "max_output_tokens" else reason or "stop"


class ChatClient:
    """One system over HTTP: U users chatting at once, each sending its turns one after another."""

    def __init__(self, url: str, headers: dict[str, str], *, api: str, args: argparse.Namespace, bias: dict):
        self.url, self.headers, self.api, self.args, self.bias = url, headers, api, args, bias
        self.model_field = {"model": ALIAS} if headers else {}  # mlx_lm.server serves its one model

    def session(
        self, tag: str, ending: str, users: int, turns: int, max_tokens: int | None = None
    ) -> Session:
        return asyncio.run(self._session(tag, ending, users, turns, max_tokens))

    async def _session(
        self, tag: str, ending: str, users: int, turns: int, max_tokens: int | None
    ) -> Session:
        limits = httpx.Limits(max_connections=users + 2)
        async with httpx.AsyncClient(
            base_url=self.url, headers=self.headers, timeout=900, limits=limits
        ) as c:
            started = time.perf_counter()
            done = await asyncio.gather(
                *(self._user(c, tag, u, ending, turns, max_tokens) for u in range(users))
            )
            return Session([t for user_turns in done for t in user_turns], started, time.perf_counter())

    async def _user(
        self, client: httpx.AsyncClient, tag: str, user: int, ending: str, turns: int, max_tokens: int | None
    ) -> list[Turn]:
        history = [{"role": "system", "content": SYSTEM_PROMPT}]
        previous: str | None = None  # Responses: the id the next turn continues
        out = []
        for index in range(1, turns + 1):
            text = question(user, index, tag)
            limit = max_tokens or (self.args.tokens if ending == "length" else self.args.stop_max_tokens)
            extra = {"stop": [STOP]} if ending == "stop" else {}
            if self.api == "chat":
                history.append({"role": "user", "content": text})
                body = chat_body(history, limit, self.bias, **self.model_field, **extra)
                turn, stream = await self._post(client, "/v1/chat/completions", body, SseStream, user, index)
                history.append({"role": "assistant", "content": "".join(stream.parts)})
            else:
                body = self._responses_body(text, previous, limit, extra)
                turn, stream = await self._post(client, "/v1/responses", body, ResponsesStream, user, index)
                previous = stream.response_id
            out.append(turn)
            if turn.error:  # the conversation cannot go on
                break
        return out

    def _responses_body(self, text: str, previous: str | None, limit: int, extra: dict) -> dict:
        body = {
            **self.model_field,
            "input": text,
            "stream": True,
            "temperature": 0,
            "max_output_tokens": limit,
            "logit_bias": {str(k): v for k, v in self.bias.items()},
            **extra,
        }
        if previous:  # the chain's instructions carry over
            body["previous_response_id"] = previous
        else:
            body["instructions"] = SYSTEM_PROMPT
        return body

    async def _post(
        self, client: httpx.AsyncClient, path: str, body: dict, kind: type, user: int, index: int
    ):
        stream = kind(started=time.perf_counter())
        turn = Turn(user=user, index=index, sent=stream.started)
        try:
            async with client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
                turn.session_cache = resp.headers.get("x-session-cache", "")
                async for line in resp.aiter_lines():
                    stream.feed(line, time.perf_counter())
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
            turn.error = f"{type(exc).__name__}: {exc}"
            return turn, stream
        turn.ended = time.perf_counter()
        turn.tokens, turn.finish = stream.tokens, stream.finish
        turn.prompt_tokens = int(stream.usage.get("prompt_tokens", 0))
        turn.cached_tokens = int((stream.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        if stream.times:
            turn.first = stream.times[0]
        else:
            turn.error = "no content"
        return turn, stream


def run_model(model: str, args: argparse.Namespace, report: ChatReport) -> None:
    """Start both servers on `model`, warm them up, then run every ending on every system, interleaved."""
    with tempfile.TemporaryDirectory(prefix="mlxhost-bench-chat-") as tmp:
        state = Path(tmp)
        env = state_env(Path(args.models_root).resolve(), state)
        folder = ensure_model(env, model)
        key = register_alias(env, folder, concurrency=ALIAS_CONCURRENCY, queue_depth=64)
        bias = text_bias(tokenizer_of(folder), random_weights=model in RANDOM_WEIGHTS)
        with Servers(folder, state, env) as servers:
            try:
                measure(model, build_systems(servers, key, args, bias), args, report)
            except BaseException:
                print(servers.logs_tail(), file=sys.stderr)
                raise


def tokenizer_of(folder: Path):
    """The folder's tokenizer with the EOS ids of its config.json (as `mlx_lm.load` sets them)."""
    eos = json.loads((folder / "config.json").read_text()).get("eos_token_id")
    return load_tokenizer(folder, eos_token_ids=eos if isinstance(eos, list) or eos is None else [eos])


def build_systems(servers: Servers, key: str, args: argparse.Namespace, bias: dict) -> dict[str, ChatClient]:
    systems = {}
    if BASELINE in args.systems:
        systems[BASELINE] = ChatClient(servers.mlx_lm_server(), {}, api="chat", args=args, bias=bias)
    if {"mlxhost", "mlxhost responses"} & set(args.systems):
        url, headers = servers.mlxhost(key), {"Authorization": f"Bearer {key}"}
        for name in ("mlxhost", "mlxhost responses"):
            if name in args.systems:
                systems[name] = ChatClient(url, headers, api=SYSTEMS[name], args=args, bias=bias)
    return systems


def measure(model: str, systems: dict[str, ChatClient], args: argparse.Namespace, report: ChatReport) -> None:
    nonce = secrets.token_hex(3)
    for name, client in systems.items():  # warm-up: first requests pay one-off costs; prompts seen once
        session = client.session(f"warm-{nonce}", "length", args.users, 1, max_tokens=8)
        errors = sorted({t.error for t in session.turns if t.error})
        print(f"  [{model}] {name} warmed up" + (f": FAILED {errors}" if errors else ""), flush=True)
    names = list(systems)
    for r in range(args.runs):
        # Interleaved: every system for one ending, then the next ending; the order rotates each
        # run, so a change in machine load hits all systems alike. Tags keep conversations new.
        order = names[r % len(names) :] + names[: r % len(names)]
        for ending in args.endings:
            for name in order:
                tag = f"{nonce}-r{r}-{ending}-{names.index(name)}"
                report.add(model, ending, name, systems[name].session(tag, ending, args.users, args.turns))
                print(f"  [{model}] run {r + 1}/{args.runs} {report.line(model, ending, name)}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", help="comma-separated: demo (SmolLM2), mid, tiny (default demo)")
    parser.add_argument("--users", type=int, help="users chatting at once (default 4)")
    parser.add_argument("--turns", type=int, help="turns per user (default 4)")
    parser.add_argument(
        "--tokens", type=int, help="max_tokens of a turn ended by length, EOS suppressed (default 48)"
    )
    parser.add_argument(
        "--stop-max-tokens",
        type=int,
        default=128,
        help=f"cap on a turn meant to end at {STOP!r} (default 128)",
    )
    parser.add_argument("--endings", default=",".join(ENDINGS), help="comma-separated: length, stop")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset to run")
    parser.add_argument("--runs", type=int, help="repeats; medians are reported (default 3)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: defaults become 2 users, 2 turns, 16 tokens, 1 run, no files",
    )
    parser.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        help="append to RESULTS.md and write the chart (default: yes, except with --quick)",
    )
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    parser.add_argument("--chart", default=str(ROOT / "docs" / "bench-chat.png"))
    parser.add_argument("--models-root", default=DEFAULT_MODELS_ROOT)
    args = parser.parse_args(argv)
    quick = {"models": "demo", "users": 2, "turns": 2, "tokens": 16, "runs": 1, "write": False}
    full = {"models": "demo", "users": 4, "turns": 4, "tokens": 48, "runs": 3, "write": True}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:  # explicit options win over the mode's defaults
            setattr(args, name, value)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.endings = [e.strip() for e in args.endings.split(",") if e.strip()]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = (
        set(args.systems) - set(SYSTEMS) | set(args.models) - set(MODELS) | set(args.endings) - set(ENDINGS)
    )
    if unknown:
        parser.error(f"unknown: {sorted(unknown)}")
    return args


def workload(args: argparse.Namespace) -> str:
    return (
        f"{args.users} users × {args.turns} turns at once, one shared system prompt, greedy, EOS suppressed with"
        f" logit_bias −100; ended by length: max_tokens {args.tokens}; ended by stop: stop {STOP!r},"
        f" max_tokens {args.stop_max_tokens}; mlxhost alias `concurrency` {ALIAS_CONCURRENCY}"
    )


def main() -> int:
    args = parse_args()
    command = "python benchmarks/bench_chat.py " + " ".join(sys.argv[1:])
    report = ChatReport(command=command.strip(), settings=workload(args), runs=args.runs)
    report.started(datetime.now(UTC), loadavg())
    for model in args.models:
        print(f"model {model}: starting mlx_lm.server and mlxhost ...", flush=True)
        run_model(model, args, report)
    report.finished(loadavg())
    text = report.markdown()
    print("\n" + text)
    if args.write:
        report.append_to(Path(args.results), text)
        print(f"appended to {args.results}")
        try:
            report.chart(Path(args.chart))
        except ImportError as exc:  # matplotlib comes with `make bench` (benchmarks/requirements.txt)
            print(f"no chart ({exc}): pip install -r benchmarks/requirements.txt", file=sys.stderr)
        else:
            print(f"chart in {args.chart}")
    failures = report.failures()
    if failures:
        print(f"FAILED: {failures} turn(s) failed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
