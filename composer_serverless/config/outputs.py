"""What a run reports to and leaves behind: the trackers its metrics reach (``[tracking]``) and the model it
pushes to the Hub when it ends (``[output]``). Neither changes training, so both may change on a resume."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from composer_serverless.config.base import StrictModel
from composer_serverless.config.model import Dtype

TRACKERS = ("tensorboard", "trackio", "wandb")


class TrackingConfig(StrictModel):
    """Experiment trackers the run's metrics are relayed to by the launcher (``tracking/``): one tracker run
    per training run, every inner step logged once, the config with it."""

    report_to: tuple[Literal["tensorboard", "trackio", "wandb"], ...] = Field(
        (), description=f"trackers to log to: any of {', '.join(TRACKERS)}; none by default"
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
