"""What a run reports to and leaves behind: the trackers its metrics reach (``[tracking]``) and the model it
pushes to the Hub when it ends (``[output]``). Neither changes training, so both may change on a resume."""

from __future__ import annotations

import importlib.util
import logging
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator

from composer_serverless.config.base import StrictModel
from composer_serverless.config.model import Dtype

logger = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "trackio", "wandb")
# The package each tracker's client comes in.
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}


def installed_trackers() -> tuple[str, ...]:
    """The trackers whose client can be imported here (found, not imported: that costs seconds)."""
    return tuple(name for name in TRACKERS if importlib.util.find_spec(TRACKER_PACKAGES[name]) is not None)


def trackers_named(value: Any) -> Any:
    """``report_to`` as TRL (transformers' ``TrainingArguments``) takes it: a tracker's name or a list of
    them, ``"none"`` for none, ``"all"`` for every tracker installed here (which, it logs: run.json holds
    the trackers chosen, not ``"all"``, so a relay elsewhere logs to the same ones)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not ({"all", "none"} & set(names)):
        return names
    if len(names) > 1:
        raise ValueError(f"'all' and 'none' stand alone: report_to = {list(names)}")
    if names[0] == "none":
        return ()
    chosen = installed_trackers()
    logger.warning(
        "tracking.report_to = 'all': reporting to %s (the trackers installed here, of %s)",
        ", ".join(chosen) or "none",
        ", ".join(TRACKERS),
    )
    return chosen


class TrackingConfig(StrictModel):
    """Experiment trackers the run's metrics are relayed to by the launcher (``tracking/``): one tracker run
    per training run, every inner step logged once, the config with it."""

    report_to: Annotated[
        tuple[Literal["tensorboard", "trackio", "wandb"], ...], BeforeValidator(trackers_named)
    ] = Field(
        (),
        description=f"trackers to log to: one of {', '.join(TRACKERS)} or a list of them, 'none', or 'all' "
        "(every one whose client is installed where the run is launched); none by default",
    )
    project: str = Field(
        "composer-serverless", min_length=1, description="the tracker's project (W&B, trackio)"
    )
    name: str | None = Field(None, description="the tracker run's name; the run id when unset")
    dir: str = Field(
        "tracking",
        min_length=1,
        description="local directory for the trackers' files (TensorBoard events, W&B offline runs), one "
        "subdirectory per run; TensorBoard's events are also copied into the store (tracking/tensorboard/)",
    )
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="W&B online (needs WANDB_API_KEY) or offline (`wandb sync` uploads it later)"
    )
    completions_per_round: int = Field(
        8, ge=0, le=1024, description="completions with their rewards kept per replica per round (composer)"
    )

    @field_validator("report_to")
    @classmethod
    def _once_each(cls, report_to: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(report_to)) != len(report_to):
            raise ValueError(f"report_to names a tracker twice: {list(report_to)}")
        return report_to


class OutputConfig(StrictModel):
    """The model pushed to the Hugging Face Hub when the run ends (by the launcher, with its HF_TOKEN)."""

    push_to_hub: str | None = Field(
        None,
        description="Hub repo id (user/name) the final model is pushed to when the run succeeds (checked with "
        "huggingface_hub's own rule by the launcher, before the run starts: replicas never import it)",
    )
    private: bool = Field(True, description="create the Hub repo private")
    dtype: Dtype | None = Field(None, description="the pushed weights' dtype; as trained when unset")
