"""A deterministic tiny random-weights LLaVA folder (CLIP vision tower, llama text model) that
mlx-vlm loads with its processor: the vision kind's test model, built offline (issue 29).

Needs the vision extra (mlx-vlm): import this module only where that is known to be installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_vlm.models.llava.config import ModelConfig, TextConfig, VisionConfig
from mlx_vlm.models.llava.llava import Model as LlavaModel
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mlxhost.engine.backends.mlx.tiny import (
    IM_END,
    SPECIAL_TOKENS,
    TINY_CORPUS,
    publish_folder,
    write_json,
)

TINY_VISION_VERSION = 1
IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = len(SPECIAL_TOKENS)  # the trainer puts special tokens first: after the ChatML three
IMAGE_SIZE, PATCH_SIZE = 32, 8
# CLIP's default strategy drops the class token: one image is (32 / 8) ** 2 = 16 image tokens.
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
TINY_VISION_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "processor_config.json",
)
VOCAB_SIZE = 512
# Content is a string, or a list of {"type": "text"} and {"type": "image"} parts (as transformers'
# vision templates take it); an image part renders as the processor's `<image>`, which it expands.
LLAVA_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
VISION_CONFIG = {
    "model_type": "clip_vision_model",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
    "projection_dim": 32,
    "num_channels": 3,
    "layer_norm_eps": 1e-5,
}
CONFIG: dict[str, Any] = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "text_config": TEXT_CONFIG,
    "vision_config": VISION_CONFIG,
    "image_token_index": IMAGE_TOKEN_ID,
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "vocab_size": VOCAB_SIZE,
    "eos_token_id": [2],
}
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
PREPROCESSOR_CONFIG = {
    "image_processor_type": "CLIPImageProcessor",
    "do_resize": True,
    "size": {"shortest_edge": IMAGE_SIZE},
    "resample": 3,
    "do_center_crop": True,
    "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
    "do_convert_rgb": True,
}
PROCESSOR_CONFIG = {
    "processor_class": "LlavaProcessor",
    "image_token": IMAGE_TOKEN,
    "patch_size": PATCH_SIZE,
    "vision_feature_select_strategy": "default",
    "num_additional_image_tokens": 1,
}


def build_tiny_vision_model(dest: Path, *, seed: int = 0) -> Path:
    """Build (once) a tiny random-weights LLaVA folder that `mlx_vlm.load` accepts, with a CLIP
    image processor (32 x 32) and an `<image>` token: 16 image tokens per image.

    Same `seed` gives byte-identical files; a complete build at `dest` is reused (as
    `tiny.build_tiny_model`). Reseeds MLX's global RNG as a side effect.

    Raises:
        FileExistsError: `dest` is a non-empty folder that mlxhost did not build.
    """
    marker = {"kind": "tiny-llava", "seed": seed, "version": TINY_VISION_VERSION}
    return publish_folder(
        Path(dest), marker=marker, required=TINY_VISION_FILES, write=lambda tmp: _write_llava(tmp, seed)
    )


def _write_llava(folder: Path, seed: int) -> None:
    write_json(folder / "config.json", CONFIG)
    mx.random.seed(seed)
    config = ModelConfig.from_dict(CONFIG)
    config.text_config = TextConfig.from_dict(TEXT_CONFIG)
    config.vision_config = VisionConfig.from_dict(VISION_CONFIG)
    model = LlavaModel(config)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "tokenizer.json").write_text(_train_tokenizer().to_str(), encoding="utf-8")
    write_json(folder / "tokenizer_config.json", _tokenizer_config())
    write_json(folder / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    write_json(folder / "processor_config.json", PROCESSOR_CONFIG)


def _train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=[*SPECIAL_TOKENS, IMAGE_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TINY_CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": SPECIAL_TOKENS[0],
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": TEXT_CONFIG["max_position_embeddings"],
        "chat_template": LLAVA_TEMPLATE,
        "extra_special_tokens": {"image_token": IMAGE_TOKEN},
    }
