"""Qwen2.5-Instruct's real tool-calling chat template (composer_serverless/models/templates/qwen2.5.jinja, the
``chat_template`` of Qwen/Qwen2.5-0.5B-Instruct's tokenizer_config.json, taken from a public copy on GitHub:
gorilla's BFCL Qwen handler quotes it whole) with our episode loop, and the calculator recipe built on it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from composer_serverless.cli import run as cli_run
from composer_serverless.data.records import PromptRecord
from composer_serverless.environments.episodes import Limits
from composer_serverless.environments.tensors import trajectory_tensors
from composer_serverless.environments.tools import EnvironmentFactory
from composer_serverless.models.loading import char_tokenizer
from composer_serverless.objectives.engines import Request
from composer_serverless.objectives.episode_rollout import EpisodeSettings, run_step_episodes

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"
RECIPE = CONFIGS / "calculator-qwen2.5-0.5b.toml"
SCHEMA = (
    '{"type": "function", "function": {"name": "calculate", "description": "Evaluate an arithmetic expression, '
    'such as 48 / 2 + 48.", "parameters": {"type": "object", "properties": {"expression": {"type": "string", '
    '"description": "numbers with + - * / // % and parentheses"}}, "required": ["expression"]}, "return": '
    '{"type": "string"}}}'
)
# How Qwen2.5's template writes the prompt with tools, and a tool call, by hand from its published format.
PROMPT = (
    "<|im_start|>system\nAdd.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + SCHEMA
    + "\n</tools>"
    "\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call><|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
)
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'
TOOL_TURN = "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


class Scripted:
    """An engine that writes the given turns, one per call, as the model would (each ending in EOS)."""

    name = "scripted"

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        self.turns = [
            tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in turns
        ]

    def complete(self, model: torch.nn.Module, request: Request) -> list[list[int]]:
        return [self.turns.pop(0) for _ in request.prompts]


def test_qwen_template_renders_tools_and_the_assistants_call_as_published():
    tokenizer = char_tokenizer(None, "qwen2.5")
    tools = EnvironmentFactory.load(("calculator.py:calculate",), None, CONFIGS)().tools
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 2+3?"}]
    assert (
        tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        == PROMPT
    )
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "2+3"}}}
    turn = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]}]
    assert tokenizer.apply_chat_template(turn, tools=tools, tokenize=False) == PROMPT + CALL + "<|im_end|>\n"


def test_an_episode_under_qwens_template_parses_its_call_renders_the_tool_turn_and_masks_only_the_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer(None, "qwen2.5")
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    settings = EpisodeSettings(
        factory=EnvironmentFactory.load(("calculator.py:calculate",), None, CONFIGS),
        limits=Limits(max_turns=3, max_tokens=400, turn_tokens=100, tool_timeout_s=5.0),
        hint=" Hint: {hint}",
        environment_reward_weight=1.0,
        system_prompt="Add.",
    )
    record = PromptRecord(prompt="What is 2+3?", columns={})
    engine = Scripted(tokenizer, [CALL, "#### 5"])
    eos = [tokenizer.eos_token_id]
    [episode] = run_step_episodes(model, tokenizer, [record], settings, engine, 1.0, eos)

    assert tokenizer.decode(episode.prompt_ids) == PROMPT
    assert episode.tool_calls == 1 and episode.tool_errors == 0 and episode.turns == 2
    assert episode.messages == [
        {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "calculate", "content": "5"},
        {"role": "assistant", "content": "#### 5"},
    ]
    assert tokenizer.decode(episode.ids) == CALL + "<|im_end|>" + TOOL_TURN + "#### 5<|im_end|>"
    mask = trajectory_tensors([episode], tokenizer.pad_token_id, torch.device("cpu"))["loss_mask"][0]
    model_text = tokenizer.decode([i for i, m in zip(episode.ids, mask.tolist(), strict=True) if m])
    other_text = tokenizer.decode([i for i, m in zip(episode.ids, mask.tolist(), strict=True) if not m])
    assert model_text == CALL + "<|im_end|>" + "#### 5<|im_end|>"
    assert other_text == TOOL_TURN


def test_the_calculator_recipe_loads_and_its_dry_run_passes_with_the_model_unchecked(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache: the model is not in it
    assert cli_run(["launch", str(RECIPE), "--dry-run"]) == 0
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "model: not checked: model.path 'Qwen/Qwen2.5-0.5B-Instruct'" in out
    assert '"calculator.py"' in out and '"gsm8k_reward.py"' in out
    assert not (tmp_path / "runs").exists()


def test_a_chat_template_on_the_bpe_tokenizer_or_a_tools_column_that_is_no_list_is_refused(tmp_path):
    import pydantic
    import pytest

    from composer_serverless.config import DataConfig, TinyModelConfig
    from composer_serverless.data.corpus import documents
    from composer_serverless.data.records import RecordError

    with pytest.raises(pydantic.ValidationError, match="chat_template is for tokenizer = 'chars'"):
        TinyModelConfig(chat_template="qwen2.5")
    bad = tmp_path / "chats.jsonl"
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    bad.write_text(json.dumps({"messages": turns, "tools": {"name": "calculate"}}) + "\n")
    with pytest.raises(RecordError, match="chats.jsonl:1: 'tools' must be a list of JSON-schema objects"):
        documents(DataConfig(corpus=str(bad), format="chat", heldout=str(bad)))
