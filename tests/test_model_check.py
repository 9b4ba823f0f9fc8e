"""The model check before launch: a model that cannot train as configured exits 2 with the fix before the run
is created or any replica started. The check runs in a child process; the launcher imports no torch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from composer_serverless.cli import app
from composer_serverless.config import ModelConfig
from composer_serverless.models.loading import load_model
from composer_serverless.objectives.composer import same_function_twice
from tests.archs import build

# Each test builds models from their configs and runs the CLI: several seconds each, in the full suite only.
pytestmark = pytest.mark.slow

TASKS = Path(__file__).resolve().parents[1] / "deploy" / "data" / "composer-tasks"


@pytest.fixture(scope="module")
def archs(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("archs")
    return {family: build(family, tiny_model_dir, root / family) for family in ("llama", "opt", "gpt2")}


def _toml(value: object) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


def _launch(tmp_path: Path, model: dict, *extra: str, composer: bool = False) -> tuple[int, str, Path]:
    store = tmp_path / "store"
    lines = [f'store = "{store}"', "[model]", *(f"{k} = {_toml(v)}" for k, v in model.items())]
    lines += ["[diloco]", "replicas = 1", "sync_every = 1", "rounds = 1"]
    if composer:
        lines += [
            "[train]",
            'objective = "composer"',
            "[composer]",
            f'data = {{ prompts = "{TASKS / "train.jsonl"}", heldout = "{TASKS / "heldout.jsonl"}" }}',
            'rewards = [{ fn = "exact_match" }]',
        ]
    config = tmp_path / "run.toml"
    config.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(app, ["launch", str(config), *extra])
    return result.exit_code, result.output, store


@pytest.mark.parametrize(
    ("family", "model", "message"),
    [
        ("llama", {"config_overrides": {"no_such_key": 1}}, "LlamaConfig has no 'no_such_key'"),
        (
            "llama",
            {"lora": {"target_modules": ["qkv"]}},
            r"name no module of LlamaForCausalLM; its linear layers are \[",
        ),
        ("llama", {"attn_implementation": "no_such_kernel"}, "cannot be built from its config"),
    ],
)
def test_a_model_that_cannot_train_exits_2_before_anything_is_written(
    tmp_path: Path, archs: dict, family: str, model: dict, message: str
) -> None:
    code, output, store = _launch(tmp_path, {"path": str(archs[family]), **model})
    assert code == 2, output
    assert "the model cannot be trained as configured" in output
    assert re.search(message, output), output
    assert not store.exists() or not any(store.iterdir())


def test_published_dropout_is_refused_for_sdpo_with_the_fix(tmp_path: Path, archs: dict) -> None:
    code, output, store = _launch(
        tmp_path, {"path": str(archs["gpt2"]), "dropout": "as_published"}, composer=True
    )
    assert code == 2 and "SDPO" in output and "--set model.dropout=off" in output, output
    assert not store.exists() or not any(store.iterdir())


def test_remote_code_needs_consent(tmp_path: Path, archs: dict) -> None:
    import shutil

    remote = tmp_path / "remote"
    shutil.copytree(archs["llama"], remote)
    config = json.loads((remote / "config.json").read_text())
    config["model_type"] = "mine"  # no code in transformers for it: only the repository's own would do
    config["auto_map"] = {
        "AutoConfig": "configuration_mine.MineConfig",
        "AutoModelForCausalLM": "modeling_mine.MineForCausalLM",
    }
    (remote / "config.json").write_text(json.dumps(config))
    code, output, _ = _launch(tmp_path, {"path": str(remote)})
    assert code == 2 and "--set model.trust_remote_code=true" in output, output


def test_chat_records_need_a_chat_template(tmp_path: Path, archs: dict) -> None:
    chat = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    )
    (tmp_path / "train.jsonl").write_text(chat + "\n")
    (tmp_path / "heldout.jsonl").write_text(chat + "\n")
    data = {"corpus": tmp_path / "train.jsonl", "heldout": tmp_path / "heldout.jsonl", "format": "chat"}
    options = [f"--set=data.{key}={value}" for key, value in data.items()]
    code, output, _ = _launch(tmp_path, {"path": str(archs["llama"])}, *options, "--set=data.batch_size=1")
    assert code == 2 and "no chat template" in output, output


def test_a_training_pass_with_dropout_is_caught_even_when_functional(archs: dict) -> None:
    """OPT applies dropout and LayerDrop as functions, with no nn.Dropout module to find: two passes differ."""
    published = load_model(ModelConfig(path=str(archs["opt"]), dropout="as_published"), archs["opt"])
    with pytest.raises(ValueError, match="set model.dropout = 'off'"):
        same_function_twice(published.model, published.tokenizer)
    off = load_model(ModelConfig(path=str(archs["opt"])), archs["opt"])
    same_function_twice(off.model, off.tokenizer)


@pytest.mark.parametrize(
    "model",
    [
        {"config_overrides": {"no_such_key": 1}},
        {"lora": {"target_modules": ["qkv"]}},
        {"attn_implementation": "no_such_kernel"},
    ],
)
def test_a_dry_run_fails_as_the_launch_does(tmp_path: Path, archs: dict, model: dict) -> None:
    """The issue's "done when": the dry run runs the model check too, and says what the launch says."""
    launched = _launch(tmp_path, {"path": str(archs["llama"]), **model})
    dry = _launch(tmp_path, {"path": str(archs["llama"]), **model}, "--dry-run")
    assert dry[0] == launched[0] == 2, dry[1]
    assert dry[1] == launched[1] and "the model cannot be trained as configured" in dry[1]
    assert not dry[2].exists() or not any(dry[2].iterdir())


def test_the_dry_run_counts_lora_adapters_as_peft_makes_them(tmp_path: Path, archs: dict) -> None:
    """The tiny Llama (width 32, MLP 64, 2 layers, 2 key/value heads of 8): per layer q and o 32 -> 32, k and v
    32 -> 16, gate and up 32 -> 64, down 64 -> 32; r = 8 adds 8 x (in + out) to each: 512 + 384 + 384 + 512 +
    768 + 768 + 768 = 4,096, 8,192 in all (the output head is not adapted)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    code, output, _ = _launch(tmp_path, {"path": str(archs["llama"]), "lora": {"r": 8}}, "--dry-run")
    assert code == 0, output
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(archs["llama"]))
        total = sum(p.numel() for p in base.parameters())
        adapted = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear"))
    assert sum(p.numel() for p in adapted.parameters() if p.requires_grad) == 8_192
    assert f"{total + 8_192:,} parameters (8,192 trained)" in output


def test_a_sweep_dry_run_checks_each_cells_model_and_names_the_cell_that_fails(
    tmp_path: Path, archs: dict
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        f'store = "{tmp_path / "store"}"\n[model]\npath = "{archs["llama"]}"\n'
        "[diloco]\nreplicas = 1\nsync_every = 1\nrounds = 1\n"
    )
    grid = ["--grid", "model.attn_implementation=sdpa,no_such_kernel"]
    result = CliRunner().invoke(app, ["sweep", str(config), *grid, "--dry-run"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(
        "error: grid cell 1 (model.attn_implementation=no_such_kernel): the model cannot be trained as "
        f"configured:\n  model.path '{archs['llama']}': the model cannot be built from its config"
    )
    assert not (tmp_path / "store").exists()
