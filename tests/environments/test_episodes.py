"""The episode loop with a scripted model: turns, tool turns, error sites, limits, concurrency, failures."""

import json
import threading
import time

from composer_serverless.environments.episodes import Limits, run_episodes
from composer_serverless.environments.parsing import Malformed, parse_tool_calls
from composer_serverless.environments.protocol import ToolCall
from composer_serverless.environments.tools import ToolEnvironment

LIMITS = Limits(max_turns=4, max_tokens=400, turn_tokens=100, tool_timeout_s=5.0)


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divide.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_calls_are_parsed_in_the_hermes_format_and_malformed_ones_say_why():
    text = f'think {call("add", a=1, b=2)} then <tool_call>{{"name": "add", "arguments": 3}}</tool_call> <tool_call>oops</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed[0] == ToolCall("add", {"a": 1, "b": 2})
    assert parsed[1] == Malformed('{"name": "add", "arguments": 3}', "the call's arguments are not an object")
    assert isinstance(parsed[2], Malformed) and parsed[2].why.startswith(
        "the call is not JSON (Expecting value"
    )
    assert parse_tool_calls("the answer is 3") == []


def test_a_tool_answer_is_a_tool_turn_in_the_template_and_only_model_tokens_are_marked(
    tokenizer, codec, scripted
):
    model = scripted({"Q:1+2?": [call("add", a=1, b=2), "3"]})
    env = ToolEnvironment([add])
    (episode,) = run_episodes(model, [model.prompt_ids("Q:1+2?")], [env], codec, LIMITS)
    eos = tokenizer.eos_token
    assert tokenizer.decode(episode.ids) == f"{call('add', a=1, b=2)}{eos}<|tool|>3</s><|assistant|>3{eos}"
    model_text = tokenizer.decode([t for t, m in zip(episode.ids, episode.model, strict=True) if m])
    assert model_text == f"{call('add', a=1, b=2)}{eos}3{eos}"
    assert (episode.turns, episode.tool_calls, episode.tool_errors, episode.truncated) == (2, 1, 0, False)
    assert episode.messages == [
        {"role": "assistant", "content": call("add", a=1, b=2)},
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "assistant", "content": "3"},
    ]
    assert len(episode.states) == 2 and episode.states[-1] == episode.messages


def test_a_raising_tool_and_a_malformed_call_are_answered_as_errors_and_marked_sites(codec, scripted):
    model = scripted({"Q": [call("divide", a=1, b=0), "<tool_call>nope</tool_call>", "done"]})
    (episode,) = run_episodes(model, [model.prompt_ids("Q")], [ToolEnvironment([divide])], codec, LIMITS)
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == [
        '{"error": "ZeroDivisionError: division by zero"}',
        '{"error": "malformed tool call: the call is not JSON (Expecting value at character 0)"}',
    ]
    assert [(s.kind, s.hint) for s in episode.sites] == [
        ("tool_raised", "divide raised ZeroDivisionError: division by zero"),
        (
            "malformed_call",
            "the tool call 'nope' could not be read: the call is not JSON (Expecting value at character 0)",
        ),
    ]
    # Each site is where the model's next turn begins.
    for site in episode.sites:
        assert episode.model[site.position] and not episode.model[site.position - 1]
    assert (episode.tool_calls, episode.tool_errors, episode.failed) == (2, 2, None)


def test_the_turn_limit_and_the_token_budget_end_an_episode(codec, scripted):
    model = scripted({"A": [call("add", a=1, b=1)] * 2, "B": [call("add", a=1, b=1)] * 2})
    limited = Limits(max_turns=2, max_tokens=400, turn_tokens=100, tool_timeout_s=5.0)
    a, b = run_episodes(
        model, [model.prompt_ids("A"), model.prompt_ids("B")], [ToolEnvironment([add])] * 2, codec, limited
    )
    assert (a.turns, a.tool_calls, a.truncated) == (2, 1, True)  # the second turn's call is never answered
    model = scripted({"A": [call("add", a=1, b=1)]})
    first_turn = len(call("add", a=1, b=1)) + 1
    budget = Limits(max_turns=4, max_tokens=first_turn + 3, turn_tokens=100, tool_timeout_s=5.0)
    (episode,) = run_episodes(model, [model.prompt_ids("A")], [ToolEnvironment([add])], codec, budget)
    # The tool turn would pass the budget: not appended (as TRL rolls it back), the episode truncated.
    assert (len(episode.ids), episode.turns, episode.truncated) == (first_turn, 1, True)


class Overlaps:
    """A tool that sleeps and counts how many of its calls run at the same time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.most = self.total = 0

    def nap(self, seconds: float) -> str:
        """Sleep a while.

        Args:
            seconds: how long
        """
        with self.lock:
            self.now += 1
            self.total += 1
            self.most = max(self.most, self.now)
        time.sleep(seconds)
        with self.lock:
            self.now -= 1
        return "rested"


def test_tool_calls_of_all_episodes_of_a_batch_run_at_once(codec, scripted):
    """8 episodes x 3 sleeping calls each: every turn's 8 calls overlap, so the batch takes 3 sleeps, not
    24 (counted, not timed)."""
    counter = Overlaps()
    prompts = [f"P{i}" for i in range(8)]
    model = scripted({p: [call("nap", seconds=0.2)] * 3 + ["ok"] for p in prompts})
    envs = [ToolEnvironment([counter.nap]) for _ in prompts]
    episodes = run_episodes(model, [model.prompt_ids(p) for p in prompts], envs, codec, LIMITS)
    assert counter.total == 24 and counter.most == 8
    assert model.calls == 4  # one generation per turn for the whole batch
    assert all(e.tool_calls == 3 and e.failed is None for e in episodes)


class Env:
    """A TRL-style environment: public methods are tools, reset gets the row, it owns the reward."""

    def __init__(self) -> None:
        self.secret = 0
        self.guessed = False

    def reset(self, **row) -> str:
        self.secret = row["secret"]
        return " (use the tools)"

    def guess(self, value: int) -> str:
        """Guess the secret.

        Args:
            value: the guess
        """
        self.guessed = value == self.secret
        return "right" if self.guessed else {"error": "wrong", "hint": f"the secret is {self.secret}"}

    def hang(self) -> str:
        """Never answers."""
        threading.Event().wait()
        return ""

    def get_reward(self) -> float:
        return 1.0 if self.guessed else 0.0


def test_an_environment_class_owns_its_reward_and_a_hung_tool_ends_only_its_episode(codec, scripted):
    model = scripted(
        {"A": [call("guess", value=7), "end"], "B": [call("guess", value=3), "end"], "C": [call("hang")]}
    )
    envs = [ToolEnvironment([], Env()) for _ in range(3)]
    for env, secret in zip(envs, (7, 7, 7), strict=True):
        assert env.reset({"secret": secret}) == " (use the tools)"
    fast = Limits(max_turns=4, max_tokens=400, turn_tokens=100, tool_timeout_s=0.3)
    a, b, c = run_episodes(model, [model.prompt_ids(p) for p in "ABC"], envs, codec, fast)
    assert (a.env_reward, a.tool_errors, a.failed) == (1.0, 0, None)
    assert (b.env_reward, b.tool_errors) == (0.0, 1)
    assert [(s.kind, s.hint) for s in b.sites] == [("tool_error", "the secret is 7")]
    assert b.messages[1]["content"] == '{"error": "wrong"}'
    assert c.failed == "tool 'hang' timed out after 0.3 s" and c.env_reward is None and c.turns == 1
