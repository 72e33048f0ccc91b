"""A stdlib HTTP server that records what coding-agent CLIs send, and the runners that point them at it.

Run as a script to refresh the fixtures in tests/fixtures/agents/ (see the README there):
    python -m tests.agents.capture [--write] [--reply REPLY]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CLI_PREFIX = ROOT / ".cache" / "agent-clis"
CLI_BIN = CLI_PREFIX / "node_modules" / ".bin"
FIXTURES = ROOT / "tests" / "fixtures" / "agents"
MODEL = "smollm2"
PROMPT = "Say hi"
SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization"}

# What the server answers to every model request, by name (status, JSON body).
REPLIES: dict[str, tuple[int, dict[str, Any]]] = {
    "anthropic_bad_request": (
        400,
        {"type": "error", "error": {"type": "invalid_request_error", "message": "capture server: stop here"}},
    ),
    "anthropic_too_long": (
        400,
        {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "prompt is too long: 20000 tokens > 8192 maximum",
            },
        },
    ),
    "openai_bad_request": (
        400,
        {
            "error": {
                "code": None,
                "message": "capture server: stop here",
                "type": "invalid_request_error",
                "param": None,
            }
        },
    ),
    "openai_too_long": (
        400,
        {
            "error": {
                "code": "context_length_exceeded",
                "message": "This model's maximum context length is 8192 tokens. "
                "However, your messages resulted in 20000 tokens. Please reduce the length of the messages.",
                "type": "invalid_request_error",
                "param": "input",
            }
        },
    ),
}


def _responses_call(namespace: str | None, name: str, arguments: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed Responses answer holding one function call (Codex reads output_item.done)."""
    call: dict[str, Any] = {
        "type": "function_call",
        "id": "fc_capture",
        "call_id": "call_capture",
        "name": name,
        "arguments": json.dumps(arguments),
        "status": "completed",
    }
    if namespace is not None:
        call["namespace"] = namespace
    response = {
        "id": "resp_capture",
        "object": "response",
        "status": "in_progress",
        "model": MODEL,
        "output": [],
    }
    usage = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}
    return [
        {"type": "response.created", "sequence_number": 0, "response": response},
        {"type": "response.output_item.added", "sequence_number": 1, "output_index": 0, "item": call},
        {"type": "response.output_item.done", "sequence_number": 2, "output_index": 0, "item": call},
        {
            "type": "response.completed",
            "sequence_number": 3,
            "response": response | {"status": "completed", "output": [call], "usage": usage},
        },
    ]


# Streamed answers, by name: the SSE events sent with status 200.
SSE_REPLIES: dict[str, list[dict[str, Any]]] = {
    "openai_namespace_call": _responses_call("multi_agent_v1", "wait_agent", {"targets": ["none"]}),
    "openai_joined_call": _responses_call(None, "multi_agent_v1__wait_agent", {"targets": ["none"]}),
    "openai_bare_call": _responses_call(None, "wait_agent", {"targets": ["none"]}),
    "openai_shell_call": _responses_call(None, "exec_command", {"cmd": "echo mlxhost-ok"}),
}


