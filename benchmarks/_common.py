"""What the benchmark scripts share: model folders, a throwaway mlxhost state, servers, SSE timing, machine facts.

Import this module before anything imports mlx: it preloads OpenBLAS (see MLX-NOTES.md).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The package __init__ preloads OpenBLAS; it must run before the first `import mlx.core`.
from mlxhost.engine.backends.mlx import BLAS_STATUS  # noqa: E402, I001

import httpx  # noqa: E402

ALIAS = "bench"
DEMO_DTYPE = "float16" if sys.platform == "darwin" else "float32"
DEFAULT_MODELS_ROOT = os.environ.get("MODELS_ROOT", str(ROOT / "var" / "models"))
# --model -> (folder under MODELS_ROOT, how it is built: a manage.py command, or "mid" built here)
MODELS: dict[str, tuple[str, list[str]]] = {
    "demo": (f"smollm2-135m-instruct-{DEMO_DTYPE}", ["mlxhost_prepare_demo"]),
    "tiny": ("tiny-llama", ["mlxhost_build_tiny_model", "--folder", "tiny-llama"]),
    "mid": ("random-llama-52m", []),
}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of `values`; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least 1
    return ordered[int(rank) - 1]


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


def state_env(models_root: Path, state: Path) -> dict[str, str]:
    """Environment for manage.py and daphne: a throwaway SQLite DB and secret key under `state`."""
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "mlxhost.settings",
        "DATABASE_URL": f"sqlite:///{state / 'db.sqlite3'}",
        "MODELS_ROOT": str(models_root),
        "MLXHOST_VAR_DIR": str(state),
        "PYTHONUNBUFFERED": "1",
    }


def ensure_model(env: dict[str, str], model: str) -> Path:
    """The folder of `model` under MODELS_ROOT, built there when it has no config.json yet."""
    folder_name, build = MODELS[model]
    folder = Path(env["MODELS_ROOT"]) / folder_name
    if model == "mid":  # idempotent: returns at once when the same build is there
        from mlxhost.engine.backends.mlx.tiny import MID_SHAPE, build_random_llama

        return build_random_llama(folder, **MID_SHAPE)
    if not (folder / "config.json").is_file():
        print(f"building {folder} ...", flush=True)
        manage(env, "migrate", "--noinput", "-v", "0")  # the build command registers an alias too
        manage(env, *build)
    return folder


def register_alias(env: dict[str, str], folder: Path, draft: Path | None = None, **settings: object) -> str:
    """Migrate the throwaway DB, register the pinned alias `bench` on `folder`; return an API key.

    Greedy and no repetition penalty (the demo alias has 1.1, which other systems would not
    have); `settings` adds alias fields such as `concurrency` and `queue_depth`; `draft` (a
    folder under the same MODELS_ROOT) becomes the model's draft model.
    """
    manage(env, "migrate", "--noinput", "-v", "0")
    fields = {"temperature": 0.0, "repetition_penalty": None, **settings}
    with_draft = (
        f"d = services.alias_register(name='bench-draft', source_kind='local', local_path={draft.name!r})\n"
        "a.model.draft_model = d.model\n"
        "services.model_save(model=a.model)\n"
        if draft is not None
        else ""
    )
    snippet = (
        "from django.contrib.auth import get_user_model\n"
        "from models_app.catalogue import services\n"
        "user = get_user_model().objects.create_user('bench')\n"
        f"a = services.alias_register(name={ALIAS!r}, source_kind='local', local_path={folder.name!r},"
        f" pinned=True, **{fields!r})\n"
        f"{with_draft}"
        "print('KEY=' + services.apikey_create(owner=user, name='bench')[1])\n"
    )
    out = manage(env, "shell", "-c", snippet)
    return next(line[4:] for line in out.splitlines() if line.startswith("KEY="))


def render(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def start_process(cmd: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT) -> subprocess.Popen:
    with log.open("wb") as sink:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT)


def start_daphne(env: dict[str, str], log: Path, root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """daphne serving mlxhost (the checkout at `root`) on a free port, the pinned alias preloaded."""
    port = free_port()
    cmd = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "mlxhost.asgi:application"]
    return start_process(cmd, {**env, "MLXHOST_PRELOAD": "true"}, log, root), f"http://127.0.0.1:{port}"


def export_revision(rev: str, dest: Path) -> Path:
    """The tree of git revision `rev` of this checkout, written under `dest` (a before/after run)."""
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def wait_http(proc: subprocess.Popen, url: str, ready, log: Path, timeout: float = 180.0) -> None:
    """Poll until `ready(url)` is true; exit with the log's tail when the process dies or it times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[:3]} exited early:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            if ready(url):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"not ready after {timeout}s:\n{log.read_text(errors='replace')[-4000:]}")


