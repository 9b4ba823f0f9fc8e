"""OpenEnv environments: episodes driven through OpenEnv's own client against an OpenEnv server on loopback
(``openenv_vault``: an ``MCPEnvironment`` served by openenv-core's ``create_fastapi_app``)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from composer_serverless.cli import run as cli_run
from composer_serverless.config.composer import EpisodesConfig
from composer_serverless.environments.episodes import Limits, run_episodes
from composer_serverless.environments.openenv import OpenEnvFactory, OpenEnvUnreachable, answer, reset_text
from composer_serverless.environments.protocol import ErrorMark, Step, ToolCall
from tests.environments.conftest import trained_rows
from tests.environments.openenv_vault import Vault, free_port, serving
from tests.environments.test_agent_task import write_task

LIMITS = Limits(max_turns=4, max_tokens=600, turn_tokens=100, tool_timeout_s=10.0)
DOCS = Path(__file__).parents[2] / "docs" / "coming-from-trl.md"


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.fixture(scope="module")
def vault_url():
    with serving() as url:
        yield url


def test_the_servers_tools_reward_and_done_drive_the_episodes(vault_url, tokenizer, codec, scripted):
    model = scripted(
        {
            "A:": [
                call("lookup", key="vault"),
                call("open", code="7"),
                "never written: the server said done",
            ],
            "B:": [call("open", code="1"), call("nope"), "I give up"],
        }
    )
    factory = OpenEnvFactory(vault_url, 10.0)
    environments = [factory(), factory()]
    assert environments[0].reset({"prompt": "A:", "secret": "7"}) is None
    assert environments[1].reset({"prompt": "B:", "secret": "9"}) is None
    assert [t["function"]["name"] for t in environments[0].tools] == ["lookup", "open"]
    assert environments[0].tools[1] == {
        "type": "function",
        "function": {
            "name": "open",
            "description": "Try a code on the vault.",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"code": {"type": "string", "description": "the code to try"}},
                "required": ["code"],
            },
        },
    }
    a, b = run_episodes(model, [model.prompt_ids("A:"), model.prompt_ids("B:")], environments, codec, LIMITS)
    assert [m["content"] for m in a.messages if m["role"] == "tool"] == ["the code is 7", "open"]
    assert (a.turns, a.tool_calls, a.tool_errors, a.env_reward, a.failed, a.sites) == (2, 2, 0, 1.0, None, [])
    assert [m["content"] for m in b.messages if m["role"] == "tool"] == [
        json.dumps({"error": "Error calling tool 'open': wrong code"}),
        json.dumps({"error": "Unknown tool: 'nope'"}),
    ]
    assert (b.turns, b.tool_errors, b.env_reward, b.failed) == (3, 2, 0.0, None)
    assert [(s.kind, s.hint) for s in b.sites] == [
        ("tool_error", "Error calling tool 'open': wrong code"),
        ("unknown_tool", "Unknown tool: 'nope'"),
    ]
    # Each site is the first token after its tool turn.
    assert [s.position for s in b.sites] == [
        i + 1 for i, (m, n) in enumerate(zip(b.model, b.model[1:], strict=False)) if not m and n
    ]
    assert all(e._client is None for e in environments)  # the loop closed both sessions


def test_the_state_is_the_servers(vault_url):
    environment = OpenEnvFactory(vault_url, 10.0)()
    environment.reset({"secret": "3"})
    try:
        assert environment.step(ToolCall("open", {"code": "3"})) == Step("open", done=True)
        assert environment.state() == {"episode_id": None, "step_count": 1, "opened": True}
    finally:
        environment.close()


def test_a_server_that_goes_away_ends_the_episode_not_the_run(tokenizer, codec, scripted):
    model = scripted({"A:": [call("lookup", key="vault"), "unused"]})
    with serving() as url:
        environment = OpenEnvFactory(url, 10.0)()
        environment.reset({"secret": "7"})
    (episode,) = run_episodes(model, [model.prompt_ids("A:")], [environment], codec, LIMITS)
    assert episode.failed is not None and episode.failed.startswith("tool 'lookup' raised ")
    assert episode.env_reward is None


def test_a_server_that_does_not_answer_says_what_was_tried():
    port = free_port()
    environment = OpenEnvFactory(f"http://127.0.0.1:{port}", 10.0)()
    with pytest.raises(OpenEnvUnreachable) as raised:
        environment.reset({})
    assert str(raised.value).startswith(
        f"the OpenEnv server at http://127.0.0.1:{port} does not answer: Failed to connect to "
        f"ws://127.0.0.1:{port}/ws: "
    )


@pytest.mark.parametrize(
    ("observation", "step"),
    [
        (
            {
                "result": {
                    "content": [],
                    "structured_content": {"result": [1, 2]},
                    "data": [1, 2],
                    "is_error": False,
                }
            },
            Step("[1, 2]"),
        ),
        (
            {"result": {"content": [{"type": "text", "text": "no such file"}], "is_error": True}},
            Step('{"error": "no such file"}', error=ErrorMark("tool_error", "no such file")),
        ),
        (
            {
                "result": None,
                "error": {"error_type": "timeout", "message": "Tool 'x' timed out after 30 seconds"},
            },
            Step(
                '{"error": "Tool \'x\' timed out after 30 seconds"}',
                error=ErrorMark("tool_error", "Tool 'x' timed out after 30 seconds"),
            ),
        ),
    ],
)
def test_an_mcp_result_without_text_is_json_and_one_marked_as_an_error_is_an_error_site(observation, step):
    assert answer({"tool_name": "x", **observation}, False) == step


def test_a_reset_observation_adds_its_text_to_the_prompt():
    assert reset_text({}) is None
    assert reset_text({"prompt": "", "echoed_message": "Open the vault."}) == "Open the vault."
    assert reset_text({"board": [[0, 1]], "turn": "x"}) == '{"board": [[0, 1]], "turn": "x"}'


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"openenv_url": "localhost:8000"}, "openenv_url 'localhost:8000' is not a server address"),
        ({"openenv_url": "ftp://h:1"}, "is not a server address"),
        (
            {"openenv_url": "http://h:1", "environment": "e.py:E"},
            "openenv_url is an environment of its own, its tools the server's",
        ),
    ],
)
def test_an_openenv_url_is_validated(fields, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        EpisodesConfig(**fields)
    assert EpisodesConfig(openenv_url="http://127.0.0.1:8000/").openenv_url == "http://127.0.0.1:8000"


def docs_example() -> str:
    """The [composer.episodes] table of the OpenEnv example in docs/coming-from-trl.md."""
    blocks = re.findall(r"```toml\n(.*?)```", DOCS.read_text(), re.DOTALL)
    (block,) = [b for b in blocks if "openenv_url" in b]
    return block


def openenv_task(root: Path, model: Path, url: str) -> Path:
    """The agent task of test_agent_task with the docs' OpenEnv table instead of its tools and environment."""
    config = write_task(root, model)
    text = config.read_text()
    table = re.search(r"\[composer\.episodes\]\n(?:[^\[\n][^\n]*\n)*", text).group(0)
    example = docs_example().replace("http://127.0.0.1:8000", url)
    config.write_text(text.replace(table, example + "max_tokens = 48\n\n"))
    return config