@dataclass
class Captured:
    """One request as the server saw it; auth header values are replaced by "<redacted>"."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class CaptureServer:
    """Records every request on 127.0.0.1 and answers model calls by `reply`.

    `reply` is a comma-separated list of keys of REPLIES or SSE_REPLIES: the n-th model POST gets the
    n-th, and the last one repeats. With `upstream` ("http://127.0.0.1:PORT") it is a recording
    proxy instead: every request goes on to that server and its answer, streamed, comes back.
    """

    reply: str = ""
    upstream: str | None = None
    requests: list[Captured] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _served: int = 0

    def next_reply(self) -> str:
        names = self.reply.split(",")
        name = names[min(self._served, len(names) - 1)]
        self._served += 1
        return name

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.server_address[1]

    def __enter__(self) -> CaptureServer:
        capture = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body: Any = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode("utf-8", "replace")
                headers = {
                    k.lower(): ("<redacted>" if k.lower() in SECRET_HEADERS else v)
                    for k, v in self.headers.items()
                }
                capture.requests.append(Captured(self.command, self.path, headers, body))
                if capture.upstream is not None:
                    self._forward(capture.upstream, raw)
                    return
                if self.command != "POST":
                    status, payload = 404, {"error": "not found"}
                else:
                    name = capture.next_reply()
                    if name in SSE_REPLIES:
                        self._stream(SSE_REPLIES[name])
                        return
                    status, payload = REPLIES[name]
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _forward(self, upstream: str, raw: bytes) -> None:
                host, _, port = upstream.removeprefix("http://").partition(":")
                conn = http.client.HTTPConnection(host, int(port or 80), timeout=300)
                skip = {"host", "connection", "content-length", "transfer-encoding", "accept-encoding"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                conn.request(self.command, self.path, body=raw or None, headers=headers)
                answer = conn.getresponse()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in skip:
                        self.send_header(key, value)
                self.end_headers()  # HTTP/1.0: the body ends when the connection closes
                while chunk := answer.read1(65536):
                    self.wfile.write(chunk)
                    self.wfile.flush()
                conn.close()

            def _stream(self, events: list[dict[str, Any]]) -> None:
                data = b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()


@dataclass
class CliRun:
    """One CLI invocation against a capture server."""

    cli: str
    version: str
    returncode: int | None
    output: str
    requests: list[Captured]

    def model_requests(self) -> list[Captured]:
        """The POSTs to the model endpoints, in arrival order."""
        return [
            r for r in self.requests if r.method == "POST" and re.match(r"/v1/(messages|responses)", r.path)
        ]


def offline_env(home: Path) -> dict[str, str]:
    """A minimal environment: a throwaway HOME and every telemetry or updater switch off."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "TMPDIR": str(home),
        "LANG": "C.UTF-8",
        "NO_COLOR": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CODEX_DISABLE_TELEMETRY": "1",
    }


