"""Trace replay end to end: two episodes on a tiny Llama (the simulated accelerator, a scripted engine) become
traces with one state per turn, recorded where a run's rollouts live; the harvest asks three loopback teachers
at each distinct state, sending the conversation of that state (tool calls structured, the tools' schemas
given); the pairs are per state and train the replay channel on the action's tokens with the state, rendered
with the tools, as the prompt."""

from __future__ import annotations

import asyncio
import importlib
import json
from fractions import Fraction

import pytest
import torch

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.config import RewardConfig
from composer_serverless.data.records import PromptRecord, pairs_from_jsonl
from composer_serverless.environments.episodes import Limits
from composer_serverless.environments.tools import EnvironmentFactory
from composer_serverless.environments.traces import trace_rows
from composer_serverless.harvest.cache import AnswerCache
from composer_serverless.harvest.costs import Budget
from composer_serverless.harvest.harvester import harvest, pairs_jsonl
from composer_serverless.harvest.states import read_rollouts
from composer_serverless.losses.batches import LossBatch
from composer_serverless.losses.compose import LossSettings, three_channel_loss
from composer_serverless.losses.replay import ReplaySettings
from composer_serverless.models.loading import char_tokenizer
from composer_serverless.objectives.episode_rollout import EpisodeSettings
from composer_serverless.objectives.pairs import ReplayPairs
from composer_serverless.objectives.rewards import RewardSet
from composer_serverless.objectives.rollout import RolloutSettings, rollout
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from tests.environments.test_episode_loss import tiny_llama
from tests.environments.test_episode_rollout import Counter, ScriptedEngine, call
from tests.harvest.conftest import harvest_config
from tests.harvest.fake_teacher import Behaviour