@pytest.mark.slow
@pytest.mark.parametrize("dry_run", [False, True])
def test_an_openenv_url_that_does_not_answer_exits_2_before_anything_is_written(
    tmp_path, tool_chat_model_dir, capsys, monkeypatch, dry_run
):
    port = free_port()
    config = openenv_task(tmp_path / "task", tool_chat_model_dir, f"http://127.0.0.1:{port}")
    monkeypatch.chdir(config.parent)
    args = ["launch", str(config), "--set", "run_id=agent", *(["--dry-run"] if dry_run else [])]
    assert cli_run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the rewards, tools or environment cannot be used as configured:\n  ")
    assert f"the OpenEnv server at http://127.0.0.1:{port} does not answer: Failed to connect to " in err
    assert f"ws://127.0.0.1:{port}/ws" in err and "fix: start the environment server" in err
    assert not (tmp_path / "task" / "runs").exists()


@pytest.mark.slow
def test_a_chat_template_without_tool_support_is_refused_before_anything_is_written(
    tmp_path, chat_model_dir, capsys, monkeypatch
):
    config = write_task(tmp_path / "task", chat_model_dir)
    monkeypatch.chdir(config.parent)
    assert cli_run(["launch", str(config), "--set", "run_id=agent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the model cannot be trained as configured:\n  ")
    assert (
        f"the chat template of {chat_model_dir} has no tool support: rendering with tools=[schema] does not "
        "put the tool's schema in the text, so the model would not see its tools or their answers" in err
    )
    assert "fix: use a tool-calling model" in err
    assert not (tmp_path / "task" / "runs").exists()


@pytest.mark.slow
def test_an_openenv_server_drives_two_replicas_training(
    tmp_path, tool_chat_model_dir, monkeypatch, vault_url
):
    Vault.events.clear()
    trained = trained_rows(
        openenv_task(tmp_path / "task", tool_chat_model_dir, vault_url), "agent", 2, monkeypatch
    )
    assert all({"rollout/turns", "rollout/tool_calls", "rollout/tool_errors"} <= t.keys() for t in trained)
    # Every episode was a session on the server, reset on its row: the launch's check (1), training (2 replicas
    # x 2 rounds x 2 steps x 2 prompts x 2 episodes) and the held-out evaluations of rounds 0, 1, 2 (4 each).
    assert Vault.events["resets"] == Vault.events["sessions"] == 1 + 2 * 2 * 2 * 2 * 2 + 3 * 4
    for _ in range(300):  # the server closes a session once it sees its socket closed (its own thread)
        if Vault.events["closed"] == Vault.events["sessions"]:
            break
        time.sleep(0.1)
    assert Vault.events["closed"] == Vault.events["sessions"]  # nothing left open
    assert all(t["rollout/episodes_failed"] == 0 for t in trained)


def test_the_template_check_names_what_a_template_lacks(tokenizer):
    from composer_serverless.environments.template import tool_template_problem
    from tests.conftest import CHATML, TOOL_CHATML

    tokenizer.chat_template = TOOL_CHATML
    assert tool_template_problem(tokenizer, "m") is None
    tokenizer.chat_template = CHATML  # renders every message's content, a tool's too, but never the tools
    assert tool_template_problem(tokenizer, "m").startswith(
        "the chat template of m has no tool support: rendering with tools=[schema] does not put the tool's "
        "schema in the text, so"
    )
    # Renders the tools, but only user and assistant turns: the tool's answer is lost.
    tokenizer.chat_template = (
        "{{ tools | tojson }}{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}"
        "{{ m['content'] }}{% endif %}{% endfor %}"
    )
    assert tool_template_problem(tokenizer, "m").startswith(
        "the chat template of m has no tool support: a 'tool' message (the tool's answer) is not rendered, so"
    )
    tokenizer.chat_template = None
    assert (
        "rendering with tools=[schema] does not put the tool's schema in the text; and a 'tool' message"
        in (tool_template_problem(tokenizer, "m"))
    )
