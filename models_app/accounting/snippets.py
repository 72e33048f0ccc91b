"""Ready-to-paste ways to use a new API key (KEY-1): curl, the OpenAI and Anthropic Python SDKs,
and the environment variables agent CLIs read. Pure text, shown once beside the secret."""

from __future__ import annotations

from dataclasses import dataclass

MODEL_PLACEHOLDER = "your-model"
HELLO = '[{"role": "user", "content": "Hello"}]'


@dataclass(frozen=True, slots=True)
class Snippet:
    """One ready-to-paste way to use a new key."""

    id: str
    title: str
    text: str


def key_snippets(*, base_url: str, raw_key: str, model: str | None, embedding: bool = False) -> list[Snippet]:
    """The snippets for `raw_key` on the server at `base_url`, naming `model` (an alias; None: a
    placeholder). An embedding alias gets `/v1/embeddings` calls, and no Anthropic snippet (that
    API has no embeddings); the agent CLIs' environment is the last snippet either way."""
    base = base_url.rstrip("/")
    model = model or MODEL_PLACEHOLDER
    calls = _embedding_snippets(base, raw_key, model) if embedding else _chat_snippets(base, raw_key, model)
    return [*calls, env_snippet(base_url=base, raw_key=raw_key)]


def env_snippet(*, base_url: str, raw_key: str) -> Snippet:
    """The variables agent CLIs read; they name no model."""
    base = base_url.rstrip("/")
    return Snippet(
        "env",
        "Environment for agent CLIs (Codex, Claude Code, OpenCode …)",
        f"export OPENAI_BASE_URL={base}/v1\n"
        f"export OPENAI_API_KEY={raw_key}\n"
        f"export ANTHROPIC_BASE_URL={base}\n"
        f"export ANTHROPIC_API_KEY={raw_key}",
    )


def _chat_snippets(base: str, raw_key: str, model: str) -> list[Snippet]:
    return [
        Snippet(
            "curl",
            "curl",
            f"curl {base}/v1/chat/completions \\\n"
            f'  -H "Authorization: Bearer {raw_key}" -H "Content-Type: application/json" \\\n'
            f'  -d \'{{"model": "{model}", "messages": {HELLO}}}\'',
        ),
        Snippet(
            "openai",
            "OpenAI Python SDK",
            "import openai\n\n"
            f'client = openai.OpenAI(base_url="{base}/v1", api_key="{raw_key}")\n'
            "reply = client.chat.completions.create(\n"
            f'    model="{model}", messages={HELLO}\n'
            ")\n"
            "print(reply.choices[0].message.content)",
        ),
        Snippet(
            "anthropic",
            "Anthropic Python SDK",
            "import anthropic\n\n"
            f'client = anthropic.Anthropic(base_url="{base}", api_key="{raw_key}")\n'
            "message = client.messages.create(\n"
            f'    model="{model}", max_tokens=256, messages={HELLO}\n'
            ")\n"
            "print(message.content[0].text)",
        ),
    ]


def _embedding_snippets(base: str, raw_key: str, model: str) -> list[Snippet]:
    return [
        Snippet(
            "curl",
            "curl",
            f"curl {base}/v1/embeddings \\\n"
            f'  -H "Authorization: Bearer {raw_key}" -H "Content-Type: application/json" \\\n'
            f'  -d \'{{"model": "{model}", "input": ["Hello"]}}\'',
        ),
        Snippet(
            "openai",
            "OpenAI Python SDK",
            "import openai\n\n"
            f'client = openai.OpenAI(base_url="{base}/v1", api_key="{raw_key}")\n'
            f'result = client.embeddings.create(model="{model}", input=["Hello"])\n'
            "print(len(result.data[0].embedding))",
        ),
    ]
