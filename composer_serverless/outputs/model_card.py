"""The model card (``README.md``) an exported or pushed model carries: what it was trained from, how, what it
reached, and the config that reproduces it.

Built from the run's config and its ``summary.json`` alone (pure functions, no I/O), with huggingface_hub's
``ModelCardData`` writing the metadata the Hub reads (base model, datasets, library, tags). The config is
rendered as TOML that ``composer-serverless launch`` loads back to the same run: only the values that differ
from the defaults (what a user writes), without the run id (a new run gets its own) and ``code.root`` (the
launcher's directory; a reproduction's is where its config lies). A config holds no secret: keys and tokens
are named by their environment variables, never given (``run.json`` holds the same).
"""

from __future__ import annotations

import json
import re
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from composer_serverless.config import ComposerConfig, RunConfig
from composer_serverless.data.records import task_label

_HF_DATASET = re.compile(r"^hf://datasets/([\w.-]+/[\w.-]+)")
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def card_text(
    config: RunConfig, summary: dict[str, Any] | None, *, round_index: int, final: bool, title: str
) -> str:
    """The card of the model after round ``round_index`` (``final``: the run's ``final/``) of the run that
    ``config`` (its ``run.json``) and ``summary`` (its ``summary.json``; None before the run finished)
    describe. ``title`` heads it: the Hub repo, or the run id."""
    base = _hub_id(config.model.path)
    data = ModelCardData(
        base_model=base,
        datasets=_datasets(config) or None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["composer-serverless", "diloco", *(["lora"] if config.model.lora is not None else [])],
    )
    rounds = config.diloco.rounds
    which = "the run's final model" if final else f"its checkpoint of round {round_index}"
    body = [
        f"# {title}",
        "",
        f"{_base_text(config)} trained with DiLoCo by composer-serverless across {config.diloco.replicas} "
        f"replicas that met in an object store: run `{config.run_id}`, round {round_index} of {rounds} "
        f"({which}).",
        "",
        "## Training",
        "",
        "| setting | value |",
        "| --- | --- |",
        *(f"| {name} | {value} |" for name, value in _settings(config)),
        "",
    ]
    results = _results(summary, round_index)
    if results:
        body += ["## Results", "", "| figure | value |", "| --- | --- |"]
        body += [f"| {name} | {value} |" for name, value in results]
        body.append("")
    body += [
        "## Reproduce",
        "",
        "Save this config as `config.toml` and launch it (the store and the executor are the run's; change "
        "them with `--set store=...` or `--executor ...`):",
        "",
        "```toml",
        reproduce_toml(config).rstrip("\n"),
        "```",
        "",
        "```bash",
        "composer-serverless launch config.toml",
        "```",
        "",
    ]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)))


def _hub_id(path: str | None) -> str | None:
    """``model.path`` when it reads as a Hub id (``name`` or ``user/name``), not a directory."""
    if path is None or path.startswith(("/", ".", "~")):
        return None
    try:
        validate_repo_id(path)
    except HFValidationError:
        return None
    return path


def _datasets(config: RunConfig) -> list[str]:
    """The Hub datasets the run read (``hf://datasets/OWNER/NAME/...``), in the order the config names them."""
    urls = [config.data.corpus]
    if config.composer is not None:
        cdata = config.composer.data
        urls += [cdata.prompts, cdata.heldout, *([cdata.pairs] if cdata.pairs else [])]
    found = [m.group(1) for url in urls if (m := _HF_DATASET.match(url))]
    return list(dict.fromkeys(found))


def _base_text(config: RunConfig) -> str:
    model = config.model
    if model.tiny is not None:
        tiny = model.tiny
        layers = f"{tiny.num_layers} layer{'' if tiny.num_layers == 1 else 's'}"
        return (
            f"A tiny Llama ({layers}, width {tiny.hidden_size}, {tiny.tokenizer} tokenizer) built from seed "
            f"{config.seed},"
        )
    revision = f" at revision `{model.revision}`" if model.revision else ""
    return f"`{model.path}`{revision}{' with LoRA adapters merged in' if model.lora else ''},"


def _settings(config: RunConfig) -> list[tuple[str, str]]:
    dl, train = config.diloco, config.train
    rows = [("base model", _base_text(config).rstrip(",")), ("data", _data_text(config))]
    composer = config.composer if train.objective == "composer" else None
    if composer is not None:
        rewards = [f"`{r.name or r.fn}` x {r.weight:g}" for r in composer.rewards]
        episodes = composer.episodes
        if episodes is not None and episodes.builtin is not None:  # its reward may be the only one
            rewards.append(f"`{episodes.environment}`'s own x {episodes.environment_reward_weight:g}")
        elif not composer.rewards and episodes is not None and episodes.environment is not None:
            # The environment owns the reward alone (the launcher checked that its class has get_reward).
            owner = episodes.environment.rpartition(":")[2]
            rewards.append(f"`{owner}.get_reward()` x {episodes.environment_reward_weight:g}")
        rows.append(("objective", f"composer: {_channels(composer)}; rewards: {', '.join(rewards)}"))
    else:
        rows.append(("objective", "causal LM (next-token cross-entropy)"))
    if config.model.lora is not None:
        lora = config.model.lora
        rows.append(("LoRA", f"r {lora.r}, alpha {lora.alpha:g}, targets {lora.target_modules}"))
    rows += [
        ("precision", f"compute {config.model.dtype}, masters {config.model.master_dtype}"),
        ("replicas (M)", str(dl.replicas)),
        ("inner steps per round (H, sync_every)", str(dl.sync_every)),
        ("rounds", str(dl.rounds)),
        ("fragments (Streaming DiLoCo)", str(dl.fragments)),
        ("inner optimizer", f"{train.optimizer}, lr {train.lr:g}, {train.schedule} schedule"),
        (
            "outer optimizer",
            f"SGD, lr {dl.outer_lr:g}, momentum {dl.outer_momentum:g}, Nesterov {'on' if dl.nesterov else 'off'}",
        ),
        ("exchange codec", dl.codec),
        ("batch", _batch_text(config)),
    ]
    return rows


