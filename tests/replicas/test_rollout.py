"""Rollouts against a tiny Llama: padding, masks, pure sampling, the GRPO and SDPO batches they build."""

import pytest
import torch

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.config import HintConfig, RewardConfig
from composer_serverless.data.chat import render_prompt
from composer_serverless.data.records import PromptRecord
from composer_serverless.losses.batches import LossBatch
from composer_serverless.losses.compose import LossSettings, three_channel_loss
from composer_serverless.objectives.hints import HintBuilder
from composer_serverless.objectives.rewards import RewardSet
from composer_serverless.objectives.rollout import (
    RolloutSettings,
    encode_prompts,
    generate,
    overlong_punishment,
    rollout,
)

PROMPTS = ["add 2 3=", "first 853=", "max 1=", "sort 592="]


def test_prompts_are_left_padded(tokenizer):
    ids, mask = encode_prompts(tokenizer, ["ab", "abcd"], torch.device("cpu"))
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert ids[0, :2].tolist() == [tokenizer.pad_token_id] * 2
    assert tokenizer.decode(ids[0, 2:]) == "ab"


def test_samples_have_the_loss_layout_and_the_model_keeps_its_mode(model, tokenizer):
    samples = generate(model, tokenizer, PROMPTS, max_new_tokens=5, temperature=1.0, repeats=3)
    rows = len(PROMPTS) * 3
    assert samples.prompt_ids.shape[0] == samples.completion_ids.shape[0] == rows
    assert samples.completion_ids.shape[1] <= 5
    assert model.training
    # Rows of one prompt are consecutive and share the prompt.
    assert torch.equal(samples.prompt_ids[0], samples.prompt_ids[2])
    assert not torch.equal(samples.prompt_ids[2], samples.prompt_ids[3])
    mask = samples.completion_mask
    assert not (mask[:, 1:] > mask[:, :-1]).any(), "completions must be right-padded"
    eos = samples.completion_ids == tokenizer.eos_token_id
    ended = (eos & mask.bool()).any(dim=1)
    assert torch.equal(samples.truncated, ~ended)
    for row in range(rows):
        kept = samples.completion_ids[row][mask[row].bool() & ~eos[row]]
        assert samples.texts[row] == tokenizer.decode(kept, skip_special_tokens=True)


def test_greedy_decoding_of_a_left_padded_batch_matches_each_prompt_alone(model, tokenizer):
    batch = generate(model, tokenizer, PROMPTS, max_new_tokens=4, temperature=None).texts
    alone = [generate(model, tokenizer, [p], max_new_tokens=4, temperature=None).texts[0] for p in PROMPTS]
    assert batch == alone
    assert len(set(batch)) > 1, "a degenerate model would make this comparison vacuous"


def test_sampling_ignores_truncating_settings_in_the_models_generation_config(model, tokenizer):
    model.generation_config.top_k = 1  # greedy in disguise, were it honoured
    torch.manual_seed(0)
    samples = generate(model, tokenizer, PROMPTS[:1], max_new_tokens=3, temperature=1.0, repeats=16)
    assert len(set(samples.texts)) > 1


def test_overlong_punishment_follows_dapo():
    lengths = torch.tensor([1, 4, 5, 6])
    assert overlong_punishment(lengths, max_new_tokens=6, buffer=2, penalty=1.0) == [0.0, 0.0, -0.5, -1.0]


def _records():
    return [PromptRecord(prompt=p, columns={"answer": "5", "task": "t"}) for p in PROMPTS]


def _draw(records):
    position = 0

    def draw(count):
        nonlocal position
        out = [records[(position + i) % len(records)] for i in range(count)]
        position += count
        return out

    return draw


