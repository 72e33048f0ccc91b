"""A request's prompt as its model will read it: one renderer for submit and count_tokens."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxhost.engine.answer import AnswerReader, new_call_id
from mlxhost.engine.errors import InvalidRequestError
from mlxhost.engine.structure import AnswerPlan, plan_answer, prompt_messages
from mlxhost.engine.types import Message

if TYPE_CHECKING:
    from mlxhost.engine.backends.base import LoadedModel
    from mlxhost.engine.types import GenerationRequest


@dataclass(frozen=True, slots=True)
class Rendered:
    prompt_ids: list[int]
    plan: AnswerPlan


def render(model: LoadedModel, request: GenerationRequest) -> Rendered:
    """Plan the answer and render the prompt (worker-free: call it off the loop, in a thread).

    Raises:
        InvalidRequestError: the tools, tool choice or JSON format cannot be served, a grammar
            does not compile for this model, or the chat template refuses the messages (the
            message names the problem).
    """
    if request.prompt is not None:
        return Rendered(model.encode(request.prompt), AnswerPlan())
    plan = plan_answer(request, native_tools=model.knows_tools, tool_markers=model.tool_markers)
    check_plan(model, plan)
    options = dict(request.template_options)
    if plan.grammar is not None:
        options.setdefault("enable_thinking", False)  # a constrained answer starts at once
    messages = prompt_messages(request.messages, plan, native_tools=model.knows_tools)
    tools = plan.tools if plan.offer_natively else ()
    # Many templates allow a system message only first; a later one (Claude Code's reminders) is
    # then rendered as a user turn that says what it is, instead of failing the request.
    forms = dict.fromkeys((messages, later_system_as_user(messages)))  # one form when no later system
    first_error: Exception | None = None
    for form in forms:
        try:
            prompt_ids = model.render_chat(
                form, tools=tools, options=options, continue_final=request.continue_final
            )
            break
        except Exception as exc:
            first_error = first_error or exc
    else:
        message = f"the model's chat template refused them: {str(first_error)[:200]}"
        raise InvalidRequestError("messages", message) from first_error
    return Rendered(prompt_ids, plan)


def check_answer(model: LoadedModel, request: GenerationRequest) -> None:
    """Plan `request`'s answer and check its grammars, rendering nothing (see `check_plan`).

    Raises:
        InvalidRequestError: as `render` does for the tools, tool choice and JSON format.
    """
    if request.prompt is None:
        check_plan(
            model, plan_answer(request, native_tools=model.knows_tools, tool_markers=model.tool_markers)
        )


def check_plan(model: LoadedModel, plan: AnswerPlan) -> None:
    """Compile the plan's grammar and walk its first steps (cached per model and grammar).

    Each part (the format, each tool's schema) is checked alone first: a walk of the whole
    grammar takes one branch, and the error names the field at fault.

    Raises:
        InvalidRequestError: a part or the whole grammar cannot be served.
    """
    for part, param in plan.parts:
        model.check_grammar(part, param)
    if plan.grammar is not None:
        model.check_grammar(plan.grammar, plan.param)


def later_system_as_user(messages: tuple[Message, ...]) -> tuple[Message, ...]:
    """`messages` with every system message after the first turn as a user message."""
    return tuple(
        Message("user", f"[System note] {m.content}") if m.role == "system" and i > 0 else m
        for i, m in enumerate(messages)
    )


def reader_for(model: LoadedModel, rendered: Rendered, call_id_prefix: str = "call_") -> AnswerReader | None:
    """How the answer's text is read back; None when it is plain text with no markers to find."""
    splitter = model.splitter(rendered.prompt_ids)
    if rendered.plan.mode == "text" and splitter is None:
        return None
    return AnswerReader(rendered.plan, splitter, functools.partial(new_call_id, call_id_prefix))
