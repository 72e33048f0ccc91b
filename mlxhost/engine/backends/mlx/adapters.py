"""LoRA adapters served together in one batch (issue 28): `MultiLoRALinear`, the `AdapterBank` of a loaded
model, and the per-row adapter index that mlx-lm's batch sets before each forward pass.

mlx-lm applies an adapter by replacing each adapted `Linear` with a `LoRALinear` (`tuner/utils.py`,
`linear_to_lora_layers` and `load_adapters`): `y = linear(x) + (scale * ((x @ lora_a) @ lora_b))`, one
adapter per model. Here each adapted layer is wrapped once in a `MultiLoRALinear` that holds every
loaded adapter's `lora_a` / `lora_b` stacked by slot (slot 0: no adapter, zeros). Before each model
call the batch tells the bank which slot each row uses (`AdapterBank.select`); the layer computes
the base matmul once for the whole batch and only the low-rank part per row, as vLLM's multi-LoRA
(Punica) does:

- no row with an adapter: the base layer alone (nothing else is computed);
- every row with the same adapter (one request, or a batch of one alias): mlx-lm's own expression
  with that adapter's own arrays, so the output is mlx-lm's `LoRALinear` exactly;
- mixed rows: `gather_mm(gather_mm(x, A, idx), B, idx)` picks each row's pair without copying the
  stacks; rows with slot 0 add zeros (exact: `y + 0 == y`).

Rows are never grouped by adapter: the low-rank part costs rows * L * rank * (in + out) multiply-adds
against the base's rows * L * in * out, so with rank << min(in, out) (8-64 against 512-8192) the
gathered pass costs a few percent of the base; grouping would rerun the base matmul per group.
An adapter's rank pads to the largest loaded on that layer (zeros), which only wastes work when
ranks differ a lot; docs/models.md says so.

The hook: the batch's prefill (`PromptProcessingBatch.prompt` and `generate`, which runs the first
decode step) and decode (`GenerationBatch._step`, and speculation's verify pass) call `select` with
their rows' uids through `RowAdapters.hook` right before calling the model; `MlxBatch` installs
the subclasses below in mlx-lm's `BatchGenerator`. Worker thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedLinear
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

from mlxhost.engine.adapter_files import ADAPTER_WEIGHTS, adapter_fingerprint, read_adapter
from mlxhost.engine.errors import InvalidAdapterError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from mlxhost.engine.types import AdapterRef

# Adapters a loaded model keeps at once; past it the least recently used idle one is unloaded.
MAX_ADAPTERS = 8


@dataclass(frozen=True, slots=True)
class Selection:
    """The adapters of the rows of the next forward pass: one slot for all, or one per row."""

    uniform: int | None  # every row's slot, when they share one
    index: mx.array | None = None  # (rows,) slots, when they differ
    scales: mx.array | None = None  # (rows,) each row's adapter scale (0 for slot 0)


class _Pairs:
    """One layer's adapters: each slot's own (lora_a, lora_b), and the stacks by slot. A plain object,
    so none of it enters the model's parameter tree (saves, sizes and quantization never see it)."""

    __slots__ = ("a", "b", "own")

    def __init__(self) -> None:
        self.own: dict[int, tuple[mx.array, mx.array]] = {}
        self.a: mx.array | None = None  # (slots, in, rank)
        self.b: mx.array | None = None  # (slots, rank, out)

    def restack(self, slots: int, width_in: int, width_out: int) -> None:
        if not self.own:
            self.a = self.b = None
            return
        rank = max(a.shape[1] for a, _ in self.own.values())
        dtype = next(iter(self.own.values()))[0].dtype
        a_rows, b_rows = [], []
        for slot in range(slots):
            a, b = self.own.get(slot, (mx.zeros((width_in, 0), dtype), mx.zeros((0, width_out), dtype)))
            pad = rank - a.shape[1]
            a_rows.append(mx.pad(a, [(0, 0), (0, pad)]) if pad else a)
            b_rows.append(mx.pad(b, [(0, pad), (0, 0)]) if pad else b)
        self.a, self.b = mx.stack(a_rows), mx.stack(b_rows)
        mx.eval(self.a, self.b)