# ChatML that renders the tools' schemas first, as tool-calling templates do (``tools=``).
TOOLS_CHATML = (
    "{% if tools %}<|tools|>{{ tools | tojson }}</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = [{"role": "user", "content": "Count."}]
BUMP_2 = [{"role": "assistant", "content": call(2)}, {"role": "tool", "name": "bump", "content": "2"}]
BUMP_MINUS = [
    {"role": "assistant", "content": call(-1)},
    {"role": "tool", "name": "bump", "content": '{"error": "ValueError: only up"}'},
]


def answered(completions, **kwargs):
    """1 when the episode's last turn is the assistant's answer "done"."""
    return [float(c[-1] == {"role": "assistant", "content": "done"}) for c in completions]


def canonical(value) -> str:
    return json.dumps(value, sort_keys=True)


@pytest.fixture
def tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TOOLS_CHATML
    return tokenizer


def episodes_rolled(tokenizer, model):
    """Episode 0 bumps by 2 and answers "done"; episode 1 bumps by -1 (the tool raises: an error site) and
    answers "oops"."""
    importlib.import_module("tests.harvest.test_trace_harvest")  # the reward is imported by its path
    settings = RolloutSettings(
        group_size=2,
        prompts_per_step=1,
        max_new_tokens=100,
        temperature=1.0,
        engine=ScriptedEngine(tokenizer, [[call(2), "done"], [call(-1), "oops"]]),
        episodes=EpisodeSettings(
            factory=EnvironmentFactory((), Counter),
            limits=Limits(max_turns=3, max_tokens=400, turn_tokens=100, tool_timeout_s=5.0),
            hint=" Hint: {hint}",
            environment_reward_weight=0.5,
        ),
    )
    return rollout(
        model,
        tokenizer,
        lambda n: [PromptRecord("Count.", {"answer": "x"})][:n],
        RewardSet([RewardConfig(fn="tests.harvest.test_trace_harvest:answered")]),
        None,
        settings,
    )


def test_a_trace_has_one_state_per_turn_and_the_harvest_asks_the_teachers_at_each(
    tmp_path, tokenizer, teachers
):
    with simulated():
        model = tiny_llama(tokenizer).to("cuda")
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        rolled = episodes_rolled(tokenizer, model)
        assert rolled.episodes is not None
        schemas = rolled.episodes[0].tools
        assert [s["function"]["name"] for s in schemas] == ["bump"]

        # One state per turn: the conversation before it, the action, the error its answers raised.
        rows = [
            trace_rows(e, reward, "count")
            for e, reward in zip(rolled.episodes, rolled.scored.totals, strict=True)
        ]
        assert [(r["turn"], r["prompt"], r["student"], r["error"], r["reward"]) for r in rows[0]] == [
            (0, PROMPT, call(2), None, None),
            (1, PROMPT + BUMP_2, "done", None, 1.0 + 0.5 * 2.0),
        ]
        assert [(r["turn"], r["prompt"], r["student"], r["reward"]) for r in rows[1]] == [
            (0, PROMPT, call(-1), None),
            (1, PROMPT + BUMP_MINUS, "oops", 0.0),
        ]
        assert rows[1][0]["error"] == {"kind": "tool_raised", "hint": "bump raised ValueError: only up"}
        assert rows[1][1]["error"] is None and len(rolled.episodes[1].sites) == 1

        # Recorded where a run's rollouts live, read back as the harvest reads them.
        run = ObjectStore(str(tmp_path / "run"))
        lines = [
            {"id": f"e{n}-t{r['turn']}", "episode": f"e{n}", **r} for n, rs in enumerate(rows) for r in rs
        ]
        run.put(layout.rollouts(1, 0), "".join(json.dumps(r) + "\n" for r in lines).encode())
        states = read_rollouts(run, 1)
        assert [s.id for s in states] == ["e0-t0", "e0-t1", "e1-t0", "e1-t1"]
        assert all(s.tools == tuple(schemas) for s in states)

        # Three teachers, each asked once at each distinct state (both episodes' first states are one).
        fakes = teachers(3, key=None, script=lambda prompt, attempt: Behaviour(answer="done"))
        config = harvest_config(fakes, key_env=None, threshold=2)
        result = asyncio.run(harvest(states, config, AnswerCache(run.child("cache")), Budget(Fraction(10))))
        for fake in fakes:
            sent = sorted((s.body["messages"] for s in fake.seen), key=canonical)
            assert sent == sorted(
                [
                    PROMPT,
                    PROMPT
                    + [
                        {
                            "role": "assistant",
                            "content": call(2),
                            "tool_calls": [
                                {
                                    "id": "call_1_0",
                                    "type": "function",
                                    "function": {"name": "bump", "arguments": '{"by": 2}'},
                                }
                            ],
                        },
                        {"role": "tool", "tool_call_id": "call_1_0", "content": "2"},
                    ],
                    PROMPT
                    + [
                        {
                            "role": "assistant",
                            "content": call(-1),
                            "tool_calls": [
                                {
                                    "id": "call_1_0",
                                    "type": "function",
                                    "function": {"name": "bump", "arguments": '{"by": -1}'},
                                }
                            ],
                        },
                        {"role": "tool", "tool_call_id": "call_1_0", "content": BUMP_MINUS[1]["content"]},
                    ],
                ],
                key=canonical,
            )
            assert all(s.body["tools"] == schemas for s in fake.seen)

        # Pairs per state: the teachers' "done" over the student's action where they differ.
        assert result.prompts == 3 and result.student_agreed == 1
        got = {(canonical(p["prompt"]), p["rejected"]): p for p in result.pairs}
        assert set(got) == {
            (canonical(PROMPT), call(2)),
            (canonical(PROMPT), call(-1)),
            (canonical(PROMPT + BUMP_MINUS), "oops"),
        }
        assert got[(canonical(PROMPT), call(2))]["provenance"]["states"] == ["e0-t0"]
        assert got[(canonical(PROMPT), call(-1))]["provenance"]["states"] == ["e1-t0"]
        assert got[(canonical(PROMPT + BUMP_MINUS), "oops")]["provenance"]["states"] == ["e1-t1"]
        assert all(p["chosen"] == "done" and p["tools"] == schemas for p in result.pairs)

        # The pairs load into the replay channel: the state rendered with the tools is the prompt, the
        # action's tokens (and EOS) the completion; the loss is finite and has a gradient.
        pairs = pairs_from_jsonl(pairs_jsonl(result.pairs), "pairs.jsonl")
        replay = ReplayPairs(pairs, tokenizer, per_step=3, seed=0, reference=model, chunk_tokens=64)
        batch = replay.next(torch.device("cuda"))
        assert batch is not None
        state = next(p for p in pairs if p.rejected == "oops")
        row = [p.rejected for p in pairs].index("oops")
        rendered = tokenizer.apply_chat_template(
            list(state.prompt), tools=list(state.tools), tokenize=False, add_generation_prompt=True
        )
        assert rendered.startswith("<|tools|>") and rendered.endswith(
            "<|tool|>" + BUMP_MINUS[1]["content"] + "</s><|assistant|>"
        )
        prompt_ids = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
        assert prompt_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        rejected = batch.rejected_ids[row][batch.rejected_mask[row].bool()].tolist()
        assert rejected == tokenizer("oops", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        settings = LossSettings(alpha=0.0, beta=1.0, replay=ReplaySettings(kind="dpo"))
        model.zero_grad()
        loss, metrics = three_channel_loss(model, LossBatch(replay=batch), settings)
        assert torch.isfinite(loss) and metrics["replay/pairs"] == 3
        # The reference is the model itself: every margin is 0, so DPO's loss is exactly log 2.
        assert loss.item() == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-5)
        loss.backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
