"""Single-stream benchmark: raw mlx_lm.stream_generate vs mlxhost over HTTP (SSE), and turn-5 TTFT warm vs cold."""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Preload OpenBLAS before anything imports mlx (the package __init__ does it), then mlx-lm.
from mlxhost.engine.backends.mlx import BLAS_STATUS  # noqa: E402, I001

import httpx  # noqa: E402
from mlx_lm import load, stream_generate  # noqa: E402
from mlx_lm.sample_utils import make_logits_processors, make_sampler  # noqa: E402

ALIAS = "bench"
DEMO_DTYPE = "float16" if sys.platform == "darwin" else "float32"
MODELS = {  # --model -> (folder under MODELS_ROOT, manage.py command that builds it)
    "demo": (f"smollm2-135m-instruct-{DEMO_DTYPE}", ["mlxhost_prepare_demo"]),
    "tiny": ("tiny-llama", ["mlxhost_build_tiny_model", "--folder", "tiny-llama"]),
}
SYSTEM = "You are a helpful assistant. Answer in one or two short sentences."
SHORT = [
    {"role": "system", "content": SYSTEM},
    {
        "role": "user",
        "content": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    },
]
USER_TURNS = [
    "What is the difference between a lake and a pond?",
    "Why do some lakes freeze from the top down?",
    "How do fish survive under the ice in winter?",
    "What happens to a lake when the ice melts in spring?",
    "Summarize everything we talked about in three sentences.",
]
CANNED = [  # fixed assistant replies of roughly 60 tokens each, for the "first time sent" cold turn 5
    "A lake is usually larger and deeper than a pond. In a pond, sunlight reaches the bottom almost "
    "everywhere, so plants can grow across it, while a lake has deep zones where light never reaches. "
    "Lakes often have waves and layered temperatures; ponds are shallow and warm up evenly in summer.",
    "Water is densest at about four degrees Celsius, so the coldest water floats on top. When the air "
    "cools the surface below that point, the top layer stays there and freezes first. The ice then "
    "insulates the water underneath, which is why most lakes never freeze solid to the bottom.",
    "Under the ice the water stays near four degrees, so fish slow down their bodies and need much less "
    "food and oxygen. Many rest near the bottom where it is warmest. Oxygen dissolved before the freeze, "
    "plus some from plants that still get light, is usually enough to last the winter.",
    "When the ice melts, the surface water warms to four degrees and sinks, mixing the whole lake. This "
    "spring turnover carries oxygen down to the bottom and brings nutrients up to the surface. Algae and "
    "plankton bloom, fish become active again, and the lake slowly builds layers for summer.",
]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(f"manage.py {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


def prepare_state(model: str, models_root: Path, state: Path) -> tuple[dict[str, str], Path, str]:
    """Migrate a throwaway DB, build the model folder if missing, register the alias; return env, folder, key."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "mlxhost.settings",
        "DATABASE_URL": f"sqlite:///{state / 'db.sqlite3'}",
        "MODELS_ROOT": str(models_root),
        "MLXHOST_VAR_DIR": str(state),
        "PYTHONUNBUFFERED": "1",
    }
    folder_name, build = MODELS[model]
    folder = models_root / folder_name
    manage(env, "migrate", "--noinput", "-v", "0")
    if not (folder / "config.json").is_file():
        print(f"building {folder} ...", flush=True)
        manage(env, *build)
    # Our own alias: greedy, no repetition penalty (the demo alias has 1.1), pinned so daphne preloads it.
    snippet = (
        "from django.contrib.auth import get_user_model\n"
        "from models_app import services\n"
        "user = get_user_model().objects.create_user('bench')\n"
        f"services.alias_register(name={ALIAS!r}, source_kind='local', local_path={folder_name!r},"
        " pinned=True, temperature=0.0, repetition_penalty=None)\n"
        "print('KEY=' + services.apikey_create(owner=user, name='bench')[1])\n"
    )
    out = manage(env, "shell", "-c", snippet)
    key = next(line[4:] for line in out.splitlines() if line.startswith("KEY="))
    return env, folder, key


def render(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def raw_run(model, tokenizer, prompt: list[int], n: int, eos_bias: dict[int, float]) -> dict:
    """One greedy generation of exactly n tokens (EOS banned), timed per yielded token."""
    processors = make_logits_processors(logit_bias=eos_bias)
    sampler = make_sampler(temp=0.0)
    started, times, last = time.perf_counter(), [], None
    for response in stream_generate(
        model, tokenizer, prompt, max_tokens=n, sampler=sampler, logits_processors=processors
    ):
        times.append(time.perf_counter())
        last = response
    span = times[-1] - times[0]
    return {
        "ttft_s": times[0] - started,
        "tokens": last.generation_tokens,
        "decode_tps": (len(times) - 1) / span if span > 0 else float("nan"),
        "generation_tps": last.generation_tps,
        "prompt_tokens": last.prompt_tokens,
    }


def http_chat(
    client: httpx.Client, messages: list[dict], max_tokens: int, eos_bias: dict | None, salt=None
) -> dict:
    """One streamed chat completion; times content chunks and reads usage and X-Session-Cache."""
    body = {
        "model": ALIAS,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    if eos_bias:
        body["logit_bias"] = {str(k): v for k, v in eos_bias.items()}
    if salt:
        body["cache_salt"] = salt
    started, times, parts, usage, finish = time.perf_counter(), [], [], {}, None
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text}")
        header = resp.headers.get("x-session-cache", "-")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
                if choice["delta"].get("content"):
                    times.append(time.perf_counter())
                    parts.append(choice["delta"]["content"])
    n = usage.get("completion_tokens", len(times))
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return {
        "ttft_s": times[0] - started if times else float("nan"),
        "chunks": len(times),
        "tokens": n,
        "decode_tps": (n - 1) / span if span > 0 else float("nan"),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "session_cache": header,
        "text": "".join(parts),
        "finish": finish,
    }


def start_daphne(env: dict[str, str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "mlxhost.asgi:application"]
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**env, "MLXHOST_PRELOAD": "true"}, stdout=sink, stderr=subprocess.STDOUT
        )
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, url: str, key: str, log: Path, timeout: float = 180.0) -> None:
    """Wait for /readyz 200 and our alias reported "ready" by /v1/models (the pinned preload finished)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daphne exited early:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2)
                if any(m["id"] == ALIAS and m["state"] == "ready" for m in models.json()["data"]):
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"daphne not ready after {timeout}s:\n{log.read_text(errors='replace')[-4000:]}")


