"""Deterministic random-weights llama model folders (tiny, or any size), plus the atomic folder publishing they share."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

MARKER_NAME = ".mlxhost-build.json"
# Bump when anything below changes the built bytes, so old folders get rebuilt.
TINY_VERSION = 2  # 2: a 128k context
TINY_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# The trainer puts special tokens first, in this order: ids 0, 1, 2.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The tool-capable variant: Hermes-style calls (mlx-lm reads them with its json_tools parser), and
# thinking markers the template opens when `enable_thinking` is on (mlx-lm's default for such models).
THINK_START, THINK_END, TOOL_START, TOOL_END = "<think>", "</think>", "<tool_call>", "</tool_call>"
TOOL_TOKENS = (THINK_START, THINK_END, TOOL_START, TOOL_END)
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call one with <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- if not (loop.last and continue_final_message) %}<|im_end|>\n{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)

TINY_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    # A long context, as today's models have (RoPE has no learned positions): the context is the
    # default input limit and cuts max_tokens, and tests stream long answers without reaching it.
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": SPECIAL_TOKENS.index(IM_START),
    "eos_token_id": SPECIAL_TOKENS.index(IM_END),
}

# The shape of the mid-size random model the concurrency benchmark serves: about 52M parameters,
# all in the decoder layers (the tiny tokenizer's vocabulary is only 512).
MID_SHAPE: dict[str, int] = {
    "hidden_size": 512,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 2304,
}

# Training text for the tokenizer: fixed, so the merges (and the file) never change.
TINY_CORPUS = """\
The little town sat beside a slow green river, and every morning the baker opened
his shop before the sun was up. He made bread, small cakes, and a sweet loaf with
raisins that the children loved. The people of the town walked to the market along
the river path, and they talked about the weather, the price of apples, and the news
from the city on the far side of the hills.
In the spring the fields turned green and the farmers planted wheat and barley. In
the summer the days were long and warm, and the children swam in the river after
school. In the autumn the leaves turned red and gold, the farmers brought in the
harvest, and the whole town gathered in the square for a festival with music and
dancing. In the winter the river froze at the edges, snow covered the roofs, and the
baker kept his ovens burning all day so that his shop was the warmest room in town.
One evening a traveller came down the road from the hills. She carried a heavy bag
and a wooden box of maps. She asked the baker for a loaf of bread and a place to
sleep, and he gave her both. While she ate, she told him about the places she had
seen: a city of bridges, a desert where the wind sang at night, a forest so old that
the trees remembered the first people who walked beneath them.
The baker listened and asked many questions. Where does the river go? How far is the
sea? What do people eat in the city of bridges? The traveller answered what she could
and laughed at what she could not. In the morning she thanked him, paid for the bread
with a silver coin, and gave him one of her maps. It showed the river running past
the town, through the valley, and all the way to the sea.
For many years the map hung on the wall of the bakery. Visitors asked about it, and
the baker told them the story of the traveller. Some of them laughed, some of them
listened, and a few of them followed the river to see where it would take them.
Nobody knows what they found, but the baker liked to think that they reached the sea.
"""


def build_tiny_model(dest: Path, *, seed: int = 0, tools: bool = False) -> Path:
    """Build (once) a tiny random-weights llama folder that `mlx_lm.load` accepts.

    Same `seed` gives byte-identical files. A complete build already at `dest`
    is reused; otherwise the folder is built in a temp sibling and renamed in.
    Reseeds MLX's global RNG as a side effect. With `tools`, the tokenizer also has thinking and
    tool-call tokens and the chat template renders tools (TOOLS_TEMPLATE).

    Raises:
        FileExistsError: `dest` is a non-empty folder that mlxhost did not build.
    """
    marker = {
        "kind": "tiny-llama",
        "seed": seed,
        "version": TINY_VERSION,
        **({"tools": True} if tools else {}),
    }
    return publish_folder(
        Path(dest),
        marker=marker,
        required=TINY_FILES,
        write=lambda tmp: _write_llama(tmp, TINY_CONFIG, seed, tools),
    )


def build_random_llama(
    dest: Path,
    *,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    seed: int = 0,
) -> Path:
    """Build (once) a random-weights llama of the given shape with the tiny model's tokenizer.

    Gibberish output, real compute: for benchmarks that need a model of a given size offline.
    The tokenizer, chat template and EOS are the tiny model's (vocab 512). Same shape and
    `seed` give byte-identical files; reuse and publishing work as in `build_tiny_model`.

    Raises:
        FileExistsError: `dest` is a non-empty folder that mlxhost did not build.
    """
    shape = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
    }
    config = {**TINY_CONFIG, **shape}
    marker = {"kind": "random-llama", "seed": seed, "version": TINY_VERSION, "shape": shape}
    return publish_folder(
        Path(dest), marker=marker, required=TINY_FILES, write=lambda tmp: _write_llama(tmp, config, seed)
    )


def _write_llama(folder: Path, config: Mapping[str, Any], seed: int, tools: bool = False) -> None:
    write_json(folder / "config.json", config)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(dict(config)))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "tokenizer.json").write_text(_train_tokenizer(tools).to_str(), encoding="utf-8")
    write_json(folder / "tokenizer_config.json", _tokenizer_config(tools))


def _train_tokenizer(tools: bool = False) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_CONFIG["vocab_size"],
        min_frequency=1,
        special_tokens=[*SPECIAL_TOKENS, *(TOOL_TOKENS if tools else ())],
        # All 256 byte symbols, so any input text stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TINY_CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def _tokenizer_config(tools: bool = False) -> dict[str, Any]:
    return {
        # The generic class loads tokenizer.json as is; transformers 5 may rebuild
        # parts of the pipeline for model-specific classes.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": TINY_CONFIG["max_position_embeddings"],
        "chat_template": TOOLS_TEMPLATE if tools else CHATML_TEMPLATE,
    }


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write `data` as stable, sorted JSON (same data, same bytes)."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


def folder_is_built(dest: Path, *, marker: Mapping[str, Any], required: Iterable[str]) -> bool:
    """True when `dest` holds a complete build whose marker equals `marker`."""
    try:
        recorded = json.loads((dest / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(recorded == dict(marker) and all((dest / name).is_file() for name in required))


def publish_folder(
    dest: Path,
    *,
    marker: Mapping[str, Any],
    required: Iterable[str],
    write: Callable[[Path], None],
) -> Path:
    """Build a model folder with `write` into a temp sibling and rename it to `dest`.

    Returns at once when `dest` already matches `marker`. The marker is written
    last and everything is fsynced before the rename, so a crash at any point
    leaves either the old folder, the new one, or a stray temp sibling.

    Raises:
        FileExistsError: `dest` is a non-empty folder without an mlxhost marker.
    """
    required = tuple(required)
    if folder_is_built(dest, marker=marker, required=required):
        return dest
    _check_replaceable(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the served folder must be readable by other users
    try:
        write(tmp)
        write_json(tmp / MARKER_NAME, marker)
        _fsync_tree(tmp)
        _swap_in(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    if not folder_is_built(dest, marker=marker, required=required):
        raise FileExistsError(f"{dest} was replaced by a different build while building")
    return dest


def _check_replaceable(dest: Path) -> None:
    # Never delete a folder we did not build (a typo'd dest could be a home dir).
    if dest.is_dir() and any(dest.iterdir()) and not (dest / MARKER_NAME).is_file():
        raise FileExistsError(f"{dest} is not empty and was not built by mlxhost; refusing to replace it")
    if dest.exists() and not dest.is_dir():
        raise FileExistsError(f"{dest} exists and is not a folder")


def _swap_in(tmp: Path, dest: Path) -> None:
    old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex}")
    moved = False
    if dest.exists():
        dest.rename(old)
        moved = True
    try:
        tmp.rename(dest)
    except OSError:
        if not dest.is_dir():  # not a lost race with a concurrent builder: put the old one back
            if moved:
                old.rename(dest)
            raise
    finally:
        if moved and old.exists():
            shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(dest.parent)


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def build_tiny_adapter(
    base: Path,
    dest: Path,
    *,
    seed: int = 0,
    rank: int = 4,
    scale: float = 2.0,
    keys: Iterable[str] | None = None,
) -> Path:
    """A random LoRA adapter for the model at `base`, saved as `mlx_lm.lora` saves one (issue 28).

    mlx-lm's own tuner builds it (`linear_to_lora_layers` on every layer, `keys` or its default
    layers), with `lora_b` random instead of zero so the adapter changes the output; the folder
    holds `adapters.safetensors` (the trainable parameters) and `adapter_config.json`.
    Same `seed` gives the same files; built in a temp sibling and renamed in.
    """
    from mlx.utils import tree_map_with_path
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = load(str(base))[0]
    model.freeze()
    layers = len(model.layers)
    parameters: dict[str, Any] = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        parameters["keys"] = sorted(keys)
    mx.random.seed(seed)
    linear_to_lora_layers(model, layers, parameters)
    model.update(
        tree_map_with_path(
            lambda path, w: mx.random.normal(w.shape) * 0.2 if path.endswith(".lora_b") else w,
            model.trainable_parameters(),
        )
    )
    config = {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": parameters, "seed": seed}

    def write(tmp: Path) -> None:
        mx.save_safetensors(
            str(tmp / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters()))
        )
        write_json(tmp / "adapter_config.json", config)

    marker = {
        "kind": "tiny-adapter",
        "seed": seed,
        "rank": rank,
        "scale": scale,
        "keys": parameters.get("keys"),
    }
    return publish_folder(
        Path(dest), marker=marker, required=("adapters.safetensors", "adapter_config.json"), write=write
    )