def cli_version(cli: str) -> str:
    out = subprocess.run([str(CLI_BIN / cli), "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def _run(cli: str, argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> tuple[int | None, str]:
    try:
        done = subprocess.run(
            argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"") + (exc.stderr or b"")
        return None, out.decode("utf-8", "replace") if isinstance(out, bytes) else str(out)
    return done.returncode, done.stdout + done.stderr


@dataclass(frozen=True)
class Target:
    """Where a CLI run sends its requests: the capture server's canned `reply`, or a real server
    at `upstream` behind the recording proxy, as `model` with `api_key`."""

    reply: str = ""
    upstream: str | None = None
    model: str = MODEL
    api_key: str = "x"
    prompt: str = PROMPT


def run_claude(
    reply: str = "anthropic_bad_request",
    timeout: float = 120,
    *,
    target: Target | None = None,
    args: tuple[str, ...] = (),
) -> CliRun:
    """`claude -p PROMPT --model MODEL [args]` against a capture server answering `reply`, or the
    target's server behind the recording proxy."""
    target = target or Target(reply=reply)
    with (
        tempfile.TemporaryDirectory(prefix="agent-home-") as tmp,
        CaptureServer(target.reply, target.upstream) as server,
    ):
        home = Path(tmp)
        env = offline_env(home) | {
            "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{server.port}",
            "ANTHROPIC_API_KEY": target.api_key,
        }
        work = home / "work"
        work.mkdir()
        argv = [str(CLI_BIN / "claude"), "-p", target.prompt, "--model", target.model, *args]
        code, output = _run("claude", argv, env, work, timeout)
        return CliRun("claude", cli_version("claude"), code, output, list(server.requests))


def codex_config(port: int, model: str = MODEL) -> str:
    """The config.toml a user writes to point Codex at mlxhost."""
    return (
        f'model = "{model}"\n'
        'model_provider = "mlxhost"\n\n'
        "[model_providers.mlxhost]\n"
        'name = "mlxhost"\n'
        f'base_url = "http://127.0.0.1:{port}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "MLXHOST_API_KEY"\n'
    )


def run_codex(
    reply: str = "openai_bad_request",
    timeout: float = 120,
    *,
    target: Target | None = None,
    args: tuple[str, ...] = (),
) -> CliRun:
    """`codex exec --skip-git-repo-check [args] PROMPT` against a capture server answering `reply`,
    or the target's server behind the recording proxy."""
    target = target or Target(reply=reply)
    with (
        tempfile.TemporaryDirectory(prefix="agent-home-") as tmp,
        CaptureServer(target.reply, target.upstream) as server,
    ):
        home = Path(tmp)
        codex_home = home / ".codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(codex_config(server.port, target.model))
        env = offline_env(home) | {"CODEX_HOME": str(codex_home), "MLXHOST_API_KEY": target.api_key}
        work = home / "work"
        work.mkdir()
        argv = [str(CLI_BIN / "codex"), "exec", "--skip-git-repo-check", *args, target.prompt]
        code, output = _run("codex", argv, env, work, timeout)
        return CliRun("codex", cli_version("codex"), code, output, list(server.requests))


def install_clis() -> None:
    """Install both CLIs into .cache/agent-clis (a no-op when present)."""
    subprocess.run(["bash", str(ROOT / "scripts" / "agent_clis.sh")], check=True, timeout=600)


def fixture_from(run: CliRun) -> dict[str, Any]:
    """The first model request of `run`, as stored in tests/fixtures/agents/."""
    first = run.model_requests()[0]
    path, _, query = first.path.partition("?")
    return {
        "cli": run.cli,
        "version": run.version,
        "method": first.method,
        "path": path,
        "query": query,
        "anthropic_beta": first.headers.get("anthropic-beta"),
        "headers": redact(first.headers),
        "body": redact(first.body),
    }


_REDACTIONS = [
    (re.compile(r"/tmp/agent-home-[A-Za-z0-9_]+"), "/home/user"),
    (re.compile(r"-tmp-agent-home-[A-Za-z0-9_]+"), "-home-user"),
    (re.compile(r"127\.0\.0\.1:[0-9]+"), "127.0.0.1:PORT"),
    (re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])"), "<sha256>"),
    (
        re.compile(r"(?<![0-9a-f])[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}(?![0-9a-f])"),
        "<uuid>",
    ),
]


def redact(value: Any) -> Any:
    """Replace temp paths, hashes and uuids in strings, recursively, with placeholders."""
    if isinstance(value, str):
        for pattern, placeholder in _REDACTIONS:
            value = pattern.sub(placeholder, value)
        return value
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="write the first-request fixtures")
    parser.add_argument("--cli", choices=["claude", "codex"], action="append")
    parser.add_argument("--reply", help="override the reply (a key of REPLIES)")
    parser.add_argument("--dump", type=Path, help="write every captured request and the output here")
    args = parser.parse_args()
    install_clis()
    for cli in args.cli or ["claude", "codex"]:
        runner = run_claude if cli == "claude" else run_codex
        run = runner(args.reply) if args.reply else runner()
        lines = [f"== {cli} {run.version} rc={run.returncode}"] + [
            f"   {r.method} {r.path}" for r in run.requests
        ]
        sys.stdout.write("\n".join([*lines, run.output[-3000:], ""]))
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            dump = {
                "rc": run.returncode,
                "output": run.output,
                "requests": [r.__dict__ for r in run.requests],
            }
            (args.dump / f"{cli}-{args.reply or 'default'}.json").write_text(json.dumps(dump, indent=2))
        if args.write and run.model_requests():
            FIXTURES.mkdir(parents=True, exist_ok=True)
            name = "claude_code" if cli == "claude" else "codex"
            text = json.dumps(fixture_from(run), indent=2, ensure_ascii=False) + "\n"
            (FIXTURES / f"{name}_first_request.json").write_text(text)


if __name__ == "__main__":
    main()
