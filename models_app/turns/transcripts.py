"""Stored responses as readable conversations: the admin's detail page and the chat page (ADM-4, ADM-5)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from models_app.catalogue import selectors
from models_app.models import StoredResponse
from models_app.turns.conversations import CONTINUABLE

ROLE_LABELS = {
    "system": "Instructions",
    "developer": "Developer",
    "user": "User",
    "assistant": "Assistant",
    "tool": "Tool result",
}
# What a status means in words; an incomplete row's reason is not stored (see `status_text`).
STATUS_WORDS: dict[str, str] = {
    StoredResponse.Status.PENDING: "Pending",
    StoredResponse.Status.IN_PROGRESS: "In progress",
    StoredResponse.Status.COMPLETED: "Completed",
    StoredResponse.Status.INCOMPLETE: "Incomplete",
    StoredResponse.Status.FAILED: "Failed",
    StoredResponse.Status.CANCELLED: "Stopped",
}
CUT_OFF = "Cut off at the token limit"
RECENT_CONVERSATIONS = 20
PUBLIC_ID_MAX = StoredResponse._meta.get_field("public_id").max_length


@dataclass(frozen=True, slots=True)
class TranscriptMessage:
    """One role-labelled message; `earlier` marks turns answered by an earlier response."""

    role: str
    label: str
    text: str
    calls: tuple[str, ...] = ()  # an assistant's function calls, as `name(arguments)`
    earlier: bool = False

    @property
    def blank(self) -> bool:
        """Text that is only whitespace: shown as a note, not as an empty box."""
        return bool(self.text) and not self.text.strip()


@dataclass(frozen=True, slots=True)
class Transcript:
    """A stored response as the admin shows it: the conversation it answered, its output and usage."""

    response: StoredResponse
    messages: list[TranscriptMessage]
    output: list[TranscriptMessage]
    usage: dict[str, int]
    status_text: str
    previous: StoredResponse | None  # the parent row, when it is stored for this owner
    next: list[StoredResponse] = field(default_factory=list)  # rows that continue this one


def status_text(response: StoredResponse) -> str:
    """The row's status in words. An incomplete row says "cut off" only when its output reached the
    `max_output_tokens` it asked for: the reason itself (length, or a drain) is not stored."""
    if response.status == StoredResponse.Status.INCOMPLETE:
        limit = (response.request or {}).get("max_output_tokens")
        produced = (response.usage or {}).get("output_tokens")
        if isinstance(limit, int) and isinstance(produced, int) and produced >= limit:
            return CUT_OFF
    return STATUS_WORDS.get(response.status, str(response.status))


def usage_numbers(response: StoredResponse) -> dict[str, int]:
    """Input, cached, output and total tokens of a row (zeros when it has no usage)."""
    usage = response.usage or {}
    details = usage.get("input_tokens_details") or {}
    return {
        "input": int(usage.get("input_tokens") or 0),
        "cached": int(details.get("cached_tokens") or 0),
        "output": int(usage.get("output_tokens") or 0),
        "total": int(usage.get("total_tokens") or 0),
    }


def _message(turn: Any, *, earlier: bool) -> TranscriptMessage | None:
    if not isinstance(turn, Mapping):
        return None
    role = str(turn.get("role") or "user")
    content = turn.get("content")
    if isinstance(content, list):  # text parts, should a row hold them unflattened
        content = "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    calls = tuple(
        f"{call.get('name', '?')}({call.get('arguments', '')})"
        for call in turn.get("tool_calls") or ()
        if isinstance(call, Mapping)
    )
    return TranscriptMessage(
        role=role,
        label=ROLE_LABELS.get(role, role),
        text=str(content or ""),
        calls=calls,
        earlier=earlier,
    )


def _own_turns(request: Mapping[str, Any]) -> list[Any]:
    raw = request.get("input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    return [turn for turn in raw or [] if isinstance(turn, Mapping)]


def response_messages(*, response: StoredResponse) -> list[TranscriptMessage]:
    """The conversation a row answered, oldest first: its instructions, the earlier turns it
    carries (`request.conversation`, marked `earlier`), then its own input."""
    request: Mapping[str, Any] = response.request or {}
    own = _own_turns(request)
    conversation = request.get("conversation")
    own_count = len([turn for turn in own if turn.get("role") != "system"])  # the store leaves these out
    earlier = conversation[: max(0, len(conversation) - own_count)] if isinstance(conversation, list) else []
    messages: list[TranscriptMessage | None] = []
    if request.get("instructions"):
        messages.append(_message({"role": "system", "content": request["instructions"]}, earlier=False))
    messages += [_message(turn, earlier=True) for turn in earlier]
    messages += [_message(turn, earlier=False) for turn in own]
    return [message for message in messages if message is not None]


def response_output(*, response: StoredResponse) -> list[TranscriptMessage]:
    """What the row answered: its reasoning, its message and its function calls."""
    out: list[TranscriptMessage] = []
    for item in response.output or []:
        if not isinstance(item, Mapping):
            continue
        kind = item.get("type")
        if kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = "".join(str(p.get("text", "")) for p in parts if isinstance(p, Mapping))
            out.append(TranscriptMessage(role="reasoning", label="Reasoning", text=text))
        elif kind == "message":
            text = "".join(
                str(p.get("text", "")) for p in item.get("content") or [] if isinstance(p, Mapping)
            )
            out.append(TranscriptMessage(role="assistant", label="Assistant", text=text))
        elif kind == "function_call":
            call = f"{item.get('name', '?')}({item.get('arguments', '')})"
            out.append(TranscriptMessage(role="assistant", label="Function call", text="", calls=(call,)))
    if not out and response.output_text:
        out.append(TranscriptMessage(role="assistant", label="Assistant", text=response.output_text))
    return out


def response_transcript(*, response: StoredResponse) -> Transcript:
    """A stored response as a conversation, with its neighbours in the chain (one owner, PER-6)."""
    rows = StoredResponse.objects.filter(owner_id=response.owner_id)
    previous = None
    if response.previous_response_id:
        previous = rows.filter(public_id=response.previous_response_id).first()
    return Transcript(
        response=response,
        messages=response_messages(response=response),
        output=response_output(response=response),
        usage=usage_numbers(response),
        status_text=status_text(response),
        previous=previous,
        next=list(rows.filter(previous_response_id=response.public_id).order_by("created_at")[:10]),
    )


# The chat page ---------------------------------------------------------------------------------------


def _user_text(response: StoredResponse) -> str:
    turns = _own_turns(response.request or {})
    return "\n".join(
        _content_text(turn.get("content")) for turn in turns if turn.get("role", "user") == "user"
    )


def _content_text(content: object) -> str:
    """A message's text: a string, or the text of its parts (Responses' input_text and the like)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text") or "") for part in content if isinstance(part, Mapping))
    return ""


