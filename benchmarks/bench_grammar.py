"""Grammar engines for constrained decoding (issue 13): llguidance vs xgrammar vs outlines-core.

All three on the demo model's tokenizer (SmolLM2-135M, vocab 49,152), each engine in a process of
its own (spawned; killed when a task runs past its timeout, so a hang or a crash is a finding, not
the end of the run):

- tokenizer setup, once per model;
- compile time of four JSON schemas (any object, a tool call, a ~20-property record, 10 tools as
  `anyOf`), and the cached path (what a second request with the same schema pays);
- mask time per token while walking a valid output token by token (fill the mask, check that the
  next token is allowed, consume it), and 8 matchers at once (serial, and the engine's parallel
  helper where it has one);
- which JSON-schema features each engine enforces, ignores or refuses (a valid and an invalid
  instance walked through each), and what a schema it cannot compile gives;
- applying a bitmask to MLX logits on CPU (the engines' own MLX helpers are Metal kernels);
- a decode step of the demo model at batch 8, plain and with llguidance masks, so the issue's
  "grammar adds at most 10 % at batch 8" budget is measured, not guessed.

An engine that is not installed is skipped. xgrammar is not in the dev requirements (it pulls
torch and CUDA wheels: see RESULTS.md), so the full comparison runs from a separate venv:

    python3 -m venv /tmp/gvenv && /tmp/gvenv/bin/pip install llguidance outlines-core xgrammar \\
        transformers numpy httpx 'mlx[cpu]==0.32.4' mlx-lm==0.32.2
    /tmp/gvenv/bin/python benchmarks/bench_grammar.py [--walks 3] [--steps 40] [--write]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import statistics
import sys
import time
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, cast

from _common import DEFAULT_MODELS_ROOT, MODELS, ROOT, append_results, loadavg, machine_line, percentile

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
ENGINES = ("llguidance", "xgrammar", "outlines-core")

# ---------------------------------------------------------------------------------------------
# Schemas and valid instances
# ---------------------------------------------------------------------------------------------

TOOL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "search_web", "convert_units"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "days", "metric"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


S, INT, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
MEDIUM = _obj(
    {
        "id": INT,
        "name": S,
        "email": S,
        "age": INT,
        "active": B,
        "role": {"enum": ["admin", "editor", "viewer", "guest", "owner"]},
        "tags": {"type": "array", "items": S},
        "address": _obj({"street": S, "city": S, "zip": S, "country": {"enum": ["FR", "DE", "US", "JP"]}}),
        "phones": {
            "type": "array",
            "items": _obj({"kind": {"enum": ["home", "work", "mobile"]}, "number": S}),
        },
        "scores": {"type": "array", "items": N},
        "created": S,
        "notes": {"type": ["string", "null"]},
        "manager": _obj({"id": INT, "name": S}),
        "preferences": _obj({"theme": {"enum": ["light", "dark"]}, "notifications": B, "language": S}),
        "rating": N,
        "level": INT,
        "status": {"enum": ["active", "suspended", "deleted"]},
        "projects": {"type": "array", "items": _obj({"name": S, "hours": N})},
        "department": S,
        "remote": B,
    }
)
TOOL_ARGS: list[dict[str, Any]] = [
    {"city": S, "days": INT, "metric": B},
    {"query": S, "max_results": INT},
    {"value": N, "from_unit": S, "to_unit": S},
    {"to": S, "subject": S, "body": S},
    {"path": S, "line": INT, "recursive": B},
    {"symbol": S, "currency": {"enum": ["USD", "EUR", "JPY"]}},
    {"title": S, "due": S, "priority": {"enum": ["low", "high"]}, "done": B},
    {"lat": N, "lon": N, "radius_km": N},
    {"expression": S},
    {"ids": {"type": "array", "items": INT}, "dry_run": B},
]


def _tool(i: int, args: dict[str, Any]) -> dict[str, Any]:
    props: dict[str, Any] = {"name": {"const": f"tool_{i}"}, "arguments": _obj(args)}
    return _obj(props)


LARGE = {"anyOf": [_tool(i, args) for i, args in enumerate(TOOL_ARGS)]}
SCHEMAS: dict[str, dict[str, Any]] = {
    "json_object": {"type": "object"},
    "tool": TOOL,
    "medium": MEDIUM,
    "large": LARGE,
}
SCHEMA_LABEL = {
    "json_object": 'json_object (`{"type": "object"}`)',
    "tool": "tool call (enum name + 3 typed args)",
    "medium": "medium (20 props, nested)",
    "large": "large (10 tools as anyOf)",
}


def instance(name: str, k: int = 0) -> Any:
    """A valid instance of SCHEMAS[name]; `k` varies the values (8 different outputs for the batch)."""
    if name == "json_object":
        return {
            "answer": f"Paris {k}",
            "confidence": 0.92,
            "sources": ["wiki", "atlas"],
            "meta": {"lang": "en"},
        }
    if name == "tool":
        return {
            "name": "get_weather",
            "arguments": {"city": ["Paris", "Tokyo", "Lima"][k % 3], "days": 3 + k, "metric": k % 2 == 0},
        }
    if name == "medium":
        return {
            "id": 1042 + k, "name": "Ada Lovelace", "email": f"ada{k}@example.com", "age": 36, "active": True,
            "role": "editor", "tags": ["math", "engines"],
            "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH", "country": "FR"},
            "phones": [{"kind": "home", "number": "+44 20 7946 0000"}], "scores": [9.5, 7.25],
            "created": "1843-09-01", "notes": None, "manager": {"id": 7, "name": "Charles Babbage"},
            "preferences": {"theme": "dark", "notifications": False, "language": "en"}, "rating": 4.8,
            "level": 3 + k, "status": "active", "projects": [{"name": "Analytical Engine", "hours": 1200.5}],
            "department": "Research", "remote": False,
        }  # fmt: skip
    if name == "large":
        return {
            "name": "tool_6",
            "arguments": {
                "title": f"Write notes {k}",
                "due": "2026-12-24",
                "priority": "high",
                "done": False,
            },
        }
    raise KeyError(name)


# Feature probes: (schema, a valid instance, an invalid one). "yes" = valid walks through and the
# invalid one is refused by the mask; "ignored" = compiles but lets the invalid one through.
REC = {
    "$defs": {"node": _obj({"v": INT, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}})},
    "$ref": "#/$defs/node",
}
PROBES: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "pattern": ({"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"}, "abc-12", "abc-1x"),
    "format: date-time": ({"type": "string", "format": "date-time"}, "2026-01-02T03:04:05Z", "yesterday"),
    "format: email": ({"type": "string", "format": "email"}, "ada@example.com", "not an email"),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcdef"),
    "minimum/maximum": ({"type": "integer", "minimum": 1, "maximum": 10}, 5, 11),
    "exclusiveMinimum (number)": ({"type": "number", "exclusiveMinimum": 0}, 0.5, -1),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 15, 7),
    "minItems/maxItems": ({"type": "array", "items": INT, "minItems": 2, "maxItems": 3}, [1, 2], [1]),
    "uniqueItems": ({"type": "array", "items": INT, "uniqueItems": True}, [1, 2], [1, 1]),
    "$ref/$defs": (
        {"$defs": {"p": _obj({"x": INT})}, **_obj({"a": {"$ref": "#/$defs/p"}})},
        {"a": {"x": 1}},
        {"a": {"x": "s"}},
    ),
    "recursive $ref": (
        REC,
        {"v": 1, "children": [{"v": 2, "children": [{"v": 3, "children": []}]}]},
        {"v": 1},
    ),
    "oneOf": ({"oneOf": [INT, S]}, "x", True),
    "anyOf": ({"anyOf": [INT, {"type": "null"}]}, None, "x"),
    "allOf": (
        {
            "allOf": [
                {"type": "object", "properties": {"a": INT}, "required": ["a"]},
                {"required": ["b"], "properties": {"b": S}},
            ]
        },
        {"a": 1, "b": "x"},
        {"a": 1},
    ),
    "const/enum (mixed)": ({"enum": ["a", 1, None]}, None, "b"),
    "additionalProperties unset (extras allowed by spec)": (
        {"type": "object", "properties": {"a": INT}, "required": ["a"]},
        {"a": 1, "zz": 2},
        {"zz": 2},
    ),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x_": INT}, "additionalProperties": False},
        {"x_a": 1},
        {"y": 1},
    ),
    "not": ({"not": {"type": "string"}}, 1, "x"),
    "if/then/else": ({"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}}, 3, -3),
    "prefixItems": ({"type": "array", "prefixItems": [S, INT], "items": False}, ["a", 1], [1, "a"]),
}
# Schemas an engine should refuse (or handle) cleanly: an error, not a hang or a crash.
BAD: dict[str, Any] = {
    "unknown type": {"type": "strnig"},
    "dangling $ref": {"$ref": "#/$defs/missing"},
    "invalid regex": {"type": "string", "pattern": "(unclosed"},
    "unsatisfiable (min > max)": {"type": "integer", "minimum": 10, "maximum": 1},
    "regex DFA blow-up (a|b)*a(a|b){24}": {"type": "string", "pattern": "^(a|b)*a(a|b){24}$"},
    "deep nesting (60 levels)": json.loads(
        '{"type":"object","properties":{"a":' * 60 + '{"type":"integer"}' + "}}" * 60
    ),
    "huge enum (20k strings)": {"enum": [f"value_{i}" for i in range(20000)]},
    "schema is a list": [1, 2],
}


# ---------------------------------------------------------------------------------------------
# Engines: one small adapter each, all writing into the same int32 bitmask rows
# ---------------------------------------------------------------------------------------------


class Llguidance:
    def setup(self, hf_tok: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: Any) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def cached(self, compiled: Any) -> Any:
        return compiled.deep_copy()  # llguidance has no compiler cache: keep a matcher, copy it

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, m: Any, bitmask: Any, i: int) -> None:
        row = bitmask[i]
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def consume(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token))

    def fill_batch(self, ms: list[Any], bitmask: Any) -> None:
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(ms)], bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0]
        )


class Xgrammar:
    def setup(self, hf_tok: Any, vocab: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=2, cache_enabled=True)
        self.batch: Any = (
            xgrammar.BatchGrammarMatcher(max_threads=2) if hasattr(xgrammar, "BatchGrammarMatcher") else None
        )

    def compile(self, schema: Any) -> Any:
        self.compiler.clear_cache()
        return self.compiler.compile_json_schema(json.dumps(schema))

    def cached(self, compiled: Any) -> Any:
        return compiled  # measured separately: compile_json_schema again hits the compiler's cache

    def recompile(self, schema: Any) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: Any, i: int) -> None:
        m.fill_next_token_bitmask(self._view(bitmask), i)

    def _view(self, bitmask: Any) -> Any:
        import torch

        return torch.from_numpy(bitmask)  # shares memory; xgrammar wants a DLPack tensor

    def consume(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def fill_batch(self, ms: list[Any], bitmask: Any) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, self._view(bitmask))


class OutlinesCore:
    def setup(self, hf_tok: Any, vocab: int) -> None:
        import outlines_core
        from outlines_core import json_schema

        self.oc, self.js = outlines_core, json_schema
        # Vocabulary.from_pretrained needs the hub; build it from the tokenizer: byte-level BPE
        # token strings back to bytes, special tokens left out (EOS is passed separately).
        byte_decoder = _byte_decoder()
        special = set(hf_tok.all_special_ids)
        tokens: dict[bytes, list[int]] = {}
        for text, tid in hf_tok.get_vocab().items():
            if tid in special or tid >= vocab:
                continue
            tokens.setdefault(bytes(byte_decoder[c] for c in text), []).append(tid)
        self.eos = hf_tok.eos_token_id
        self.vocab = outlines_core.Vocabulary(self.eos, tokens)

    def compile(self, schema: Any) -> Any:
        regex = self.js.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocab)

    def cached(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)  # the Index is the compiled form; a Guide per request

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, m: Any, bitmask: Any, i: int) -> None:
        row = bitmask[i]
        m.write_mask_into(row.ctypes.data, row.size, 4)

    def consume(self, m: Any, token: int) -> bool:
        if token == self.eos and m.is_finished():
            return True  # the mask allows EOS in a final state, but advance(EOS) raises: the caller stops
        try:
            m.advance(token, return_tokens=False)
        except Exception:
            return False
        return True

    fill_batch = None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


ADAPTERS: dict[str, type[Any]] = {
    "llguidance": Llguidance,
    "xgrammar": Xgrammar,
    "outlines-core": OutlinesCore,
}
PACKAGES = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}


# ---------------------------------------------------------------------------------------------
# The worker: one engine, a list of tasks, one result per task on the queue
# ---------------------------------------------------------------------------------------------


def _allowed(row: Any, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _walk(engine: Any, m: Any, tokens: list[int], bitmask: Any) -> tuple[str, list[float], list[float]]:
    """Fill, check, consume each token; ("ok" | "refused at i/n", mask seconds, consume seconds)."""
    masks: list[float] = []
    consumes: list[float] = []
    for i, token in enumerate(tokens):
        t0 = time.perf_counter()
        engine.fill(m, bitmask, 0)
        t1 = time.perf_counter()
        masks.append(t1 - t0)
        if not _allowed(bitmask[0], token):
            return f"refused at {i}/{len(tokens)}", masks, consumes
        t1 = time.perf_counter()
        ok = engine.consume(m, token)
        consumes.append(time.perf_counter() - t1)
        if not ok:
            return f"consume failed at {i}/{len(tokens)}", masks, consumes
    return "ok", masks, consumes


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:160]}"


def worker(name: str, folder: str, tasks: list[tuple[str, str]], walks: int, out: Any) -> None:
    import numpy as np
    from mlx_lm.utils import load_tokenizer

    wrapper = load_tokenizer(Path(folder))  # type: ignore[no-untyped-call]
    hf_tok = wrapper._tokenizer  # mlx-lm's TokenizerWrapper around the HF fast tokenizer
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    eos = hf_tok.eos_token_id
    engine = ADAPTERS[name]()
    t = time.perf_counter()
    engine.setup(hf_tok, vocab)
    out.put(("setup", {"setup_s": time.perf_counter() - t}))
    width = (vocab + 31) // 32

    def encode(value: Any) -> list[int]:
        return [*hf_tok.encode(json.dumps(value), add_special_tokens=False), eos]

    for kind, key in tasks:
        try:
            if kind == "schema":
                out.put(
                    (
                        (kind, key),
                        _schema_task(
                            engine,
                            SCHEMAS[key],
                            encode(instance(key)),
                            walks,
                            np.full((1, width), -1, np.int32),
                        ),
                    )
                )
            elif kind == "batch":
                out.put(((kind, key), _batch_task(engine, key, encode, np.full((8, width), -1, np.int32))))
            elif kind == "probe":
                schema, good, bad = PROBES[key]
                out.put(
                    (
                        (kind, key),
                        _probe_task(
                            engine, schema, encode(good), encode(bad), np.full((1, width), -1, np.int32)
                        ),
                    )
                )
            elif kind == "bad":
                try:
                    engine.compile(BAD[key])
                    out.put(((kind, key), {"status": "compiled (no error)"}))
                except Exception as exc:
                    out.put(((kind, key), {"status": "error", "message": _short(exc)}))
        except Exception as exc:
            out.put(((kind, key), {"error": _short(exc)}))


def _schema_task(engine: Any, schema: Any, tokens: list[int], walks: int, bitmask: Any) -> dict[str, Any]:
    compiles = []
    for _ in range(3):
        t = time.perf_counter()
        compiled = engine.compile(schema)
        compiles.append(time.perf_counter() - t)
        if compiles[0] > 5:  # a slow compiler is timed once
            break
    t = time.perf_counter()
    if hasattr(engine, "recompile"):
        engine.recompile(schema)  # warms the cache
        t = time.perf_counter()
        engine.recompile(schema)
    else:
        engine.cached(compiled)
    cached_s = time.perf_counter() - t
    statuses: list[str] = []
    first_masks: list[float] = []
    masks: list[float] = []
    consumes: list[float] = []
    for w in range(walks):
        m = engine.matcher(compiled)
        status, mk, cs = _walk(engine, m, tokens, bitmask)
        statuses.append(status)
        first_masks.append(mk[0])
        (masks if w else []).extend(mk[1:])  # the first walk warms lazily built state: kept out
        consumes.extend(cs)
        if w == 0:
            first_walk_mean = statistics.mean(mk)
    return {
        "compile_s": statistics.median(compiles),
        "cached_s": cached_s,
        "tokens": len(tokens),
        "walk": sorted(set(statuses)),
        "first_mask_s": first_masks[0],
        "first_walk_mean_s": first_walk_mean,
        "mask_mean_s": statistics.mean(masks) if masks else float("nan"),
        "mask_p95_s": percentile(masks, 95),
        "mask_max_s": max(masks, default=float("nan")),
        "consume_mean_s": statistics.mean(consumes) if consumes else float("nan"),
    }


def _batch_task(engine: Any, key: str, encode: Any, bitmask: Any) -> dict[str, Any]:
    compiled = engine.compile(SCHEMAS[key])
    seqs = [encode(instance(key, k)) for k in range(8)]
    steps = min(len(s) for s in seqs)
    result: dict[str, Any] = {"steps": steps}
    modes = ["serial"] + (["parallel"] if engine.fill_batch else [])
    for mode in modes:
        for _rep in range(2):  # the first warms lazily built state
            ms = [engine.matcher(compiled) for _ in range(8)]
            per_step = []
            for step in range(steps):
                t = time.perf_counter()
                if mode == "serial":
                    for i, m in enumerate(ms):
                        engine.fill(m, bitmask, i)
                else:
                    engine.fill_batch(ms, bitmask)
                per_step.append(time.perf_counter() - t)
                for i, m in enumerate(ms):
                    if not _allowed(bitmask[i], seqs[i][step]) or not engine.consume(m, seqs[i][step]):
                        raise RuntimeError(f"batch walk refused token {step} of sequence {i} ({mode})")
        result[f"{mode}_mean_s"] = statistics.mean(per_step)
        result[f"{mode}_p95_s"] = percentile(per_step, 95)
    return result


def _probe_task(engine: Any, schema: Any, good: list[int], bad: list[int], bitmask: Any) -> dict[str, Any]:
    try:
        compiled = engine.compile(schema)
    except Exception as exc:
        return {"status": "refused", "message": _short(exc)}
    good_status = _walk(engine, engine.matcher(compiled), good, bitmask)[0]
    bad_status = _walk(engine, engine.matcher(compiled), bad, bitmask)[0]
    if good_status != "ok":
        return {"status": "rejects valid", "message": good_status}
    return {"status": "ignored" if bad_status == "ok" else "yes"}


def run_engine(ctx: Any, name: str, folder: str, tasks: list[tuple[str, str]], walks: int) -> dict[Any, Any]:
    """Run `tasks` in a child; a task past its timeout or a dead child is recorded and the child restarted."""
    results: dict[Any, Any] = {}
    remaining = list(tasks)
    while remaining:
        out = ctx.Queue()
        proc = ctx.Process(target=worker, args=(name, folder, remaining, walks, out), daemon=True)
        proc.start()
        expect: list[Any] = ["setup", *remaining]
        while expect:
            key = expect[0]
            limit = {"setup": 300, "schema": 180, "batch": 180}.get(key if key == "setup" else key[0], 30)
            started = time.monotonic()
            msg = None
            while msg is None and time.monotonic() - started < limit:
                try:
                    msg = out.get(timeout=0.5)
                except queue.Empty:
                    if not proc.is_alive() and out.empty():
                        break
            if msg is None:
                alive = proc.is_alive()
                if alive:
                    proc.kill()
                proc.join()
                outcome = f"timeout (> {limit} s, killed)" if alive else f"crashed (exit {proc.exitcode})"
                print(f"  {name} {key}: {outcome}", flush=True)
                if key == "setup":
                    return {"setup": {"error": outcome}}
                results[key] = {"status": outcome}
                remaining.remove(key)
                break
            got, value = msg
            if got == "setup" and "setup" in results:
                expect.pop(0)
                continue
            results[got] = value
            print(f"  {name} {got}: {value}", flush=True)
            expect.pop(0)
            if got != "setup":
                remaining.remove(got)
        else:
            proc.join(timeout=10)
    return results


# ---------------------------------------------------------------------------------------------
# MLX side: applying a bitmask, and a decode step at batch 8 with and without masks
# ---------------------------------------------------------------------------------------------


def _timeit(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def mask_apply(vocab: int) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    width = (vocab + 31) // 32
    shifts = mx.arange(32, dtype=mx.int32)
    res: dict[Any, Any] = {}
    for batch in (1, 8):
        bitmask = rng.integers(-(2**31), 2**31 - 1, size=(batch, width), dtype=np.int32)
        logits = mx.random.normal((batch, vocab))
        mx.eval(logits)

        def unpack_numpy(bitmask: Any = bitmask, logits: Any = logits) -> None:
            bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
            mx.eval(mx.where(mx.array(bits.astype(np.bool_)), logits, -mx.inf))

        def bits_in_mlx(bitmask: Any = bitmask, logits: Any = logits, batch: int = batch) -> None:
            m = mx.array(bitmask)
            bits = ((m[:, :, None] >> shifts) & 1).reshape(batch, -1)[:, :vocab]
            mx.eval(mx.where(bits.astype(mx.bool_), logits, -mx.inf))

        def numpy_inplace(bitmask: Any = bitmask, logits: Any = logits) -> None:
            from llguidance.numpy import apply_token_bitmask_inplace

            arr = np.array(logits)
            apply_token_bitmask_inplace(arr, bitmask)
            mx.eval(mx.array(arr))

        for label, fn in (
            ("np.unpackbits → mx.where", unpack_numpy),
            ("bit ops in MLX → mx.where", bits_in_mlx),
            ("llguidance.numpy in place (copy out and back)", numpy_inplace),
        ):
            try:
                res[(label, batch)] = _timeit(fn, 50)
            except Exception as exc:
                res[(label, batch)] = _short(exc)
        for label, mod in (
            ("llguidance.mlx.apply_token_bitmask", "llguidance.mlx"),
            ("outlines_core.kernels.mlx.apply_token_bitmask", "outlines_core.kernels.mlx"),
        ):
            try:
                fn = __import__(mod, fromlist=["apply_token_bitmask"]).apply_token_bitmask
                res[(label, batch)] = _timeit(lambda fn=fn, lg=logits, bm=bitmask: mx.eval(fn(lg, bm)), 20)
            except Exception as exc:
                res[(label, batch)] = _short(exc)
    return res


def decode_steps(folder: str, steps: int, rounds: int) -> dict[str, Any]:
    """Median decode step at batch 8 of the demo model: plain, and with 8 llguidance tool-call matchers."""
    import llguidance
    import llguidance.hf
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load(folder)[:2]
    vocab = model.args.vocab_size
    width = (vocab + 31) // 32
    shifts = mx.arange(32, dtype=mx.int32)
    cities = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul"]
    prompts = [
        tokenizer.apply_chat_template(  # type: ignore[no-untyped-call]
            [{"role": "user", "content": f"Call get_weather as JSON for {c} over {k + 2} days."}],
            add_generation_prompt=True,
        )
        for k, c in enumerate(cities)
    ]
    length = min(len(p) for p in prompts)
    prompts = [p[-length:] for p in prompts]
    res: dict[str, Any] = {"prompt_tokens": length, "steps": steps}

    # mlx-lm's BatchGenerator, as the server runs it: the step time of next() once all are decoding.
    gen = BatchGenerator(model, max_tokens=steps + 8, stop_tokens=[[-1]])
    gen.insert(prompts)
    times = []
    for _ in range(steps + 4):
        t = time.perf_counter()
        gen.next()  # type: ignore[no-untyped-call]
        times.append(time.perf_counter() - t)
    gen.close()  # type: ignore[no-untyped-call]
    res["BatchGenerator.next()"] = statistics.median(times[4:])

    lltok = llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=vocab)
    proto = llguidance.LLMatcher(
        lltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(TOOL)), log_level=0
    )
    executor = llguidance.LLExecutor()
    bitmask = np.full((8, width), -1, np.int32)

    def loop(mode: str) -> tuple[float, float, float]:
        cache = make_prompt_cache(model)
        logits = model(mx.array(prompts), cache=cache)[:, -1, :]
        mx.eval(logits)
        ms = [proto.deep_copy() for _ in range(8)]
        step_times, cpu_times, grammar_times = [], [], []
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            g = 0.0
            if mode != "plain":
                tg = time.perf_counter()
                if mode == "serial":
                    for i, m in enumerate(ms):
                        m.unsafe_compute_mask_ptr(bitmask[i].ctypes.data, width * 4)
                else:
                    executor.unsafe_compute_mask_ptr(
                        [(m, i) for i, m in enumerate(ms)], bitmask.ctypes.data, width * 4, 8
                    )
                bits = ((mx.array(bitmask)[:, :, None] >> shifts) & 1).reshape(8, -1)[:, :vocab]
                logits = mx.where(bits.astype(mx.bool_), logits, -mx.inf)
                g = time.perf_counter() - tg
            y = mx.argmax(logits, axis=-1)
            logits = model(y[:, None], cache=cache)[:, -1, :]
            mx.async_eval(logits)  # type: ignore[no-untyped-call]
            tokens = cast("list[int]", y.tolist())
            if mode != "plain":
                tg = time.perf_counter()
                for m, tok in zip(ms, tokens, strict=True):
                    if not m.is_stopped():
                        m.consume_token(tok)
                g += time.perf_counter() - tg
            mx.eval(logits)
            step_times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
            grammar_times.append(g)
        return (
            statistics.median(step_times[2:]),
            statistics.median(cpu_times[2:]),
            statistics.mean(grammar_times[2:]),
        )

    for _ in range(rounds):  # interleaved, so a change in machine load hits every mode
        for mode in ("plain", "serial", "parallel"):
            res.setdefault(mode, []).append(loop(mode))
            print(f"  decode {mode}: {res[mode][-1]}", flush=True)
    return res


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def ms(value: Any, digits: int = 2) -> str:
    return f"{value * 1000:.{digits}f}" if isinstance(value, float) else str(value)


def report(
    args: Any,
    load: list[float],
    engines: list[str],
    res: dict[str, Any],
    apply: dict[Any, Any],
    decode: dict[str, Any] | None,
) -> str:
    versions = ", ".join(f"{e} {_version(e)}" for e in engines)
    lines = [
        f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC — Grammar engines (issue 13)\n",
        f"Command: `{Path(sys.executable).parent.parent}/bin/python benchmarks/bench_grammar.py --walks {args.walks} --steps {args.steps} --rounds {args.rounds}`"
        f" (tokenizer of the demo model SmolLM2-135M-Instruct, vocab 49,152; {versions}; each engine in its own process).\n",
        machine_line(load) + "\n",
        "Times in ms. *Mask* is one `fill` of a 49,152-bit mask while walking a valid output token by token; the"
        " first walk builds lazy state and is reported apart (*first walk*); mean and p95 are over the later walks.\n",
        "| | " + " | ".join(engines) + " |",
        "|---|" + "---|" * len(engines),
        "| tokenizer setup (once per model) | "
        + " | ".join(ms(res[e].get("setup", {}).get("setup_s", "—"), 0) for e in engines)
        + " |",
    ]

    def cell(e: str, key: tuple[str, str], field: str, digits: int = 2) -> str:
        r = res[e].get(key, {})
        if "status" in r or "error" in r:
            return str(r.get("status") or r.get("error", ""))
        return ms(r.get(field, "—"), digits)

    for name in SCHEMAS:
        key = ("schema", name)
        lines.append(
            f"| **{SCHEMA_LABEL[name]}**: compile | "
            + " | ".join(cell(e, key, "compile_s", 1) for e in engines)
            + " |"
        )
        lines.append(
            "| cached compile (xgrammar: compiler cache; llguidance: `deep_copy`; outlines: `Guide(index)`) | "
            + " | ".join(cell(e, key, "cached_s", 3) for e in engines)
            + " |"
        )
        lines.append(
            "| first mask after compile | " + " | ".join(cell(e, key, "first_mask_s") for e in engines) + " |"
        )
        lines.append(
            "| mask, first walk mean | "
            + " | ".join(cell(e, key, "first_walk_mean_s", 3) for e in engines)
            + " |"
        )
        lines.append("| mask mean / p95 / max (later walks) | " + " | ".join(
            cell(e, key, "mask_mean_s", 3) if "mask_mean_s" not in res[e].get(key, {}) else
            f"{ms(res[e][key]['mask_mean_s'], 3)} / {ms(res[e][key]['mask_p95_s'], 3)} / {ms(res[e][key]['mask_max_s'], 3)}" for e in engines) + " |")  # fmt: skip
        lines.append(
            "| consume a token, mean | "
            + " | ".join(cell(e, key, "consume_mean_s", 3) for e in engines)
            + " |"
        )
        lines.append("| tokens walked, outcome | " + " | ".join(
            f"{res[e][key]['tokens']}, {'/'.join(res[e][key]['walk'])}" if "walk" in res[e].get(key, {}) else cell(e, key, "tokens") for e in engines) + " |")  # fmt: skip
    for name in ("tool", "medium"):
        key = ("batch", name)
        lines.append(f"| **8 matchers, {name}**: all 8 masks per step, serial mean / p95 | " + " | ".join(
            f"{ms(res[e][key]['serial_mean_s'])} / {ms(res[e][key]['serial_p95_s'])}" if "serial_mean_s" in res[e].get(key, {}) else cell(e, key, "-") for e in engines) + " |")  # fmt: skip
        lines.append("| the engine's parallel helper, mean / p95 | " + " | ".join(
            f"{ms(res[e][key]['parallel_mean_s'])} / {ms(res[e][key]['parallel_p95_s'])}" if "parallel_mean_s" in res[e].get(key, {}) else "none" for e in engines) + " |")  # fmt: skip

    lines += [
        "",
        "**JSON-schema features** (yes = a valid instance walks through and an invalid one is refused by the mask;"
        " ignored = compiles but lets the invalid one through; refused = compile error):\n",
        "| feature | " + " | ".join(engines) + " |",
        "|---|" + "---|" * len(engines),
    ]

    def status(e: str, key: tuple[str, str]) -> str:
        r = res[e].get(key, {})
        text = r.get("status") or r.get("error", "?")
        if r.get("message"):
            text += f": {r['message'][:90]}"
        return str(text).replace("|", "\\|")

    for name in PROBES:
        lines.append(f"| {name} | " + " | ".join(status(e, ("probe", name)) for e in engines) + " |")
    lines += [
        "",
        "**Schemas that should not compile or could hang** (per-task timeout 30 s, in a child process):\n",
        "| schema | " + " | ".join(engines) + " |",
        "|---|" + "---|" * len(engines),
    ]
    for name in BAD:
        lines.append(
            "| "
            + name.replace("|", "\\|")
            + " | "
            + " | ".join(status(e, ("bad", name)) for e in engines)
            + " |"
        )

    lines += [
        "",
        "**Applying a bitmask to MLX logits on CPU** (median ms, logits `[batch, 49152]` float32, `mx.eval` included):\n",
        "| method | batch 1 | batch 8 |",
        "|---|---|---|",
    ]
    for label in dict.fromkeys(k[0] for k in apply):
        lines.append(
            f"| {label} | "
            + " | ".join(ms(apply.get((label, b), "—"), 3).replace("|", "\\|")[:120] for b in (1, 8))
            + " |"
        )
    if decode:

        def med(mode: str, i: int) -> float:
            return float(statistics.median(r[i] for r in decode[mode]))

        lines += [
            "",
            f"**Decode step of the demo model at batch 8** (float32, {decode['prompt_tokens']}-token prompts,"
            f" greedy; median step of {decode['steps']} per run, median over {len(decode['plain'])} interleaved rounds;"
            " *CPU* is process CPU time per step, all threads, which other work on the machine disturbs less than wall time;"
            " the masking itself is evaluated with the forward pass, so its cost is in the table above, not in the grammar column):\n",
            "| loop | wall (ms) | CPU (ms) | grammar work in Python (fill, masked logits built, consume; ms) | wall vs plain | CPU vs plain | rounds, wall (ms) |",
            "|---|---|---|---|---|---|---|",
            f"| `BatchGenerator.next()` (mlx-lm, as served) | {ms(decode['BatchGenerator.next()'], 1)} | | | | | |",
        ]
        for mode, label in (
            ("plain", "hand loop, no grammar"),
            (
                "serial",
                "+ 8 llguidance tool-call matchers, masks filled serially, bits → `mx.where`, consume",
            ),
            ("parallel", "the same, masks filled by `LLExecutor`"),
        ):
            lines.append(
                f"| {label} | {ms(med(mode, 0), 1)} | {ms(med(mode, 1), 1)} | {ms(med(mode, 2), 2) if mode != 'plain' else ''} |"
                f" {med(mode, 0) / med('plain', 0):.3f} | {med(mode, 1) / med('plain', 1):.3f} | {', '.join(ms(r[0], 0) for r in decode[mode])} |"
            )
    return "\n".join(lines) + "\n"


def _version(engine: str) -> str:
    try:
        return version(engine if engine != "outlines-core" else "outlines_core")
    except PackageNotFoundError:
        return "not installed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--walks", type=int, default=3, help="walks of each valid output per schema")
    parser.add_argument("--steps", type=int, default=40, help="decode steps per run at batch 8")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the decode loops")
    parser.add_argument("--no-decode", action="store_true", help="skip the demo model's decode step")
    parser.add_argument("--write", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--models-root", default=DEFAULT_MODELS_ROOT)
    args = parser.parse_args()
    folder = Path(args.models_root) / MODELS["demo"][0]
    if not (folder / "config.json").exists():
        raise SystemExit(
            f"{folder} is missing: run `manage.py mlxhost_prepare_demo` (MODELS_ROOT={args.models_root})"
        )
    engines = []
    for e in args.engines.split(","):
        try:
            __import__(PACKAGES[e])
            engines.append(e)
        except ImportError:
            print(f"{e}: not installed, skipped", flush=True)
    load = [loadavg()]
    ctx = mp.get_context("spawn")
    tasks = [("schema", n) for n in SCHEMAS] + [("batch", "tool"), ("batch", "medium")]
    tasks += [("probe", n) for n in PROBES] + [("bad", n) for n in BAD]
    res = {}
    for e in engines:
        print(f"{e}:", flush=True)
        res[e] = run_engine(ctx, e, str(folder), tasks, args.walks)
    apply = mask_apply(49152)
    print(apply, flush=True)
    decode = (
        None
        if args.no_decode or "llguidance" not in engines
        else decode_steps(str(folder), args.steps, args.rounds)
    )
    print(decode, flush=True)
    load.append(loadavg())
    text = report(args, load, engines, res, apply, decode)
    print(text)
    if args.write:
        append_results(RESULTS, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
