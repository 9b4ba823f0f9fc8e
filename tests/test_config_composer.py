"""The [composer] table and the character tokenizer options: what validates, and what each mistake says."""

import copy
from pathlib import Path

import pytest

from composer_serverless.config import ConfigError, RunConfig, load_config, validate_config

CONFIGS = Path(__file__).resolve().parents[1] / "deploy" / "configs"

BASE = {
    "model": {"tiny": {"tokenizer": "chars"}},
    "train": {"objective": "composer"},
    "diloco": {"sync_every": 2, "rounds": 1},
    "composer": {
        "beta": 1.0,
        "data": {"prompts": "train.jsonl", "heldout": "heldout.jsonl", "pairs": "pairs.jsonl"},
        "rewards": [{"fn": "exact_match"}],
    },
}


def edited(path: str, value):
    raw = copy.deepcopy(BASE)
    *parents, leaf = path.split(".")
    node = raw
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    if value is None:
        del node[leaf]
    else:
        node[leaf] = value
    return raw


def test_the_shipped_composer_config_validates_and_round_trips_through_run_json():
    config = load_config(CONFIGS / "local-composer.toml")
    assert config.train.objective == "composer" and config.composer.beta > 0 and config.composer.alpha > 0
    assert RunConfig.model_validate_json(config.resolved_json()) == config


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("composer", None, "train.objective = 'composer' needs a [composer] table"),
        ("train.objective", "lm", "[composer] is set but train.objective = 'lm'"),
        ("composer.data.pairs", None, "beta > 0 needs preference pairs"),
        ("composer.data.heldout", None, "composer.data.heldout: required but not set"),
        ("composer.rewards", [], "no rewards: name at least one in [[composer.rewards]], or an environment"),
        ("composer.rewards.0.fn", "format", "set pattern exactly when fn = 'format'"),
        ("composer.rewards.0.pattern", "x", "set pattern exactly when fn = 'format'"),
        ("composer.rewards.0.fn", "my rewards:score", "neither a built-in reward"),
        (
            "composer.rewards.0.weight",
            0,
            "every reward has weight 0: they are evaluation metrics, and nothing is left to train on; give at "
            "least one of them a non-zero weight",
        ),
        ("composer.rewards.0.timout_s", 3, "unknown key; did you mean composer.rewards.0.timeout_s?"),
        ("composer.hints.template", "{hint}", "must contain {prompt}"),
        ("composer.hints.feedback", "{feedback} {oops}", "may use only {feedback}"),
        ("composer.rollout.overlong_buffer", 256, "overlong_buffer (256) must be below max_new_tokens (256)"),
        ("composer.sdpo.beta", 1.5, "composer.sdpo.beta: Input should be less than or equal to 1"),
        (
            "model.tiny.vocab_size",
            512,
            "takes its vocabulary from alphabet and is not fit on a corpus; remove vocab_size",
        ),
        ("model.tiny.alphabet", "abca", "each character once (repeated: ['a'])"),
        ("model.tiny.tokenizer", "bpe", None),
    ],
)
def test_mistakes_are_explained(path, value, message):
    raw = edited(path, value)
    if message is None:  # the BPE tokenizer is fine on its own ...
        validate_config(raw)
        raw["model"]["tiny"]["alphabet"] = "abc"  # ... but has no alphabet
        message = "alphabet is the vocabulary of tokenizer = 'chars'"
    with pytest.raises(ConfigError) as error:
        validate_config(raw)
    assert message in str(error.value)


def test_pairs_without_replay_are_allowed_so_an_override_can_switch_the_channel_off():
    config = validate_config(edited("composer.beta", 0.0))
    assert config.composer.beta == 0 and config.composer.data.pairs == "pairs.jsonl"


def test_a_format_reward_with_a_broken_regex_is_refused():
    raw = edited("composer.rewards", [{"fn": "format", "pattern": "[0-9"}])
    with pytest.raises(ConfigError, match="is not a valid regular expression"):
        validate_config(raw)


def test_a_mistake_inside_a_list_item_points_at_the_file_not_at_set():
    """--set cannot address list items, so the fix for composer.rewards.0.* must not suggest it; a plain
    key's fix still does."""
    with pytest.raises(ConfigError) as error:
        validate_config(edited("composer.rewards.0.timeout_s", -1))
    assert "fix: change composer.rewards.0.timeout_s in" in str(error.value)
    assert "--set" not in str(error.value)
    with pytest.raises(ConfigError) as error:
        validate_config(edited("composer.rewards.0.pattern", "x"))  # exact_match takes no pattern
    assert "fix: edit the 1st [[composer.rewards]] table in" in str(error.value)
    with pytest.raises(ConfigError) as error:
        validate_config(edited("composer.sdpo.beta", 1.5))
    assert "--set composer.sdpo.beta=<value>" in str(error.value)


def test_an_environment_may_own_the_reward_alone():
    """TRL's environment-owned reward: no reward function, the environment's get_reward() scores (whether the
    class has one is checked where it is imported, by the launcher's reward check)."""
    raw = edited("composer.rewards", None)
    raw["composer"]["episodes"] = {"environment": "my_env.py:Vault"}
    assert validate_config(raw).composer.rewards == []
    raw["composer"]["episodes"]["environment_reward_weight"] = 0.0
    with pytest.raises(ConfigError, match="no rewards: name at least one"):
        validate_config(raw)
    raw["composer"]["episodes"] = {"tools": ["my_tools.py:lookup"]}  # tools alone own no reward
    with pytest.raises(ConfigError, match="no rewards: name at least one"):
        validate_config(raw)


def test_a_reward_of_weight_0_beside_a_weighted_one_is_an_evaluation_metric():
    raw = edited("composer.rewards", [{"fn": "exact_match", "weight": 0}, {"fn": "format", "pattern": "x"}])
    assert [r.weight for r in validate_config(raw).composer.rewards] == [0.0, 1.0]
