"""Whether a tokenizer's chat template can hold a tool-calling episode: the model must see the tools' schemas
(``apply_chat_template(..., tools=[schema])`` puts them in the text) and the tools' answers (a ``tool`` message
is rendered). A template without either would train a model blind to its tools, so the launcher's model check
refuses it before anything is written.
"""

from __future__ import annotations

from typing import Any

PROBE_TOOL = "composer_probe_lookup"
PROBE_ANSWER = "composer-probe-answer-7391"
PROBE_SCHEMA = {
    "type": "function",
    "function": {
        "name": PROBE_TOOL,
        "description": "Look a key up.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


def tool_template_problem(tokenizer: Any, model: str) -> str | None:
    """What the chat template of ``model``'s tokenizer lacks for tool calling, with the fix; None when it has
    both the tools' schemas and the tool turn."""
    user = {"role": "user", "content": "hello"}
    lacks = []
    try:
        with_tools = tokenizer.apply_chat_template(
            [user], tools=[PROBE_SCHEMA], tokenize=False, add_generation_prompt=True
        )
    except Exception as e:
        with_tools = f"{type(e).__name__}: {e}"
    if PROBE_TOOL not in with_tools:
        lacks.append("rendering with tools=[schema] does not put the tool's schema in the text")
    calls = [{"type": "function", "function": {"name": PROBE_TOOL, "arguments": {"key": "k"}}}]
    turns = [user, {"role": "assistant", "content": "", "tool_calls": calls}]
    try:
        with_answer = tokenizer.apply_chat_template(
            [*turns, {"role": "tool", "name": PROBE_TOOL, "content": PROBE_ANSWER}],
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception as e:
        with_answer = f"{type(e).__name__}: {e}"
    if PROBE_ANSWER not in with_answer:
        lacks.append("a 'tool' message (the tool's answer) is not rendered")
    if not lacks:
        return None
    return (
        f"the chat template of {model} has no tool support: {'; and '.join(lacks)}, so the model would not see "
        "its tools or their answers in an episode\n  fix: use a tool-calling model (e.g. "
        "Qwen/Qwen2.5-0.5B-Instruct), or give the tokenizer a tool-calling chat template (tokenizer.chat_template "
        "in its tokenizer_config.json, e.g. the Hermes/Qwen2.5 one that writes <tool_call> calls)"
    )
