"""The [diloco] keys of the rendezvous: documented, validated before anything runs, and the shipped demo
config still parses."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import REPO

from composer_serverless.config import ConfigError, DiLoCoConfig, load_config

BASE = {"replicas": 4, "sync_every": 10, "rounds": 2}
RENDEZVOUS_KEYS = (
    "codec",
    "min_replicas",
    "quorum_grace_min_s",
    "quorum_grace_max_s",
    "quorum_grace_mads",
    "max_failed_syncs",
)


def test_every_rendezvous_key_is_documented() -> None:
    for key in RENDEZVOUS_KEYS:
        assert DiLoCoConfig.model_fields[key].description, key


def test_defaults_keep_a_run_going_through_a_dead_replica() -> None:
    config = DiLoCoConfig(**BASE)
    assert config.codec == "fp32" and config.min_replicas == 1
    assert config.quorum_grace_min_s <= config.quorum_grace_max_s < config.sync_timeout_s


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"min_replicas": 5}, "min_replicas (5) cannot exceed replicas (4)"),
        ({"min_replicas": 0}, "greater than or equal to 1"),
        ({"codec": "fp8"}, "'fp32', 'bf16', 'int8' or 'sparse'"),
        ({"sparse_density": 0.5}, "less than or equal to 0.25"),
        ({"quorum_grace_min_s": 10, "quorum_grace_max_s": 5}, "cannot exceed quorum_grace_max_s"),
        ({"quorum_grace_max_s": 600}, "must be below sync_timeout_s"),
        ({"max_failed_syncs": 0}, "greater than or equal to 1"),
    ],
)
def test_invalid_values_are_refused_with_the_reason(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DiLoCoConfig(**BASE, **overrides)


def test_the_demo_config_parses_and_takes_the_new_keys_from_the_command_line(tmp_path: Path) -> None:
    demo = REPO / "deploy" / "configs" / "local-demo.toml"
    config = load_config(demo, ["diloco.codec=int8", "diloco.min_replicas=3", "diloco.fragment_sync_delay=1"])
    assert (config.diloco.codec, config.diloco.min_replicas, config.diloco.fragment_sync_delay) == (
        "int8",
        3,
        1,
    )
    with pytest.raises(ConfigError, match="min_replicas"):
        load_config(demo, ["diloco.min_replicas=9"])
