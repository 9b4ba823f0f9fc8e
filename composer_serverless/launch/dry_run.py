"""What a dry run says besides the plan: the settings the launcher decided, the model's size on the devices
named, what could not be checked without the network, and whether this machine has what the launch needs.

A dry run makes every check ``launch`` makes before it writes (``launcher.prepare``: the config, the data, the
rewards and the model, each check that imports user code or torch in a child process); only the store is left
for the launch to probe, and a Hub model that is not in this machine's cache (a dry run reaches no network).
These lines are for the person about to pay for the run: each automatic choice is shown with the number it
became, and each warning with its fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from composer_serverless.executors import fit

if TYPE_CHECKING:
    from composer_serverless.launch.launcher import Prepared


def settings(prepared: Prepared) -> str:
    """The settings that decide what a step does, as run.json will hold them: the objective, its learning
    rate, SDPO's and the replay's weights and the rollout engine (composer), and the devices."""
    config = prepared.config
    devices = fit.plan_devices(config, prepared.plan)
    parts = [f"objective {config.train.objective}", f"lr {config.train.lr}"]
    composer = config.composer
    if composer is not None:
        assert composer.alpha != "auto"  # prepare decided it
        parts.append(f"alpha {composer.alpha}" + (" (auto)" if prepared.auto_alpha else ""))
        parts.append(f"beta {composer.beta}")
        engine = composer.rollout.engine
        if engine == "auto":  # as the replica picks it (objectives/engines.py: auto_engine)
            where = "a GPU" if devices.on_gpu else "the CPU"
            engine = f"{'paged' if devices.on_gpu else 'reference'} (auto: on {where})"
        parts.append(f"engine {engine}")
    parts.append(f"devices {devices.describe()}")
    return "settings: " + ", ".join(parts)


def model_line(prepared: Prepared) -> str:
    """What the model check found: the parameters and their training state, or why it could not look."""
    config, facts = prepared.config, prepared.model
    if config.model.path is None:
        return "model: the tiny model, built by the launcher"
    if facts.unchecked is not None:
        return f"model: not checked: {facts.unchecked}"
    assert facts.parameters is not None
    total, trainable = facts.parameters["total"], facts.parameters["trainable"]
    state = fit.training_bytes(
        facts.parameters, config.model.dtype, config.model.master_dtype, config.train.optimizer
    )
    trained = "all trained" if trainable == total else f"{trainable:,} trained"
    return (
        f"model: checked (config, tokenizer, a meta-device instance): {total:,} parameters ({trained}), "
        f"{state / 1e9:.2f} GB of weights, gradients and optimizer state per replica before activations"
    )


def warnings(prepared: Prepared) -> list[str]:
    """The model too large for the devices named, or a large model on a CPU (``executors/fit.py``)."""
    if prepared.model.parameters is None:
        return []
    devices = fit.plan_devices(prepared.config, prepared.plan)
    return fit.warnings(prepared.config, devices, prepared.model.parameters)


def left_for_launch(prepared: Prepared) -> list[str]:
    """What only the launch checks: the store always, the model when it could not be read offline."""
    return ["the store"] + (["the model (see above)"] if prepared.model.unchecked is not None else [])