class MultiLoRALinear(Module):
    """A base linear layer plus every loaded adapter's low-rank update, picked per row (module docstring)."""

    def __init__(self, linear: Any, bank: AdapterBank) -> None:
        super().__init__()
        self.linear = linear
        self.width_in, self.width_out = linear_widths(linear)
        self._bank = bank
        self._pairs = _Pairs()

    def __call__(self, x: mx.array) -> Any:
        y = self.linear(x)
        selection, scales = self._bank.selection, self._bank.scales
        if selection is None or not self._pairs.own:
            return y
        if selection.uniform is not None:
            pair = self._pairs.own.get(selection.uniform)
            if pair is None:
                return y
            a, b = pair
            z = (x @ a) @ b
            return y + (scales[selection.uniform] * z).astype(x.dtype)  # mlx-lm's LoRALinear
        assert selection.index is not None and selection.scales is not None
        stacked_a, stacked_b = self._pairs.a, self._pairs.b
        assert stacked_a is not None and stacked_b is not None
        z = mx.gather_mm(
            mx.gather_mm(x, stacked_a, rhs_indices=selection.index), stacked_b, rhs_indices=selection.index
        )
        row_scales = selection.scales.astype(z.dtype).reshape(-1, *([1] * (z.ndim - 1)))
        return y + (row_scales * z).astype(x.dtype)


def linear_widths(linear: Any) -> tuple[int, int]:
    """(in, out) of a Linear or a QuantizedLinear (whose weight packs `bits`-bit values in uint32)."""
    out_dims, packed = linear.weight.shape
    if isinstance(linear, QuantizedLinear):
        return packed * 32 // linear.bits, out_dims
    return packed, out_dims


@dataclass(slots=True)
class _Loaded:
    ref: AdapterRef
    slot: int
    scale: float
    layers: tuple[str, ...]
    nbytes: int
    rows: int = 0  # rows of a batch (or the one stream) using it now


class AdapterBank:
    """The adapters loaded into one base model, by fingerprint: slots, the wrapped layers, and the
    rows' selection for the next forward pass. The base weights are never touched or reloaded."""

    def __init__(self, model: Any, limit: int = MAX_ADAPTERS) -> None:
        self._model = model
        self._limit = limit
        self._layers: dict[str, MultiLoRALinear] = {}
        self._loaded: OrderedDict[str, _Loaded] = OrderedDict()  # key -> adapter, least recently used first
        self.selection: Selection | None = None
        self.scales: dict[int, float] = {0: 0.0}

    @property
    def loaded(self) -> list[AdapterRef]:
        return [entry.ref for entry in self._loaded.values()]

    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._loaded.values())

    def slot(self, ref: AdapterRef | None) -> int:
        """The slot of `ref`, loading it first if needed (slot 0: no adapter)."""
        if ref is None:
            return 0
        entry = self._loaded.get(ref.key)
        if entry is None:
            entry = self._load(ref)
        self._loaded.move_to_end(ref.key)
        return entry.slot

    def hold(self, slot: int, delta: int) -> None:
        """Count a row in (+1) or out (-1) of an adapter: one in use is never unloaded."""
        for entry in self._loaded.values():
            if entry.slot == slot:
                entry.rows += delta

    def unload(self, key: str) -> bool:
        """Drop an adapter no row uses; the base and the other adapters keep serving. False if busy or absent."""
        entry = self._loaded.get(key)
        if entry is None or entry.rows > 0:
            return False
        del self._loaded[key]
        del self.scales[entry.slot]
        for name in entry.layers:
            layer = self._layers[name]
            del layer._pairs.own[entry.slot]
        self._restack(entry.layers)
        return True

    def select(self, slots: Sequence[int]) -> None:
        """Set the rows' adapters for the next forward pass (before every model call)."""
        if not slots or not any(slots):
            self.selection = None
        elif all(s == slots[0] for s in slots):
            self.selection = Selection(slots[0])
        else:
            index = mx.array(list(slots), dtype=mx.uint32)
            self.selection = Selection(None, index, mx.array([self.scales.get(s, 0.0) for s in slots]))

    def _load(self, ref: AdapterRef) -> _Loaded:
        folder = Path(ref.path)
        info = read_adapter(folder)  # InvalidAdapterError
        if adapter_fingerprint(folder) != ref.key:  # as REG-3 for weights: never other files under its name
            raise InvalidAdapterError(
                f"The adapter {ref.name!r} changed on disk since it was saved; save it again."
            )
        while len(self._loaded) >= self._limit:
            idle = next((k for k, e in self._loaded.items() if e.rows == 0), None)
            if idle is None:
                raise InvalidAdapterError(
                    f"{self._limit} adapters are in use on this model; try again shortly."
                )
            self.unload(idle)
        weights = cast("dict[str, mx.array]", mx.load(str(folder / ADAPTER_WEIGHTS)))
        used = {e.slot for e in self._loaded.values()}
        slot = next(s for s in range(1, self._limit + 2) if s not in used)
        pairs: dict[str, tuple[mx.array, mx.array]] = {}
        for name, (width_in, width_out) in info.layers.items():
            layer = self._layers.get(name) or self._wrap(name)
            if (layer.width_in, layer.width_out) != (width_in, width_out):
                raise InvalidAdapterError(
                    f"{name}: the adapter maps {width_in} -> {width_out}, the base layer "
                    f"{layer.width_in} -> {layer.width_out}"
                )
            pairs[name] = (weights[f"{name}.lora_a"], weights[f"{name}.lora_b"])
        for name, pair in pairs.items():
            self._layers[name]._pairs.own[slot] = pair
        self.scales[slot] = info.scale
        entry = _Loaded(ref, slot, info.scale, tuple(pairs), sum(int(w.nbytes) for w in weights.values()))
        self._loaded[ref.key] = entry
        self._restack(entry.layers)
        return entry

    def _restack(self, names: Sequence[str]) -> None:
        slots = 1 + max(self.scales)
        for name in names:
            layer = self._layers[name]
            layer._pairs.restack(slots, layer.width_in, layer.width_out)
        for layer in self._layers.values():  # every stack spans every slot
            if layer._pairs.a is not None and layer._pairs.a.shape[0] != slots:
                layer._pairs.restack(slots, layer.width_in, layer.width_out)

    def _wrap(self, name: str) -> MultiLoRALinear:
        parent: Any = self._model
        *path, leaf = name.split(".")
        for part in path:
            parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part, None)
            if parent is None:
                raise InvalidAdapterError(f"{name}: the base model has no such layer")
        base = parent[int(leaf)] if isinstance(parent, list) else getattr(parent, leaf, None)
        if not isinstance(base, (Linear, QuantizedLinear)):
            raise InvalidAdapterError(f"{name}: not a linear layer of the base model ({type(base).__name__})")
        layer = MultiLoRALinear(base, self)
        if isinstance(parent, list):
            parent[int(leaf)] = layer
        else:
            setattr(parent, leaf, layer)
        self._layers[name] = layer
        return layer


