"""The launcher's check of a run's rewards, run in a child process (``python -m
composer_serverless.objectives.reward_check``, the resolved config on stdin, by ``launch/launcher.py`` as it runs the
model check): the tools and environment of episodes imported and checked (``episodes_problem``), every reward imported and called as TRL calls rewards, on the first training records with
placeholder completions, before anything is written or paid for. A wrong signature, a reward that raises, a
missing package or a missing file is reported with its fix. It also says whether any reward of non-zero weight
gave feedback in words, which decides SDPO's weight when it is 'auto'.

A child process, because a user's reward module may import anything (torch, a verifier): the launcher itself
imports no training stack.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from composer_serverless.config import RunConfig
from composer_serverless.config.composer import EpisodesConfig
from composer_serverless.data.records import PromptRecord
from composer_serverless.environments.builtin import environment_factory
from composer_serverless.environments.tools import EnvironmentConfigError
from composer_serverless.objectives import inputs
from composer_serverless.objectives.episode_rollout import reset_row
from composer_serverless.objectives.rewards import RewardError, RewardSet, code_root
from composer_serverless.objectives.user_code import failed_at

# Training records a reward is called on.
PROBE_RECORDS = 4


def placeholders(record: PromptRecord) -> list[str]:
    """Completions to call rewards with, for one row: its answer when it has one (a right answer, so a
    verifier's happy path runs) and a short text that answers nothing (so feedback, if any, shows)."""
    return [*([record.answer] if record.answer else []), "placeholder completion"]


def episodes_problem(
    episodes: EpisodesConfig, root: Path | None, record: PromptRecord, *, rewarded: bool
) -> str | None:
    """What is wrong with the tools and environment: a file that does not import, a class without ``reset``, a
    tool without a schema, an environment left to own the reward (``rewarded``: no weighted reward function)
    without a ``get_reward``, or a ``reset`` that raises on the first training row; None when all is well."""
    try:
        factory = environment_factory(episodes, root)
    except EnvironmentConfigError as e:
        return str(e)
    if not rewarded and not factory.owns_reward:
        return (
            f"environment {episodes.environment!r} has no get_reward method, and no reward function of "
            "non-zero weight is configured: nothing would score the episodes\n  fix: define get_reward(self) "
            "returning the episode's reward, or add a [[composer.rewards]] table"
        )
    environment = factory()
    try:
        environment.reset(reset_row(record))
    except Exception as e:
        if episodes.builtin is not None:  # its message says what the row lacks and how to fix it
            return f"environment {episodes.environment!r} cannot start on {record.source}: {e}"
        return (
            f"environment {episodes.environment!r}: reset raised {type(e).__name__}: {e} on {record.source}\n"
            "  fix: make reset(**row) accept the dataset's columns (take those you need by name, the rest "
            "with **kwargs)"
        )
    finally:
        environment.close()
    return None


def check(config: RunConfig) -> dict[str, Any]:
    """``{"problems": [...], "feedback": bool}``: what is wrong with the rewards, and whether one gave feedback."""
    composer = inputs.composer_table(config)
    probed = inputs.read_prompt_set(composer, heldout=False, limit=PROBE_RECORDS)
    pairs = [(r, c) for r in probed for c in placeholders(r)]
    records, completions = [r for r, _ in pairs], [c for _, c in pairs]
    if composer.episodes is not None:
        rewarded = any(r.weight != 0 for r in composer.rewards)
        problem = episodes_problem(composer.episodes, code_root(config), probed[0], rewarded=rewarded)
        if problem is not None:
            return {"problems": [problem], "feedback": False}
    try:
        rewards = RewardSet(composer.rewards, code_root(config))
    except RewardError as e:
        return {"problems": [str(e)], "feedback": False}
    problems: list[str] = []
    feedback = False
    for reward in rewards.rewards:
        try:
            _, notes = reward(records, completions, [[] for _ in records])
        except RewardError as e:
            problems.append(str(e))
        except Exception as e:  # the user's code raised: name the line, and the rows it was called on
            where = failed_at(e, config)
            problems.append(
                f"reward {reward.name!r} raised {type(e).__name__}: {e}"
                + ("" if where is None else f" at {where}")
                + f"\n  called on {records[0].source} and the "
                f"rows after it, with completions {completions[:2]!r}...\n"
                "  fix: make it return None for a row it cannot score (TRL: the reward does not apply there)"
            )
        else:
            feedback = feedback or (reward.weight != 0 and any(notes))  # weight 0: no hint shows it
    return {"problems": problems, "feedback": feedback}


def main() -> None:
    config = RunConfig.model_validate_json(sys.stdin.read())
    print(json.dumps(check(config)), flush=True)
    # Out at once: what the user's code or a reader started (pyarrow's threads, say) may abort in teardown.
    os._exit(0)


if __name__ == "__main__":
    main()