def test_a_rollout_feeds_grpo_and_sdpo_and_its_batches_run_through_the_loss(model, tokenizer):
    rewards = RewardSet(
        [RewardConfig(fn="exact_match"), RewardConfig(fn="format", pattern="[0-9].*", weight=0.5)]
    )
    settings = RolloutSettings(group_size=4, prompts_per_step=2, max_new_tokens=4, temperature=1.0)
    torch.manual_seed(0)
    rolled = rollout(model, tokenizer, _draw(_records()), rewards, HintBuilder(HintConfig()), settings)
    assert len(rolled.records) == 8 and rolled.records[3] is rolled.records[0]
    totals = torch.tensor(rolled.scored.totals).view(2, 4)
    advantages = rolled.rl.advantages.view(2, 4)
    for group, adv in zip(totals, advantages, strict=True):
        if group.std() == 0:
            assert torch.equal(adv, torch.zeros(4))
        else:
            assert adv.sum().abs() < 1e-5 and (
                adv.argmax() == group.argmax() or group.max() == group[adv.argmax()]
            )
    # Every row failed exact match, so each has the answer as feedback and is distilled.
    assert rolled.hint is not None
    assert torch.equal(rolled.hint.distill_mask, rolled.rl.completion_mask)
    assert rolled.metrics["rollout/hinted"] == 1.0
    assert rolled.metrics["rollout/reward_mean"] == pytest.approx(sum(rolled.scored.totals) / 8)
    loss, metrics = three_channel_loss(
        model, LossBatch(rl=rolled.rl, hint=rolled.hint), LossSettings(alpha=1.0)
    )
    loss.backward()
    assert metrics["sdpo/loss"] > 0
    assert all(p.grad is not None for p in model.parameters())


def test_without_hints_there_is_no_teacher_batch(model, tokenizer):
    settings = RolloutSettings(group_size=2, prompts_per_step=2, max_new_tokens=3, temperature=1.0)
    rolled = rollout(
        model, tokenizer, _draw(_records()), RewardSet([RewardConfig(fn="exact_match")]), None, settings
    )
    assert rolled.hint is None


def test_dynamic_sampling_keeps_only_groups_whose_rewards_differ(model, tokenizer):
    rewards = RewardSet([RewardConfig(fn="format", pattern=".*[0-9].*")])
    settings = RolloutSettings(
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=3,
        temperature=1.0,
        dynamic_sampling=True,
        max_draws=4,
    )
    torch.manual_seed(0)
    rolled = rollout(model, tokenizer, _draw(_records()), rewards, None, settings)
    groups = torch.tensor(rolled.scored.totals).view(-1, 4)
    assert len(groups) <= 2
    assert rolled.metrics["rollout/groups"] == len(groups) >= 1
    assert (groups.std(dim=1) > 0).all()
    assert 1 <= rolled.metrics["rollout/draws"] <= 4
    assert rolled.rl.prompt_ids.size(0) == len(rolled.records) == rolled.samples.completion_ids.size(0)


def test_dynamic_sampling_without_any_informative_group_keeps_the_last_draw(model, tokenizer):
    rewards = RewardSet([RewardConfig(fn="format", pattern="never")])  # longer than any completion: always 0
    settings = RolloutSettings(
        group_size=2,
        prompts_per_step=2,
        max_new_tokens=3,
        temperature=1.0,
        dynamic_sampling=True,
        max_draws=3,
    )
    rolled = rollout(model, tokenizer, _draw(_records()), rewards, None, settings)
    assert rolled.metrics["rollout/draws"] == 3
    assert rolled.metrics["rollout/frac_zero_std"] == 1.0
    assert [r.prompt for r in rolled.records] == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2  # the third draw wraps
    assert torch.equal(rolled.rl.advantages, torch.zeros(4))


def test_the_overlong_punishment_is_added_to_the_reward_of_long_completions(model, tokenizer):
    settings = RolloutSettings(
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=4,
        temperature=1.0,
        overlong_buffer=2,
        overlong_penalty=1.0,
    )
    rewards = RewardSet([RewardConfig(fn="format", pattern=".*")])  # 1 for every completion
    torch.manual_seed(0)
    rolled = rollout(model, tokenizer, _draw(_records()), rewards, None, settings)
    lengths = rolled.samples.completion_mask.sum(dim=1)
    expected = overlong_punishment(lengths, max_new_tokens=4, buffer=2, penalty=1.0)
    assert rolled.scored.by_reward["overlong"] == expected
    assert rolled.scored.totals == [1.0 + p for p in expected]
    assert any(p < 0 for p in expected)


def test_a_checkpoint_asking_for_a_static_cache_samples_on_the_device_as_on_the_cpu(model, tokenizer):
    """A generation config with ``cache_implementation = "static"`` made transformers compile ``generate``
    with CUDA graphs on a GPU only; the reference engine runs a dynamic cache, uncompiled, on every device."""
    model.generation_config.cache_implementation = "static"

    def compiled(*args, **kwargs):
        raise AssertionError("generate compiled the model")

    model.get_compiled_call = compiled  # what transformers calls when it decides to compile generate
    torch.manual_seed(0)
    on_cpu = generate(model, tokenizer, PROMPTS, max_new_tokens=4, temperature=None)
    with simulated():
        model.to("cuda")
        on_device = generate(model, tokenizer, PROMPTS, max_new_tokens=4, temperature=None)
        assert on_device.completion_ids.device.type == "cuda"
    assert on_device.texts == on_cpu.texts


