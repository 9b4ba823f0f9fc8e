"""What every config table shares: the error users see, and the strictness of every table."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration the user must fix; the message names the key and says how."""


class StrictModel(BaseModel):
    """A config table: unknown keys are errors (a typo fails at once), values are frozen and defaults are
    validated like any value. No number may be infinite or NaN: JSON (``run.json``, which the replicas read)
    cannot hold them, and no setting means anything at infinity."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)
