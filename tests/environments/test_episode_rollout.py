"""``rollout`` with episodes on a tiny Llama on the simulated accelerator, the model's turns written by a
scripted engine: episode rewards (message lists to the reward, the environment's own), failures scored 0,
per-episode metrics, and the SDPO batch hinted at the error site."""

import importlib
import json

import pytest
import torch

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.config import HintConfig, RewardConfig
from composer_serverless.data.records import PromptRecord
from composer_serverless.environments.episodes import Limits
from composer_serverless.environments.tools import EnvironmentFactory
from composer_serverless.objectives.engines import Request
from composer_serverless.objectives.episode_rollout import EpisodeSettings
from composer_serverless.objectives.hints import HintBuilder
from composer_serverless.objectives.rewards import RewardSet
from composer_serverless.objectives.rollout import RolloutSettings, rollout
from tests.environments.test_episode_loss import tiny_llama

SEEN: list = []


def answered(completions, **kwargs):
    """TRL's signature: 1 when the episode's last turn is the assistant's."""
    SEEN.extend(completions)
    return [float(c[-1]["role"] == "assistant") for c in completions]


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def reset(self, **row) -> None:
        self.count = 0

    def bump(self, by: int) -> str:
        """Add to the count.

        Args:
            by: how much
        """
        if by < 0:
            raise ValueError("only up")
        self.count += by
        return str(self.count)

    def get_reward(self) -> float:
        return float(self.count)


def call(by) -> str:
    return "<tool_call>" + json.dumps({"name": "bump", "arguments": {"by": by}}) + "</tool_call>"


class ScriptedEngine:
    """Writes, per row of the first request, its scripted turns in order (rows of later requests are the
    episodes still going, in the same order)."""

    name = "scripted"

    def __init__(self, tokenizer, rows) -> None:
        self.tokenizer, self.rows, self.live = tokenizer, [list(r) for r in rows], None

    def complete(self, model, request: Request) -> list[list[int]]:
        if self.live is None:
            self.live = list(range(len(self.rows)))
        out, going = [], []
        for i in self.live[: len(request.prompts)]:
            text = self.rows[i].pop(0)
            out.append(
                self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            )
            if self.rows[i]:
                going.append(i)
        self.live = going
        return out


def test_episode_rollout_scores_counts_and_hints_at_the_error_site(tokenizer):
    records = [PromptRecord("Count.", {"answer": "x"})]
    engine = ScriptedEngine(tokenizer, [[call(2), "done"], [call(-1), "done"]])
    settings = RolloutSettings(
        group_size=2,
        prompts_per_step=1,
        max_new_tokens=100,
        temperature=1.0,
        engine=engine,
        episodes=EpisodeSettings(
            factory=EnvironmentFactory((), Counter),
            limits=Limits(max_turns=3, max_tokens=300, turn_tokens=100, tool_timeout_s=5.0),
            hint=" Hint: {hint}",
            environment_reward_weight=0.5,
        ),
    )
    # The reward is imported by its path, which may be another copy of this module than pytest's.
    seen = importlib.import_module("tests.environments.test_episode_rollout").SEEN
    seen.clear()
    with simulated():
        model = tiny_llama(tokenizer).to("cuda")
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        rolled = rollout(
            model,
            tokenizer,
            lambda n: records[:n],
            RewardSet([RewardConfig(fn="tests.environments.test_episode_rollout:answered")]),
            HintBuilder(HintConfig()),
            settings,
        )
    assert seen[0] == [
        {"role": "assistant", "content": call(2)},
        {"role": "tool", "name": "bump", "content": "2"},
        {"role": "assistant", "content": "done"},
    ]
    assert seen[1][1] == {"role": "tool", "name": "bump", "content": '{"error": "ValueError: only up"}'}
    assert rolled.scored.by_reward == {"answered": [1.0, 1.0], "Counter": [2.0, 0.0]}
    assert rolled.scored.totals == [1.0 + 0.5 * 2.0, 1.0]
    assert rolled.metrics["rollout/turns"] == 2.0 and rolled.metrics["rollout/tool_calls"] == 1.0
    assert rolled.metrics["rollout/tool_errors"] == 0.5 and rolled.metrics["rollout/episodes_failed"] == 0.0
    assert rolled.rl.loss_mask is not None and rolled.rl.advantages.tolist() == pytest.approx(
        [0.5 / (2**-0.5 + 1e-4), -0.5 / (2**-0.5 + 1e-4)]
    )
    # (r - mean) / (unbiased std + 1e-4), r = [2, 1]
    distill = rolled.hint.distill_mask
    assert not distill[0].any()  # no error site, no feedback: not distilled
    assert distill[1].sum() == len("done") + 1  # the turn after the site, its EOS included
    assert torch.equal(distill[1].bool(), distill[1].bool() & rolled.rl.loss_mask[1].bool())


def test_an_episode_whose_environment_failed_scores_0_whatever_its_rewards_say():
    from composer_serverless.environments.episodes import Episode
    from composer_serverless.objectives.episode_rollout import score_episodes

    settings = EpisodeSettings(
        factory=EnvironmentFactory((), Counter),
        limits=Limits(max_turns=3, max_tokens=300, turn_tokens=100, tool_timeout_s=5.0),
        hint=" Hint: {hint}",
        environment_reward_weight=1.0,
    )
    done = [{"role": "assistant", "content": "done"}]
    fine = Episode([1], messages=done, env_reward=3.0)
    failed = Episode([1], messages=done, env_reward=None, failed="tool 'bump' timed out after 5 s")
    rewards = RewardSet([RewardConfig(fn="tests.environments.test_episode_rollout:answered")])
    records = [PromptRecord("Count.")] * 2
    scored = score_episodes([fine, failed], records, rewards, settings)
    assert scored.totals == [4.0, 0.0]
    assert scored.by_reward == {"answered": [1.0, 1.0], "Counter": [3.0, None]}
