"""The model card is built from a run's config and summary alone: its metadata is what the Hub reads, its
figures are the summary's, and its config launches the same run again."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from composer_serverless.config import RunConfig, load_config, validate_config
from composer_serverless.outputs.model_card import card_text, reproduce_toml

ROOT = Path(__file__).resolve().parents[1]
RUN_CONFIGS = sorted(
    p for p in (ROOT / "deploy" / "configs").glob("*.toml") if p.name != "harvest-teachers.toml"
)


def _reloaded(config: RunConfig, tmp_path: Path) -> tuple[dict, dict]:
    """``config`` and what ``launch`` loads from its card's TOML, each without the run id and code.root."""
    path = tmp_path / "config.toml"
    path.write_text(reproduce_toml(config))
    dumps = (config.model_dump(), load_config(path).model_dump())
    for dump in dumps:
        dump.pop("run_id")
        dump["code"].pop("root")
    return dumps


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=[p.stem for p in RUN_CONFIGS])
def test_the_cards_config_launches_the_same_run(path: Path, tmp_path: Path) -> None:
    original, again = _reloaded(load_config(path), tmp_path)
    assert again == original


def test_values_toml_must_quote_or_nest_come_back_too(tmp_path: Path) -> None:
    config = validate_config(
        {
            "run_id": "r",
            "model": {
                "path": "Qwen/Qwen2.5-0.5B",
                "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]},
                "config_overrides": {"rope_theta": 1e6, "a.dotted key": True},
            },
            "data": {"corpus": 'hf://datasets/me/notes "v2"/*.jsonl', "seq_len": 64},
            "diloco": {"sync_every": 5, "rounds": 3, "outer_lr": 0.35, "codec": "int8"},
            "executor": {"type": "hf_jobs", "image": "ghcr.io/x/y:1", "secrets": ["WANDB_API_KEY"]},
            "output": {"push_to_hub": "me/model", "private": False},
        }
    )
    original, again = _reloaded(config, tmp_path)
    assert again == original


def test_a_value_toml_cannot_hold_is_a_comment() -> None:
    """TOML has no null: a default a config made in Python unset is said, not silently dropped."""
    config = validate_config(
        {"model": {"tiny": {}}, "diloco": {"sync_every": 2, "rounds": 4}, "train": {"grad_clip": None}}
    )
    assert "# grad_clip is unset" in reproduce_toml(config)


def _composer_config(**composer) -> RunConfig:
    return validate_config(
        {
            "run_id": "gsm8k-1",
            "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct", "dtype": "bfloat16"},
            "train": {"objective": "composer", "lr": 1e-6},
            "diloco": {"replicas": 8, "sync_every": 10, "rounds": 30, "nesterov": False, "codec": "bf16"},
            "composer": {
                "alpha": 1.0,
                "data": {
                    "prompts": "hf://datasets/openai/gsm8k/main",
                    "heldout": "hf://datasets/openai/gsm8k/main",
                },
                "rewards": [
                    {"fn": "exact_match"},
                    {"fn": "rewards.py:formatted", "name": "format", "weight": 0.2},
                ],
                "rollout": {
                    "prompts_per_step": 4,
                    "group_size": 16,
                    "max_new_tokens": 512,
                    "temperature": 0.7,
                },
                **composer,
            },
        }
    )


SUMMARY = {
    "rounds": 30,
    "rounds_committed": 30,
    "initial_eval_reward": 0.21,
    "final_eval_reward": 0.4375,
    "eval_reward_by_round": {"0": 0.21, "20": 0.40625, "30": 0.4375},
    "eval_reward_by_task": {"gsm8k": {"initial": 0.21, "final": 0.4375, "best": 0.5}},
    "final_eval_loss": None,
    "replicas_bit_identical": True,
    "wall_s": 5123.4,
}


def test_an_environment_that_owns_the_reward_alone_is_the_cards_reward() -> None:
    config = _composer_config(rewards=[], episodes={"environment": "my_env.py:Vault"})
    text = card_text(config, SUMMARY, round_index=30, final=True, title="me/agent")
    assert "| objective | composer: GRPO (dapo loss) + 1 x SDPO; rewards: `Vault.get_reward()` x 1 |" in text


