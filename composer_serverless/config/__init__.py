"""The one validated configuration tree, loaded from TOML and overridable from the command line.

Every field is checked before anything is launched or written, so a typo or an impossible value costs a
second, not a GPU-hour. The launcher resolves the tree to JSON (``run.json`` in the run) and replicas read
exactly that: the replicas never see the TOML file or the command line.

By job: ``run.py`` (the run's schema and ``RunConfig``), ``model.py`` (the model, its loading, precision and
LoRA), ``data.py`` (what the lm objective trains on), ``composer.py`` (the three-channel objective),
``executors.py`` (where replicas run), ``harvest.py`` (the teachers asked for preference pairs), ``hardware.py`` (the GPU types and flavors, with list prices),
``loading.py`` (TOML, ``--set``, messages that say how to fix, with ``trl_names.py``: TRL's names for our keys),
``paths.py`` (one rule for the paths in it), ``base.py`` (what every table shares).
"""

from composer_serverless.config.base import ConfigError
from composer_serverless.config.composer import ComposerConfig, HintConfig, RewardConfig
from composer_serverless.config.data import DataConfig
from composer_serverless.config.executors import DEFAULT_HF_JOBS_IMAGE, EXECUTOR_TYPES
from composer_serverless.config.harvest import HarvestConfig, NormaliseConfig, TeacherConfig
from composer_serverless.config.loading import (
    apply_override,
    load_config,
    load_harvest_config,
    select_executor,
    validate_config,
)
from composer_serverless.config.model import LoraConfig, ModelConfig, TinyModelConfig
from composer_serverless.config.run import RUN_ID_PATTERN, DiLoCoConfig, RunConfig, TrainConfig

__all__ = [
    "DEFAULT_HF_JOBS_IMAGE",
    "EXECUTOR_TYPES",
    "RUN_ID_PATTERN",
    "ComposerConfig",
    "ConfigError",
    "DataConfig",
    "DiLoCoConfig",
    "HarvestConfig",
    "HintConfig",
    "LoraConfig",
    "ModelConfig",
    "NormaliseConfig",
    "RewardConfig",
    "RunConfig",
    "TeacherConfig",
    "TinyModelConfig",
    "TrainConfig",
    "apply_override",
    "load_config",
    "load_harvest_config",
    "select_executor",
    "validate_config",
]