class RowAdapters:
    """Which slot each row (by the batch's uid) uses: what the batch's hook hands the bank. Without a
    bank (a model that serves no adapter) every method does nothing and every row is the base's."""

    def __init__(self, bank: AdapterBank | None) -> None:
        self.bank = bank
        self.slots: dict[int, int] = {}

    @classmethod
    def install(cls, generator: Any, bank: AdapterBank | None) -> RowAdapters:
        """Rows of `generator` (mlx-lm's `BatchGenerator`) that select their adapters before each pass."""
        rows = cls(bank)
        if bank is not None:
            install(generator, rows)
        return rows

    def slot(self, ref: AdapterRef | None) -> int:
        if ref is None:
            return 0
        if self.bank is None:
            raise InvalidAdapterError("This model cannot serve adapters.")
        return self.bank.slot(ref)

    def select(self, slot: int) -> None:
        """One row alone (a short prompt fed outside the generator)."""
        if self.bank is not None:
            self.bank.select([slot])

    def hook(self, uids: Sequence[int]) -> None:
        if self.bank is not None:
            self.bank.select([self.slots.get(uid, 0) for uid in uids])

    def add(self, uid: int, slot: int) -> None:
        if slot and uid >= 0 and self.bank is not None:  # a negative handle ended at once
            self.slots[uid] = slot
            self.bank.hold(slot, 1)

    def drop(self, uid: int) -> None:
        slot = self.slots.pop(uid, 0)
        if slot and self.bank is not None:
            self.bank.hold(slot, -1)


class AdapterPromptBatch(PromptProcessingBatch):
    """mlx-lm's prompt batch that selects its rows' adapters before it calls the model."""

    row_hook: Callable[[Sequence[int]], None] | None = None

    def prompt(self, tokens: list[list[int]]) -> None:
        if self.row_hook is not None:
            self.row_hook(self.uids)
        super().prompt(tokens)

    def generate(self, tokens: list[list[int]]) -> Any:
        if self.row_hook is not None:  # its prompt() and the new GenerationBatch's first step
            self.row_hook(self.uids)
        return super().generate(tokens)

    def _copy(self) -> Any:
        new = super()._copy()
        new.row_hook = self.row_hook
        return new


class AdapterGenerationBatch(GenerationBatch):
    """mlx-lm's decode batch that selects its rows' adapters before each step."""

    row_hook: Callable[[Sequence[int]], None] | None = None

    def _step(self) -> Any:
        if self.row_hook is not None:
            self.row_hook(self.uids)
        return super()._step()


def install(generator: Any, rows: RowAdapters) -> None:
    """Make `generator` (mlx-lm's `BatchGenerator`) select each row's adapter before each forward pass."""
    prompt = AdapterPromptBatch.empty(
        generator.model, generator.sampler, prefill_step_size=generator.prefill_step_size
    )
    prompt.row_hook = rows.hook
    generator._prompt_batch = prompt
    generation = generator._generation_batch
    if type(generation) is GenerationBatch:
        generation = AdapterGenerationBatch.empty(generator.model, generator.sampler)
        generator._generation_batch = generation
    generation.row_hook = rows.hook  # SpeculativeGenerationBatch reads it in _step and _verify
