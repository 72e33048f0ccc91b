"""A request's prompt as its model will read it: one renderer for submit and count_tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxhost.engine.answer import AnswerReader
from mlxhost.engine.structure import AnswerPlan, plan_answer, prompt_messages

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
        InvalidRequestError: the tools, tool choice or JSON format cannot be served, or a grammar
            does not compile for this model (the message names the problem).
    """
    if request.prompt is not None:
        return Rendered(model.encode(request.prompt), AnswerPlan())
    plan = plan_answer(request, native_tools=model.knows_tools)
    if plan.grammar is not None:
        model.check_grammar(plan.grammar)  # compiled once per model and grammar, then cached
    options = dict(request.template_options)
    if plan.grammar is not None:
        options.setdefault("enable_thinking", False)  # a constrained answer starts at once
    prompt_ids = model.render_chat(
        prompt_messages(request.messages, plan, native_tools=model.knows_tools),
        tools=plan.tools if plan.offer_natively else (),
        options=options,
        continue_final=request.continue_final,
    )
    return Rendered(prompt_ids, plan)


def reader_for(model: LoadedModel, rendered: Rendered) -> AnswerReader | None:
    """How the answer's text is read back; None when it is plain text with no markers to find."""
    splitter = model.splitter(rendered.prompt_ids)
    if rendered.plan.mode == "text" and splitter is None:
        return None
    return AnswerReader(rendered.plan, splitter)
