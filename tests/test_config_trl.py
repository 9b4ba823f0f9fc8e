"""TRL users at home: a key TRL names differently is answered with our name for it (exit 2, nothing written),
the table behind that answer is the documented one, and [eval]'s sampling settings are checked."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from composer_serverless.cli import app
from composer_serverless.config import ConfigError, validate_config
from composer_serverless.config.loading import _fields_at
from composer_serverless.config.trl_names import TRL_NAMES, describe

ROOT = Path(__file__).resolve().parents[1]
COMPOSER = ROOT / "deploy" / "configs" / "local-composer.toml"
MINIMAL = {"model": {"tiny": {}}, "diloco": {"sync_every": 4, "rounds": 2}}


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "composer.rollout.num_generations=16",
            "composer.rollout.num_generations: unknown key; that is TRL's name; here it is "
            "`composer.rollout.group_size` (completions per prompt, the GRPO group) "
            "fix: use composer.rollout.group_size instead (docs/coming-from-trl.md)",
        ),
        (
            "composer.max_completion_length=512",
            "composer.max_completion_length: unknown key; that is TRL's name; here it is "
            "`composer.rollout.max_new_tokens`",
        ),
        (
            "composer.grpo.beta=0.04",
            "composer.grpo.beta: unknown key; that is TRL's name; here it is `composer.grpo.kl` (TRL's beta is "
            "the KL weight; composer.beta here is the replay channel's weight)",
        ),
        (
            "train.learning_rate=1e-6",
            "train.learning_rate: unknown key; that is TRL's name; here it is `train.lr`",
        ),
        (
            "train.fp16=true",
            "train.fp16: unknown key; that is TRL's name, with no equivalent here: float16 needs loss scaling, "
            "which is not offered: use model.dtype = 'bf16' fix: remove it (docs/coming-from-trl.md)",
        ),
        ("report_to=wandb", "report_to: unknown key; that is TRL's name; here it is `tracking.report_to`"),
        (
            "train.beta=0.5",
            "fix: use composer.grpo.kl instead (docs/coming-from-trl.md; or did you mean train.betas?)",
        ),
    ],
)
def test_trl_names_say_ours_and_exit_2_before_anything_is_written(tmp_path, monkeypatch, override, expected):
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "store"
    result = CliRunner().invoke(app, ["launch", str(COMPOSER), "--set", f"store={store}", "--set", override])
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split())
    assert list(tmp_path.iterdir()) == []


def test_a_replay_weight_without_pairs_says_where_trls_beta_is():
    raw = {
        **MINIMAL,
        "train": {"objective": "composer"},
        "composer": {
            "beta": 0.04,
            "data": {"prompts": "p.jsonl", "heldout": "h.jsonl"},
            "rewards": [{"fn": "format", "pattern": "x"}],
        },
    }
    with pytest.raises(ConfigError, match="TRL's beta, the KL weight, is composer.grpo.kl here"):
        validate_config(raw)


@pytest.mark.parametrize("trl", sorted(TRL_NAMES))
def test_each_of_our_names_in_the_table_is_a_key(trl):
    ours = TRL_NAMES[trl].ours
    if ours is None:
        return
    *table, key = ours.split(".")
    assert key in _fields_at(table), f"{trl} -> {ours}, which is no key"


def test_the_table_in_the_docs_is_the_module():
    doc = (ROOT / "docs" / "coming-from-trl.md").read_text()
    table = doc[doc.index("| TRL | here | what differs |") :].split("\n\n")[0]
    rows = [tuple(cell.strip() for cell in line.strip("|").split(" | ")) for line in table.splitlines()[2:]]
    assert rows == [(f"`{trl}`", ours, note) for trl, ours, note in describe()]


@pytest.mark.parametrize(
    ("evaluation", "message"),
    [
        (
            {"samples": 4},
            "samples = 4 with greedy decoding (temperature = 0) scores one completion 4 times: set "
            "eval.temperature > 0 (1.0 samples as the model does) or samples = 1",
        ),
        (
            {"temperature": 1.0, "samples": 4, "pass_at": [1, 8]},
            "pass_at [1, 8]: each k must be between 1 and samples (4), since pass@k takes k of a prompt's "
            "samples; raise eval.samples to at least 8 or drop [8]",
        ),
        ({"temperature": 1.0, "samples": 4, "pass_at": [2, 2]}, "pass_at names a k twice: [2, 2]"),
        ({"temperature": -1.0}, "eval.temperature: Input should be greater than or equal to 0"),
    ],
)
def test_eval_sampling_mistakes_are_explained(evaluation, message):
    raw = {**MINIMAL, "train": {"objective": "composer"}, "eval": evaluation}
    with pytest.raises(ConfigError) as error:
        validate_config(raw)
    assert message in " ".join(str(error.value).split())


def test_eval_sampling_is_the_composer_objectives():
    with pytest.raises(ConfigError) as error:
        validate_config({**MINIMAL, "eval": {"temperature": 1.0, "samples": 2}})
    assert (
        "eval.temperature, eval.samples set how the composer objective decodes its held-out prompts; the 'lm' "
        "objective scores held-out loss: remove them" in " ".join(str(error.value).split())
    )


def test_eval_defaults_are_todays_greedy_evaluation():
    config = validate_config(MINIMAL)
    assert (config.eval.temperature, config.eval.samples, config.eval.pass_at) == (0.0, 1, ())
