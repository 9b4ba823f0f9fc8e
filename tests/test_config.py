"""The config tree: shipped configs parse, overrides apply, bad input fails with a message naming the key."""

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from composer_serverless.cli import app
from composer_serverless.config import (
    ConfigError,
    apply_override,
    load_config,
    load_harvest_config,
    validate_config,
)
from composer_serverless.config.loading import read_toml

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "deploy" / "configs").glob("*.toml"))
MINIMAL = {"model": {"tiny": {}}, "diloco": {"sync_every": 4, "rounds": 2}}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    if set(read_toml(path)) == {"harvest"}:  # the table `composer-serverless harvest` reads, on its own
        assert load_harvest_config(path).teachers
        return
    config = load_config(path)
    assert config.diloco.rounds >= 1
    # The resolved JSON is what replicas read; it must round-trip to the same tree.
    assert type(config).model_validate_json(config.resolved_json()) == config


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_finds_its_files_from_any_directory(path, tmp_path, monkeypatch):
    """Paths in a config are relative to its file: `make demo` from the repository's root and a launch from
    anywhere else read the same data and code."""
    from composer_serverless.executors import shipment
    from composer_serverless.objectives import inputs

    monkeypatch.chdir(tmp_path)
    if set(read_toml(path)) == {"harvest"}:
        assert Path(load_harvest_config(path).traces).is_file()
        return
    config = load_config(path)
    inputs.check(config)  # reads every data file it names
    assert shipment.plan(config, cloud=False).root == path.parent  # and finds every code file


def test_shipped_configs_exist():
    assert any(p.name == "local-demo.toml" for p in CONFIGS)


def test_defaults_are_the_measured_outer_step_and_row_rule():
    """Not DiLoCo's 0.7/0.9: measured against data-parallel and plain averaging (docs/RESULTS.md, section 1)."""
    config = validate_config(MINIMAL)
    assert (config.diloco.outer_lr, config.diloco.outer_momentum, config.diloco.nesterov) == (0.7, 0.3, True)
    assert config.diloco.embedding_average == "touched"
    assert config.train.optimizer == "adamw"


def test_overrides_are_parsed_as_toml_values():
    raw = {"diloco": {"rounds": 2}}
    apply_override(raw, "diloco.replicas=3")
    apply_override(raw, "train.betas=[0.9, 0.99]")
    apply_override(raw, "model.path=some-org/some-model")
    assert raw == {
        "diloco": {"rounds": 2, "replicas": 3},
        "train": {"betas": [0.9, 0.99]},
        "model": {"path": "some-org/some-model"},
    }


@pytest.mark.parametrize("bad", ["diloco.replicas", "=3", "a..b=1", ".x=1"])
def test_malformed_override_is_rejected(bad):
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        apply_override({}, bad)


def test_override_through_a_value_is_rejected():
    with pytest.raises(ConfigError, match="seed is a value, not a table"):
        apply_override({"seed": 1}, "seed.x=2")


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("diloco.replicas=0", "diloco.replicas", "greater than or equal to 1"),
        ("diloco.sync_every=0", "diloco.sync_every", "greater than or equal to 1"),
        ("train.lr=-0.1", "train.lr", "greater than 0"),
        ("diloco.outer_momentum=1.0", "diloco.outer_momentum", "less than 1"),
        ("diloco.replicaz=2", "diloco.replicaz", "unknown key; did you mean diloco.replicas?"),
        ("run_id=Not_Valid", "run_id", "not a valid run id"),
        ("executor.threads_per_replica=0", "executor.threads_per_replica", "greater than or equal to 1"),
    ],
)
def test_invalid_values_name_the_key_and_the_fix(override, key, fragment):
    raw = {"model": {"tiny": {}}, "diloco": {"sync_every": 4, "rounds": 2}}
    apply_override(raw, override)
    with pytest.raises(ConfigError) as info:
        validate_config(raw, source="x.toml")
    message = str(info.value)
    assert f"{key}:" in message and fragment in message
    if "unknown key" not in fragment:
        assert f"fix: change {key} in x.toml or pass --set {key}=<value>" in message


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="must be a multiple of fragments"):
        validate_config({**MINIMAL, "diloco": {"sync_every": 10, "rounds": 1, "fragments": 3}})
    with pytest.raises(ConfigError, match="fragment_sync_delay .* must be below"):
        validate_config(
            {**MINIMAL, "diloco": {"sync_every": 4, "rounds": 1, "fragments": 2, "fragment_sync_delay": 2}}
        )
    with pytest.raises(ConfigError, match="nesterov = true needs outer_momentum > 0"):
        validate_config({**MINIMAL, "diloco": {"sync_every": 4, "rounds": 1, "outer_momentum": 0.0}})
    with pytest.raises(ConfigError, match="exactly one of model.path"):
        validate_config({**MINIMAL, "model": {"path": "x", "tiny": {}}})
    with pytest.raises(ConfigError, match="required but not set"):
        validate_config({"model": {"tiny": {}}, "diloco": {"rounds": 1}})


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[diloco\nreplicas = 2\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)