def chat_history(*, owner_id: int, public_id: str) -> dict[str, Any] | None:
    """A stored conversation of `owner_id` as the chat page reopens it, or None when `public_id`
    is not theirs or not stored (PER-6: the same None either way).

    Turns come from the chain's rows (input, answer, status, usage, ids); what lies before its
    oldest stored row (expired, or past the walk's bound) comes from that row's own copy of the
    conversation, as `earlier` role/text messages.
    """
    if not public_id or len(public_id) > (PUBLIC_ID_MAX or 64):
        return None
    tip = StoredResponse.objects.filter(owner_id=owner_id, public_id=public_id).first()
    if tip is None:
        return None
    chain = selectors.response_chain(response=tip)
    oldest = chain.turns[0]
    earlier = (
        [m for m in response_messages(response=oldest) if m.earlier] if oldest.previous_response_id else []
    )
    return {
        "id": tip.public_id,
        "root": oldest.public_id,
        "alias": tip.alias_name,
        "continuable": tip.status in CONTINUABLE,
        "instructions": (tip.request or {}).get("instructions") or "",
        "earlier": [{"role": m.role, "label": m.label, "text": m.text} for m in earlier],
        "turns": [
            {
                "id": row.public_id,
                "previous_id": row.previous_response_id or None,
                "input": _user_text(row),
                "output": row.output_text,
                "status": row.status,
                "status_text": status_text(row),
                "usage": usage_numbers(row),
                "timings": (row.request or {}).get("timings"),
                "cache": (row.request or {}).get("session_cache"),
            }
            for row in chain.turns
        ],
    }


RECENT_ROWS = 1000  # the owner's newest rows a sidebar groups into conversations


def conversations_recent(*, owner_id: int, limit: int = RECENT_CONVERSATIONS) -> list[dict[str, Any]]:
    """The owner's latest conversations, newest first: one entry per conversation (its root), not
    one per branch a stop or a regenerate left, linking its newest tip and labelled by its
    opening words (never a raw id), with how many turns and branches it has (ADM-4).

    Two queries: the newest RECENT_ROWS rows' links, grouped in memory, then the roots' inputs."""
    rows = list(
        StoredResponse.objects.filter(owner_id=owner_id)
        .order_by("-created_at")
        .values("public_id", "previous_response_id", "created_at", "status", "alias_name")[:RECENT_ROWS]
    )
    by_id = {row["public_id"]: row for row in rows}
    continued = {row["previous_response_id"] for row in rows if row["previous_response_id"]}
    conversations: dict[str, dict[str, Any]] = {}
    for tip in rows:  # newest first: a conversation's first tip seen is its newest
        if tip["public_id"] in continued:
            continue
        root, depth = tip, 1
        while root["previous_response_id"] in by_id and depth < len(rows):
            root, depth = by_id[root["previous_response_id"]], depth + 1
        entry = conversations.get(root["public_id"])
        if entry is not None:
            entry["branches"] += 1
            continue
        if len(conversations) < limit:
            conversations[root["public_id"]] = {
                "id": tip["public_id"],
                "root": root["public_id"],
                "alias": tip["alias_name"],
                "created_at": tip["created_at"],
                "status": tip["status"],
                "turns": depth,
                "branches": 1,
            }
    openings = {
        row.public_id: _user_text(row)
        for row in StoredResponse.objects.filter(public_id__in=list(conversations)).only(
            "public_id", "request"
        )
    }
    for root_id, entry in conversations.items():
        entry["label"] = _label(openings.get(root_id, ""), alias=entry["alias"], when=entry["created_at"])
    return list(conversations.values())


def _label(text: str, *, alias: str, when: Any) -> str:
    words = " ".join(text.split())
    if not words:
        return f"Chat with {alias}, {when:%Y-%m-%d %H:%M}"
    return words if len(words) <= LABEL_CHARS else words[: LABEL_CHARS - 1].rstrip() + "\u2026"


LABEL_CHARS = 60