def _channels(composer: ComposerConfig) -> str:
    """The loss as trained: GRPO, and SDPO and replay with their weights when on (``alpha`` is a number once
    the launcher has decided ``"auto"``, as in ``run.json``)."""
    terms = [f"GRPO ({composer.grpo.loss_type} loss)"]
    alpha = composer.alpha
    if alpha == "auto" or alpha > 0:
        terms.append(f"{alpha if alpha == 'auto' else format(alpha, 'g')} x SDPO")
    if composer.replay_on:
        terms.append(f"{composer.beta:g} x replay ({composer.replay.kind})")
    return " + ".join(terms)


def _batch_text(config: RunConfig) -> str:
    """What one inner step of one replica trains on: a composer step samples its batch (the lm objective's
    ``data.batch_size`` and ``seq_len`` are not read), an lm step reads sequences of the corpus."""
    composer = config.composer if config.train.objective == "composer" else None
    if composer is None:
        return f"{config.data.batch_size} x {config.data.seq_len} tokens per inner step per replica"
    rollout = composer.rollout
    pairs = f", and {composer.replay.pairs_per_step} preference pairs" if composer.replay_on else ""
    return (
        f"{rollout.prompts_per_step} prompts x {rollout.group_size} completions of up to "
        f"{rollout.max_new_tokens} new tokens (temperature {rollout.temperature:g}){pairs} per inner step "
        "per replica"
    )


def _data_text(config: RunConfig) -> str:
    if config.train.objective == "composer" and config.composer is not None:
        cdata = config.composer.data
        return f"prompts `{cdata.prompts}`, held out `{cdata.heldout}`" + (
            f", pairs `{cdata.pairs}`" if cdata.pairs else ""
        )
    if config.data.corpus == "stdlib":
        return "the Python standard library's source (the offline demo corpus)"
    return f"`{config.data.corpus}` ({config.data.format} records)"


def _results(summary: dict[str, Any] | None, round_index: int) -> list[tuple[str, str]]:
    """The run's figures from ``summary.json`` (``report.summarise``), with the exported round's own."""
    if summary is None:
        return []
    decoupled = summary.get("mode") == "decoupled"  # summaries before the field: lock-step runs
    rounds = "global versions merged" if decoupled else "rounds committed"
    rows = [(rounds, f"{summary['rounds_committed']} of {summary['rounds']}")]
    for what, key in (("loss", "eval_loss"), ("reward", "eval_reward")):
        final = summary.get(f"final_{key}")
        if final is None:
            continue
        initial = summary.get(f"initial_{key}")
        start = "-" if initial is None else f"{initial:.4f}"
        rows.append((f"held-out {what}, initial -> final", f"{start} -> {final:.4f}"))
        at_round = summary.get(f"{key}_by_round", {}).get(str(round_index))
        if at_round is not None:
            rows.append((f"held-out {what} at round {round_index} (this model)", f"{at_round:.4f}"))
    for task, figures in summary.get("eval_reward_by_task", {}).items():
        rows.append(
            (
                f"held-out reward on {task_label(task)}, final (best)",
                f"{figures['final']:.4f} ({figures['best']:.4f})",
            )
        )
    rows += [
        (
            "learners held the same bytes of every version they adopted"
            if decoupled
            else "replicas bit-identical after every sync",
            str(summary["replicas_bit_identical"]).lower(),
        ),
        ("wall time", f"{summary['wall_s']:.0f} s"),
    ]
    return rows


def reproduce_toml(config: RunConfig) -> str:
    """The config as TOML that ``launch`` loads back to ``config`` (up to the run id and ``code.root``): the
    values that differ from the defaults, the executor's type always (it selects the executor's table)."""
    raw = config.model_dump(mode="json", exclude_defaults=True)
    raw.pop("run_id", None)
    raw.get("code", {}).pop("root", None)
    if not raw.get("code", True):
        raw.pop("code")
    raw["executor"] = {"type": config.executor.type, **raw.get("executor", {})}
    return "\n".join(_toml_table(raw, [])).lstrip("\n") + "\n"


def _toml_table(table: dict[str, Any], path: list[str]) -> list[str]:
    """A table's TOML lines: its values first, then its sub-tables and arrays of tables. A None (TOML has no
    null) is written as a comment: such a value can only come from a config made in Python."""
    lines, nested = [], []
    for key, value in table.items():
        if value is None:
            lines.append(f"# {_key(key)} is unset")
        elif isinstance(value, dict):
            nested += _toml_section(value, [*path, key], array=False)
        elif _is_tables(value):
            for item in value:
                nested += _toml_section(item, [*path, key], array=True)
        else:
            lines.append(f"{_key(key)} = {_value(value)}")
    return lines + nested


def _toml_section(table: dict[str, Any], path: list[str], *, array: bool) -> list[str]:
    """A sub-table under its header; a table that holds only tables needs none (``[a.b]`` implies ``[a]``)."""
    own = not table or any(not isinstance(v, dict) and not _is_tables(v) for v in table.values())
    if not (array or own):
        return _toml_table(table, path)
    header = f"[[{_dotted(path)}]]" if array else f"[{_dotted(path)}]"
    return ["", header, *_toml_table(table, path)]


def _is_tables(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = repr(value)
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(text, text)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write a {type(value).__name__} as TOML")


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key, ensure_ascii=False)


def _dotted(path: list[str]) -> str:
    return ".".join(_key(part) for part in path)