# --- the CLI: exit status 2, one clear message, nothing launched or written -----------------------------


def _write_config(tmp_path: Path, store: str, extra: str = "") -> Path:
    path = tmp_path / "run.toml"
    path.write_text(
        f'store = "{store}"\n[model.tiny]\n[diloco]\nreplicas = 2\nsync_every = 2\nrounds = 1\n{extra}'
    )
    return path


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("sync_every_x = 1\n", "unknown key"),
        ("[train]\nlr = -1\n", "train.lr"),
    ],
)
def test_cli_rejects_bad_config_before_touching_the_store(tmp_path, extra, expected):
    store = tmp_path / "store"
    config = _write_config(tmp_path, str(store), extra)
    result = CliRunner().invoke(app, ["launch", str(config)])
    assert result.exit_code == 2, result.output
    assert expected in result.output
    assert not store.exists()


def test_cli_rejects_bad_overrides(tmp_path):
    store = tmp_path / "store"
    config = _write_config(tmp_path, str(store))
    for args in (["--replicas", "0"], ["--set", "diloco.sync_every=0"], ["--set", "oops"]):
        result = CliRunner().invoke(app, ["launch", str(config), *args])
        assert result.exit_code == 2, result.output
        assert "error:" in result.output
    assert not store.exists()


def test_cli_missing_config_file(tmp_path):
    result = CliRunner().invoke(app, ["launch", str(tmp_path / "missing.toml")])
    assert result.exit_code == 2
    assert "config file not found" in result.output


def test_cli_store_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = _write_config(tmp_path, str(blocker / "runs"))
    result = CliRunner().invoke(app, ["launch", str(config)])
    assert result.exit_code == 2, result.output
    assert "cannot write to store" in result.output
    assert blocker.read_text() == "not a directory"


def test_help_lists_only_working_subcommands():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    commands = set(typer.main.get_command(app).commands)
    assert commands == {"launch", "status", "logs", "cancel", "export", "sweep", "harvest"}
    assert all(name in result.output for name in commands)


def test_unknown_executor_type_is_named():
    with pytest.raises(ConfigError, match=r"executor.type: unknown executor 'nope'; choose one of 'local'"):
        validate_config({**MINIMAL, "executor": {"type": "nope"}})


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.lr=inf", "train.lr: Input should be a finite number"),
        ("train.lr=nan", "train.lr: Input should be a finite number"),
        ("train.lr=1e6", "train.lr: Input should be less than or equal to 1"),
        ("diloco.outer_lr=1e9", "diloco.outer_lr: Input should be less than or equal to 10"),
        ("diloco.rounds=1000000000000000000", "diloco.rounds: Input should be less than or equal to 1000000"),
        ("diloco.sync_timeout_s=inf", "diloco.sync_timeout_s: Input should be a finite number"),
        ('store="s3:/bucket/runs"', "'s3:/bucket/runs' is not a store URL: write s3://<bucket>/<prefix>"),
        ('store=""', "store: the store is empty"),
        ('store="s3://"', "'s3://' is not a store URL"),
        ('store="nosuchproto://bucket/runs"', "unknown storage protocol 'nosuchproto'"),
    ],
)
def test_values_no_run_could_use_exit_2_before_anything_is_written(tmp_path, monkeypatch, override, expected):
    """Each of these once ran: an infinite learning rate reached run.json as null, 1e18 rounds ran until
    killed, ``s3:/bucket`` trained in a directory named ``s3:`` and an empty store in the current one."""
    monkeypatch.chdir(tmp_path)
    config = _write_config(tmp_path, str(tmp_path / "store"))
    result = CliRunner().invoke(app, ["launch", str(config), "--set", override])
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split())
    assert "fix:" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]  # no store, no s3: directory


