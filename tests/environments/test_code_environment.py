"""The built-in code environment (``builtin:code``) through the episode loop, its code run in the real sandbox:
the submission's tests decide the reward and end the episode, a program that raises or never ends is an error
site, and the config names the built-in or says which there are."""

import json

import pytest
from pydantic import ValidationError

from composer_serverless.config.composer import EpisodesConfig
from composer_serverless.environments.builtin import environment_factory
from composer_serverless.environments.code import CodeEnvironment, CodeEnvironments
from composer_serverless.environments.episodes import Limits, run_episodes
from composer_serverless.environments.protocol import ToolCall

LIMITS = Limits(max_turns=4, max_tokens=2000, turn_tokens=400, tool_timeout_s=20.0)
ROW = {"prompt": "Write double(x).", "tests": ["assert double(2) == 4", "assert double(-1) == -2"]}
DOUBLE = "def double(x):\n    return 2 * x\n"


def call(name: str, code: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"code": code}}) + "</tool_call>"


def episode_of(scripted, codec, turns, row=ROW, timeout_s=10.0):
    environment = CodeEnvironments(timeout_s)()
    environment.reset(row)
    model = scripted({"Q": turns})
    (episode,) = run_episodes(model, [model.prompt_ids("Q")], [environment], codec, LIMITS)
    return episode, environment


def tool_answers(episode):
    return [m["content"] for m in episode.messages if m["role"] == "tool"]


def test_a_correct_submission_scores_1_and_ends_the_episode(scripted, codec):
    episode, environment = episode_of(
        scripted, codec, [call("run_code", DOUBLE + "print(double(21))"), call("submit", DOUBLE), "never"]
    )
    assert tool_answers(episode) == ["stdout:\n42\n", "2/2 tests passed"]
    assert (episode.turns, episode.tool_calls, episode.tool_errors, episode.sites) == (2, 2, 0, [])
    assert episode.env_reward == 1.0 and episode.failed is None and not episode.truncated
    assert environment.state() == {"submitted": True, "passed": 2, "tests": 2, "runs": 1}


def test_a_submission_that_fails_a_test_scores_the_share_it_passes(scripted, codec):
    episode, _ = episode_of(scripted, codec, [call("submit", "def double(x):\n    return x + 2\n")])
    assert tool_answers(episode) == [
        "1/2 tests passed; first failure: assert double(-1) == -2 -> AssertionError"
    ]
    assert episode.env_reward == 0.5
    assert episode.sites == []  # it ends the episode: no token after it for a hint to teach


def test_a_run_that_raises_is_an_error_site_hinted_with_the_tracebacks_last_line(scripted, codec):
    episode, _ = episode_of(
        scripted,
        codec,
        [call("run_code", "print('before')\nx = {}\nx['key']\n"), call("submit", DOUBLE)],
    )
    answer = tool_answers(episode)[0]
    assert answer.startswith("stdout:\nbefore\n\nstderr:\nTraceback (most recent call last):\n")
    assert answer.endswith("    x['key']\n    ~^^^^^^^\nKeyError: 'key'\n")
    ((site),) = episode.sites
    assert (site.kind, site.hint) == ("code_raised", "KeyError: 'key'")
    # The site is after the first tool turn: the next model token, where the teacher's hint goes in.
    assert episode.model[site.position] and not episode.model[site.position - 1]
    assert episode.env_reward == 1.0 and episode.tool_errors == 1


def test_an_endless_loop_is_stopped_by_the_sandbox_and_the_episode_goes_on(scripted, codec):
    episode, _ = episode_of(
        scripted,
        codec,
        [call("run_code", "print('spin')\nwhile True:\n    pass\n"), "I give up"],
        timeout_s=1.0,
    )
    assert tool_answers(episode) == ["stopped: the program timed out after 1s"]
    assert [(s.kind, s.hint) for s in episode.sites] == [("code_timeout", "timed out after 1s")]
    assert episode.failed is None and episode.turns == 2  # the sandbox answered, before the tool timeout
    assert episode.env_reward == 0.0  # it never submitted


def test_a_call_the_environment_cannot_take_is_answered_as_an_error():
    environment = CodeEnvironment(timeout_s=5.0)
    environment.reset({"tests": "assert True"})
    assert environment.tests == ("assert True",)
    unknown = environment.step(ToolCall("shell", {"code": "ls"}))
    assert unknown.error.kind == "unknown_tool" and "the tools are run_code, submit" in unknown.error.hint
    wrong = environment.step(ToolCall("run_code", {"source": "print(1)"}))
    assert wrong.error.kind == "bad_arguments" and "['source']" in wrong.error.hint
    assert [t["function"]["name"] for t in environment.tools] == ["run_code", "submit"]
    assert environment.tools[0]["function"]["parameters"]["required"] == ["code"]


def test_a_row_without_tests_cannot_start_an_episode():
    with pytest.raises(ValueError, match="builtin:code needs a 'tests' column on every row"):
        CodeEnvironment(timeout_s=5.0).reset({"prompt": "p", "tests": []})


def test_the_config_names_the_builtin_and_its_sandbox_time_limit():
    episodes = EpisodesConfig(environment="builtin:code", code_timeout_s=2.0)
    factory = environment_factory(episodes, None)
    assert factory == CodeEnvironments(2.0) and factory.owns_reward
    assert episodes.builtin == "code" and episodes.files == []
    with pytest.raises(
        ValidationError, match="'builtin:shell' is no built-in environment; the built-ins are: builtin:code"
    ):
        EpisodesConfig(environment="builtin:shell")
    with pytest.raises(ValidationError, match=r"code_timeout_s \(30\) must be below tool_timeout_s \(30\)"):
        EpisodesConfig(environment="builtin:code", code_timeout_s=30.0)
    with pytest.raises(ValidationError, match="'builtin:code' brings its own tools"):
        EpisodesConfig(environment="builtin:code", tools=["my_tools.py:lookup"])