def wait_ready(proc: subprocess.Popen, url: str, key: str, log: Path, timeout: float = 180.0) -> None:
    """Wait for /readyz 200 and our alias reported "ready" by /v1/models (the pinned preload finished)."""

    def ready(base: str) -> bool:
        if httpx.get(f"{base}/readyz", timeout=2).status_code != 200:
            return False
        models = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2)
        return any(m["id"] == ALIAS and m["state"] == "ready" for m in models.json()["data"])

    wait_http(proc, url, ready, log, timeout)


def stop_process(proc: subprocess.Popen) -> None:
    """Terminate, then kill after 15 s; always reaps the process."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class SseStream:
    """One streamed chat completion read line by line: content chunk times, text, usage, finish."""

    started: float
    times: list[float] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    usage: dict = field(default_factory=dict)
    finish: str | None = None
    ended: float = 0.0

    def feed(self, line: str, now: float) -> None:
        """Take one SSE line (comments, blank lines and `[DONE]` are skipped)."""
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices", []):
            self.finish = choice.get("finish_reason") or self.finish
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.times.append(now)
                self.parts.append(content)

    @property
    def tokens(self) -> int:
        """Completion tokens as the server counted them (content chunks when it sent no usage)."""
        return int(self.usage.get("completion_tokens", len(self.times)))

    @property
    def ttft_s(self) -> float:
        return self.times[0] - self.started if self.times else float("nan")

    @property
    def decode_tps(self) -> float:
        span = self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0
        return (self.tokens - 1) / span if span > 0 else float("nan")


def chat_body(messages: list[dict], max_tokens: int, eos_bias: dict[int, float] | None, **extra) -> dict:
    """A streamed, greedy OpenAI chat request with usage in the last chunk."""
    body = {
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
        **extra,
    }
    if eos_bias:
        body["logit_bias"] = {str(k): v for k, v in eos_bias.items()}
    return body


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    return cpu or platform.processor()


def machine() -> dict[str, str]:
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "blas": BLAS_STATUS,
    }


def machine_line(load: list[float] | tuple[float, ...]) -> str:
    """The results page's machine sentence: CPUs, versions, BLAS, and the load average start → end."""
    info = machine()
    return (
        f"Machine: `nproc` = {info['nproc']}, CPU {info['cpu']}, Python {info['python']}, mlx {info['mlx']},"
        f" mlx-lm {info['mlx_lm']}, BLAS `{info['blas']}` (mlx_lm.server gets the same library through"
        f" `LD_PRELOAD`). Load average (1 min) start → end: {load[0]} → {load[-1]}."
    )


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def text_bias(tokenizer, *, random_weights: bool) -> dict[int, float]:
    """logit_bias for every system: −100 on EOS (exactly max_tokens), and for random-weights models
    on tokens that are not text alone (stray UTF-8 bytes), which would hold back all text to the end."""
    banned = set(tokenizer.eos_token_ids)
    if random_weights:
        banned |= {i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.decode([i])}
    return {int(i): -100.0 for i in sorted(banned)}


class Servers:
    """mlx_lm.server and mlxhost (daphne) on free ports, on the same model folder; stopped on exit."""

    def __init__(
        self, folder: Path, state: Path, env: dict[str, str], server_args: tuple[str, ...] = ()
    ) -> None:
        self.folder, self.state, self.env = folder, state, env
        self.server_args = server_args  # extra mlx_lm.server flags (the same setting as mlxhost's alias)
        self.procs: list[tuple[object, Path]] = []

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc, _ in self.procs:
            stop_process(proc)

    def logs_tail(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for _, log in self.procs
        )

    def mlx_lm_server(self) -> str:
        port, log = free_port(), self.state / "mlx_lm_server.log"
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(self.folder), "--port", str(port)]
        env = {**self.env, "HF_HUB_OFFLINE": "1"}
        if BLAS_STATUS.startswith("openblas:"):  # the same OpenBLAS mlxhost preloads (MLX-NOTES.md)
            env["LD_PRELOAD"] = BLAS_STATUS.split(":", 1)[1]
        proc = start_process([*cmd, "--host", "127.0.0.1", *self.server_args], env, log)
        self.procs.append((proc, log))
        url = f"http://127.0.0.1:{port}"
        wait_http(proc, url, lambda u: httpx.get(f"{u}/health", timeout=2).status_code == 200, log)
        return url

    def mlxhost(self, key: str) -> str:
        log = self.state / "daphne.log"
        proc, url = start_daphne(self.env, log)
        self.procs.append((proc, log))
        wait_ready(proc, url, key, log)
        return url


def append_results(path: Path, text: str) -> None:
    """Append a dated section to RESULTS.md (created with its title when missing)."""
    existing = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
    path.write_text(existing.rstrip("\n") + "\n\n" + text, encoding="utf-8")


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (installed by `make bench`)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    return plt


def save_chart(fig, path: Path) -> None:
    plt = pyplot()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