def test_the_card_says_what_was_trained_how_and_what_it_reached() -> None:
    text = card_text(_composer_config(), SUMMARY, round_index=20, final=False, title="me/gsm8k-diloco")
    card = ModelCard(text)  # the front matter is YAML the Hub reads
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert card.data.datasets == ["openai/gsm8k"] and card.data.pipeline_tag == "text-generation"
    assert text.count("# me/gsm8k-diloco") == 1
    assert "run `gsm8k-1`, round 20 of 30 (its checkpoint of round 20)" in text
    for row in (
        "| replicas (M) | 8 |",
        "| inner steps per round (H, sync_every) | 10 |",
        "| rounds | 30 |",
        "| outer optimizer | SGD, lr 0.7, momentum 0.3, Nesterov off |",
        "| exchange codec | bf16 |",
        "| objective | composer: GRPO (dapo loss) + 1 x SDPO; rewards: `exact_match` x 1, `format` x 0.2 |",
        "| batch | 4 prompts x 16 completions of up to 512 new tokens (temperature 0.7) per inner step per "
        "replica |",
        "| held-out reward, initial -> final | 0.2100 -> 0.4375 |",
        "| held-out reward at round 20 (this model) | 0.4062 |",
        "| held-out reward on gsm8k, final (best) | 0.4375 (0.5000) |",
        "| wall time | 5123 s |",
    ):
        assert row in text, row
    assert "held-out loss" not in text


def test_a_card_without_a_summary_has_no_results_and_a_directory_is_no_base_model() -> None:
    config = validate_config(
        {"model": {"path": "/models/mine"}, "diloco": {"sync_every": 2, "rounds": 4}, "run_id": "x"}
    )
    text = card_text(config, None, round_index=4, final=False, title="x")
    assert ModelCard(text).data.base_model is None and "`/models/mine`" in text
    assert "## Results" not in text and "## Reproduce" in text


def test_a_composer_card_names_the_channels_on_and_the_pairs_a_step_replays() -> None:
    config = _composer_config(
        alpha=0.0,
        beta=0.5,
        data={"prompts": "p.jsonl", "heldout": "h.jsonl", "pairs": "pairs.jsonl"},
        replay={"kind": "simpo", "pairs_per_step": 6},
    )
    text = card_text(config, None, round_index=1, final=False, title="x")
    assert "| objective | composer: GRPO (dapo loss) + 0.5 x replay (simpo); rewards:" in text
    assert (
        "| batch | 4 prompts x 16 completions of up to 512 new tokens (temperature 0.7), and 6 preference "
        "pairs per inner step per replica |"
    ) in text


def test_a_card_names_the_builtin_environments_reward_which_may_be_the_only_one() -> None:
    config = _composer_config(rewards=[], episodes={"environment": "builtin:code"})
    text = card_text(config, None, round_index=1, final=False, title="x")
    assert "| objective | composer: GRPO (dapo loss) + 1 x SDPO; rewards: `builtin:code`'s own x 1 |" in text


def test_an_lm_card_says_the_tokens_of_a_step_and_one_layer_in_the_singular() -> None:
    config = validate_config(
        {
            "run_id": "lm-1",
            "model": {"tiny": {"num_layers": 1, "hidden_size": 64}},
            "data": {"batch_size": 8, "seq_len": 128},
            "diloco": {"sync_every": 2, "rounds": 4},
        }
    )
    text = card_text(config, None, round_index=4, final=True, title="lm-1")
    assert "A tiny Llama (1 layer, width 64, " in text and "1 layers" not in text
    assert "| objective | causal LM (next-token cross-entropy) |" in text
    assert "| batch | 8 x 128 tokens per inner step per replica |" in text


def test_the_cards_per_task_rows_name_the_rows_without_a_task() -> None:
    by_task = {
        "default": {"initial": 0.0, "final": 0.25, "best": 0.3},
        "gsm8k": {"initial": 0.21, "final": 0.4375, "best": 0.5},
    }
    text = card_text(
        _composer_config(), {**SUMMARY, "eval_reward_by_task": by_task}, round_index=30, final=True, title="x"
    )
    assert "| held-out reward on rows without a task, final (best) | 0.2500 (0.3000) |" in text
    assert "| held-out reward on gsm8k, final (best) | 0.4375 (0.5000) |" in text and "on default" not in text


def test_a_decoupled_runs_card_counts_versions_and_learners() -> None:
    """A decoupled run's summary (``mode``) counts global versions and says its learners held the same bytes
    of each version; a summary without ``mode`` (written before it) is a lock-step run's."""
    config = _composer_config()
    decoupled = card_text(config, {**SUMMARY, "mode": "decoupled"}, round_index=30, final=True, title="a/b")
    lock_step = card_text(config, SUMMARY, round_index=30, final=True, title="a/b")
    assert "| global versions merged | 30 of 30 |" in decoupled
    assert "| learners held the same bytes of every version they adopted | true |" in decoupled
    assert "bit-identical after every sync" not in decoupled and "rounds committed" not in decoupled
    assert "| rounds committed | 30 of 30 |" in lock_step
    assert "| replicas bit-identical after every sync | true |" in lock_step