def test_a_binary_config_file_exits_2(tmp_path):
    config = tmp_path / "model.safetensors"
    config.write_bytes(b"\x00\x01\xff\xfe\x80 not toml")
    result = CliRunner().invoke(app, ["launch", str(config)])
    assert result.exit_code == 2, result.output
    assert "is not a text file" in result.output and "fix: pass the TOML config" in result.output


def test_an_unreadable_config_file_exits_2(tmp_path, monkeypatch):
    config = tmp_path / "run.toml"
    config.write_text("[model.tiny]\n")

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", denied)  # root reads any file: the refusal is simulated
    result = CliRunner().invoke(app, ["launch", str(config)])
    assert result.exit_code == 2, result.output
    assert "cannot read" in result.output and "Permission denied" in result.output


@pytest.mark.parametrize(
    ("key", "given", "stored"),
    [
        ("model.dtype", "bf16", "bfloat16"),
        ("model.dtype", "BF16", "bfloat16"),
        ("model.master_dtype", "fp32", "float32"),
        ("model.dtype", "bfloat16", "bfloat16"),
        ("output.dtype", "bf16", "bfloat16"),
    ],
)
def test_trl_dtype_spellings_are_read_as_ours(tmp_path, key, given, stored):
    """TRL's and transformers' ``bf16``/``fp32``, in the file and through ``--set``, become the one name
    run.json holds (and the model loader's table knows)."""
    path = tmp_path / "c.toml"
    path.write_text("[model.tiny]\n[diloco]\nsync_every = 4\nrounds = 2\n")
    table, leaf = key.split(".")
    for config in (
        load_config(path, [f"{key}={given}"]),
        validate_config({**MINIMAL, table: {**MINIMAL.get(table, {}), leaf: given}}),
    ):
        assert getattr(getattr(config, table), leaf) == stored
        assert f'"{leaf}": "{stored}"' in config.resolved_json()


def test_fp16_is_refused_with_the_reason_and_the_spelling_to_use(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model.tiny]\n[diloco]\nsync_every = 4\nrounds = 2\n")
    result = CliRunner().invoke(app, ["launch", str(path), "--dry-run", "--set", "model.dtype=fp16"])
    assert result.exit_code == 2
    assert (
        "model.dtype: 'fp16' (float16) is not supported: training in it needs loss scaling; use 'bf16' "
        "(bfloat16: the same memory, float32's range)" in " ".join(result.output.split())
    )


def test_cli_refuses_error_reset_with_a_merge_before_touching_the_store(tmp_path):
    """Reset keeps the residual as local = global - residual; the alpha merge would break that: exit 2 with the
    fix, nothing written. Either setting alone is accepted."""
    store = tmp_path / "store"
    config = _write_config(tmp_path, str(store))
    reset = ["--set", "diloco.codec=sparse", "--set", "diloco.error_feedback=reset"]
    result = CliRunner().invoke(
        app, ["launch", str(config), *reset, "--set", "diloco.fragment_update_alpha=0.5"]
    )
    assert result.exit_code == 2, result.output
    assert "fragment_update_alpha = 0.5 mixes the pre-sync local weights back into them" in result.output
    assert "set fragment_update_alpha = 0, or error_feedback = 'resend'" in result.output
    assert "fix: edit the [diloco] table in" in result.output
    assert not store.exists()
    for accepted in (
        {"codec": "sparse", "error_feedback": "reset"},
        {"codec": "sparse", "fragment_update_alpha": 0.5},
    ):
        validate_config({**MINIMAL, "diloco": {"sync_every": 4, "rounds": 1, **accepted}})