def test_a_prompt_a_chat_template_rendered_gets_no_second_bos(tokenizer):
    """A template that writes BOS itself (Llama 3's): the rendered prompt is encoded without special tokens,
    as TRL encodes rendered prompts; a plain prompt still gets the tokenizer's BOS."""
    from tokenizers.processors import TemplateProcessing

    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, bos_id)]
    )
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rendered = render_prompt(tokenizer, "add 2 3=", as_chat=True)
    assert rendered.templated and rendered.text.startswith(bos)
    assert tokenizer(rendered.text)["input_ids"].count(bos_id) == 2  # what encoding it as usual would do
    ids, mask = encode_prompts(tokenizer, [rendered, "add 2 3="], torch.device("cpu"))
    for row, keep in zip(ids.tolist(), mask.tolist(), strict=True):
        tokens = [t for t, k in zip(row, keep, strict=True) if k]
        assert tokens[0] == bos_id and tokens.count(bos_id) == 1


def test_a_reward_of_weight_0_is_reported_but_changes_no_advantage_and_no_hint(model, tokenizer):
    """exact_match at weight 0 beside the format reward that trains: the same seed samples the same rollouts,
    whose advantages and SDPO hints are exactly those of the format reward alone, while exact_match's values
    are in the rollout's scores and metrics (on the simulated accelerator, as a replica runs it)."""
    trained = [RewardConfig(fn="format", pattern=".*[0-9].*")]
    settings = RolloutSettings(group_size=4, prompts_per_step=2, max_new_tokens=4, temperature=1.0)
    with simulated():
        model.to("cuda")
        rolled = {}
        for name, configs in (
            ("alone", trained),
            ("with_metric", [*trained, RewardConfig(fn="exact_match", weight=0)]),
        ):
            torch.manual_seed(3)
            rolled[name] = rollout(
                model, tokenizer, _draw(_records()), RewardSet(configs), HintBuilder(HintConfig()), settings
            )
    alone, with_metric = rolled["alone"], rolled["with_metric"]
    assert with_metric.samples.texts == alone.samples.texts
    assert with_metric.scored.totals == alone.scored.totals == with_metric.scored.by_reward["format"]
    assert alone.rl.advantages.abs().sum() > 0, "a group of equal rewards would make this comparison vacuous"
    assert torch.equal(with_metric.rl.advantages, alone.rl.advantages)
    # Every completion misses the answer 5: exact_match scored 0 and said so, and no hint shows it.
    assert with_metric.scored.by_reward["exact_match"] == [0.0] * 8
    assert with_metric.metrics["rollout/reward/exact_match"] == 0.0
    assert with_metric.scored.feedback == alone.scored.feedback
    assert not any("expected answer" in (f or "") for f in with_metric.scored.feedback)
    assert torch.equal(with_metric.hint.teacher_ids, alone.hint.teacher_ids)


def test_a_reward_learns_which_completions_hit_the_length_limit(model, tokenizer, tmp_path, monkeypatch):
    """``truncated`` reaches every reward beside TRL's arguments: True exactly for the rows that ran out of
    ``max_new_tokens`` before an EOS (a text the cut left, scored as such by a reward that cares)."""
    (tmp_path / "cut_rewards.py").write_text(
        "def cut(prompts, completions, completion_ids, truncated, **kwargs):\n"
        "    return [1.0 if t else 0.0 for t in truncated]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    # Half the vocabulary ends a completion, so some rows end within 3 tokens and some do not.
    model.generation_config.eos_token_id = list(range(0, len(tokenizer), 2))
    settings = RolloutSettings(group_size=8, prompts_per_step=2, max_new_tokens=3, temperature=1.0)
    torch.manual_seed(0)
    with simulated():
        model.to("cuda")
        rolled = rollout(
            model,
            tokenizer,
            _draw(_records()),
            RewardSet([RewardConfig(fn="cut_rewards:cut")]),
            None,
            settings,
        )
    expected = [float(t) for t in rolled.samples.truncated.tolist()]
    assert rolled.scored.by_reward["cut"] == expected
    assert 0.0 in expected and 1.0 in expected, "a batch of one kind would make this comparison vacuous"
    assert [len(ids) == 3 and ids[-1] % 2 == 1 for ids in rolled.samples.token_ids] == [
        e == 1.0 for e in expected
    ]
