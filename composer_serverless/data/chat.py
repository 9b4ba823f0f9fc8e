"""Chat records rendered with the tokenizer's own chat template, and which of their tokens are trained on.

Only the assistant's tokens are learned (the turns' text and their end-of-turn token), as TRL's
``assistant_only_loss`` does: the model is taught to answer, not to write the user's messages. The mask comes
from the template's ``{% generation %}`` markers when it has them; most published templates do not, and then
each assistant turn is located by rendering the conversation up to it: the tokens between "everything before,
with the assistant's header" and "everything through this turn" are that turn's. A template that renders a
conversation's start differently once more turns follow (one that drops earlier reasoning, say) cannot be
masked this way and is refused with the fix, rather than trained on wrongly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Messages = Sequence[dict[str, Any]]
GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")


def render_chat(
    tokenizer: Any, messages: Messages, tools: Sequence[dict[str, Any]] | None = None
) -> tuple[list[int], list[bool]]:
    """The conversation's token ids and, per token, whether it is an assistant token (trained on). ``tools``
    (JSON schemas) are rendered as the template renders them for an agent's prompt (TRL's ``tools`` column).

    Raises:
        ValueError: the tokenizer has no chat template, the conversation has no assistant turn, or the
            template cannot be masked (see the module docstring).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template, so chat records cannot be rendered; use a chat "
            "model's tokenizer, or data.format = 'text' with the text already rendered"
        )
    if not any(m.get("role") == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant turn, so nothing in it would be trained on")
    tools = list(tools) if tools else None
    marked = tokenizer.apply_chat_template(
        list(messages),
        tools=tools,
        tokenize=True,
        return_dict=True,
        # The marker itself: "add_generation_prompt", in nearly every template, is not one.
        return_assistant_tokens_mask=GENERATION_MARKER.search(tokenizer.chat_template) is not None,
    )
    ids = list(marked["input_ids"])
    if any(marked.get("assistant_masks") or ()):
        return ids, [bool(m) for m in marked["assistant_masks"]]
    mask = [False] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _ids(tokenizer, messages[:i], tools, add_generation_prompt=True)
        through = _ids(tokenizer, messages[: i + 1], tools, add_generation_prompt=False)
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise ValueError(
                "the chat template renders a conversation's start differently once more turns follow, so its "
                "assistant turns cannot be located; use a template with {% generation %} markers "
                "(tokenizer.chat_template), or data.format = 'text'"
            )
        mask[len(before) : len(through)] = [True] * (len(through) - len(before))
    return ids, mask


@dataclass(frozen=True)
class Rendered:
    """A prompt as the model reads it. ``templated``: a chat template wrote it, its special tokens (a BOS)
    included, so it is encoded without adding them again, as TRL encodes rendered prompts."""

    text: str
    templated: bool


def render_prompt(
    tokenizer: Any, prompt: str | Messages, as_chat: bool, system: str | None = None
) -> Rendered:
    """A prompt rendered up to where the assistant's answer begins: a conversation (system turns kept) with
    the tokenizer's chat template; a string as the user's turn of one when ``as_chat`` (after the ``system``
    turn, if any), else as it is."""
    if isinstance(prompt, str) and not as_chat:
        return Rendered(prompt, templated=False)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template, so "
            + (
                "conversational prompts cannot be rendered; use a chat model's tokenizer"
                if not isinstance(prompt, str)
                else "set composer.chat_template = false"
            )
        )
    if isinstance(prompt, str):
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": prompt})
    else:
        messages = list(prompt)
    return Rendered(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), templated=True
    )


def _ids(
    tokenizer: Any, messages: Messages, tools: list[dict[str, Any]] | None, *, add_generation_prompt: bool
) -> list[int]:
    if not messages:
        return []
    out = tokenizer.apply_chat_template(
        list(messages),
        tools=tools,
        tokenize=True,
        return_dict=True,
        add_generation_prompt=add_generation_prompt,
    )
    return list(out["input_ids"])