def stop_daphne(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def conversation(nonce: str, replies: list[str]) -> list[dict[str, str]]:
    """System + user/assistant pairs for the given replies, then the next user turn."""
    messages = [{"role": "system", "content": f"[conversation {nonce}] {SYSTEM}"}]
    for user, reply in zip(USER_TURNS, replies, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return messages + [{"role": "user", "content": USER_TURNS[len(replies)]}]


def http_turn5(client: httpx.Client, reply_tokens: int, eos_bias: dict) -> dict[str, dict]:
    """Cold (first send, canned replies), warm (turns 1-4 as a real chat, then 5) and cold (same prompt, new salt)."""
    out = {"cold_first": http_chat(client, conversation(secrets.token_hex(4), CANNED), 16, eos_bias)}
    nonce, replies = secrets.token_hex(4), []
    finishes = []
    for _ in range(4):  # replies end naturally (EOS allowed), capped at reply_tokens
        reply = http_chat(client, conversation(nonce, replies), reply_tokens, None)
        replies.append(reply["text"])
        finishes.append(reply["finish"])
    final = conversation(nonce, replies)
    out["warm"] = {**http_chat(client, final, 16, eos_bias), "turn_finishes": finishes}
    out["cold_salt"] = http_chat(client, final, 16, eos_bias, salt=secrets.token_hex(16))
    return out


def machine() -> dict[str, str]:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")

    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu or platform.processor(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "blas": BLAS_STATUS,
    }


def report(args, raw: list[dict], http: list[dict], turns: list[dict[str, dict]], load: list[float]) -> None:
    def med(rows: list[dict], key: str) -> float:
        return median([r[key] for r in rows])

    def runs(rows: list[dict], key: str, scale: float = 1.0, fmt: str = ".1f") -> str:
        return "[" + ", ".join(f"{r[key] * scale:{fmt}}" for r in rows) + "]"

    def line(label: str, value: str) -> None:
        print(f"  {label:<42} {value}")

    raw_tps, http_tps = med(raw, "decode_tps"), med(http, "decode_tps")
    info = {**machine(), "loadavg_1m_start_end": load}
    print(f"\nmodel={args.model} tokens={args.tokens} runs={args.runs} (medians; per-run in [])")
    print("  " + json.dumps(info))
    line("raw decode tok/s (own clock)", f"{raw_tps:.1f}  {runs(raw, 'decode_tps')}")
    line("raw decode tok/s (mlx_lm generation_tps)", f"{med(raw, 'generation_tps'):.1f}")
    line("mlxhost decode tok/s (SSE chunk clock)", f"{http_tps:.1f}  {runs(http, 'decode_tps')}")
    line("ratio mlxhost/raw", f"{http_tps / raw_tps:.3f}")
    line("tokens raw / mlxhost (chunks)", f"{raw[0]['tokens']} / {http[0]['tokens']} ({http[0]['chunks']})")
    line("prompt tokens raw / mlxhost", f"{raw[0]['prompt_tokens']} / {http[0]['prompt_tokens']}")
    line("raw TTFT short prompt (ms)", f"{med(raw, 'ttft_s') * 1000:.0f}  {runs(raw, 'ttft_s', 1000, '.0f')}")
    line(
        "mlxhost TTFT short prompt (ms)",
        f"{med(http, 'ttft_s') * 1000:.0f}  {runs(http, 'ttft_s', 1000, '.0f')}",
    )
    for name, label in (
        ("cold_first", "cold, first send"),
        ("cold_salt", "cold, new cache_salt"),
        ("warm", "warm"),
    ):
        rows = [t[name] for t in turns]
        line(
            f"turn-5 TTFT {label} (ms)",
            f"{med(rows, 'ttft_s') * 1000:.0f}  {runs(rows, 'ttft_s', 1000, '.0f')}",
        )
        line(
            "  prompt / cached tokens",
            f"{[r['prompt_tokens'] for r in rows]} / {[r['cached_tokens'] for r in rows]}",
        )
        line("  X-Session-Cache", str([r["session_cache"] for r in rows]))
    line("warm chat turns 1-4 finish_reason", str([t["warm"]["turn_finishes"] for t in turns]))
    cold, warm = med([t["cold_salt"] for t in turns], "ttft_s"), med([t["warm"] for t in turns], "ttft_s")
    line("turn-5 TTFT ratio warm/cold (same prompt)", f"{warm / cold:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per decode run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--reply-tokens", type=int, default=128, help="cap on each warm-chat reply (turns 1-4)"
    )
    parser.add_argument("--models-root", default=os.environ.get("MODELS_ROOT", str(ROOT / "var" / "models")))
    args = parser.parse_args()
    load_start = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="mlxhost-bench-") as tmp:
        state = Path(tmp)
        env, folder, key = prepare_state(args.model, Path(args.models_root).resolve(), state)
        model, tokenizer = load(str(folder))
        eos_bias = {int(i): -100.0 for i in tokenizer.eos_token_ids}
        prompt = render(tokenizer, SHORT)
        log = state / "daphne.log"
        proc, url = start_daphne(env, log)
        try:
            wait_ready(proc, url, key, log)
            headers = {"Authorization": f"Bearer {key}"}
            with httpx.Client(base_url=url, headers=headers, timeout=600) as client:
                raw_run(model, tokenizer, prompt, 8, eos_bias)  # warm-ups
                http_chat(client, SHORT, 8, eos_bias)
                raw, http = [], []
                for _ in range(args.runs):  # interleaved, so a load change on the machine hits both sides
                    raw.append(raw_run(model, tokenizer, prompt, args.tokens, eos_bias))
                    # A fresh salt per run keeps the short prompt cold now that prefix reuse exists.
                    http.append(http_chat(client, SHORT, args.tokens, eos_bias, secrets.token_hex(16)))
                turns = [http_turn5(client, args.reply_tokens, eos_bias) for _ in range(args.runs)]
        except BaseException:
            print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
            raise
        finally:
            stop_daphne(proc)
    report(args, raw, http, turns, [load_start, round(os.getloadavg()[0], 2)])


if __name__ == "__main__":
    main()
