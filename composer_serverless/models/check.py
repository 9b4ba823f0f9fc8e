"""The model check the launcher runs before any replica is paid for: ``python -m
composer_serverless.models.check [--offline]`` with the resolved run config (JSON) on stdin, one JSON
object on stdout: the problems, the model's parameters (counted on the meta device: what the launcher sizes
the devices and the cost estimate by), and, offline, why the model could not be checked.

Everything that would otherwise fail only once every replica has started (and restarted, ``max_restarts``
times): the checkpoint's config, remote code, the overrides, the tokenizer, the model built on the meta device
(no weights are read or allocated), its vocabulary against the tokenizer's, the pad token, what the objective
needs of the model (a backbone, a linear head, no dropout for SDPO), the chat template and the first chat
records, LoRA's target modules, gradient checkpointing. Each problem says what to change.

It runs in a child process so that the launcher itself never imports torch or transformers, and so that a
checkpoint's remote code, when the user allows it, runs in a process that exits right after.

``--offline`` (a dry run, which touches no network) reads a Hub model from this machine's Hugging Face cache
only; one that is not there is reported as not checked, with why, rather than passed or failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any

# Chat records rendered at launch, to find a template that cannot be masked before any replica starts.
CHAT_RECORDS_CHECKED = 8


def examine(config: Any, offline: bool = False) -> dict[str, Any]:
    """``{"problems": [...], "parameters": {"total": N, "trainable": M} | None, "unchecked": str | None}``:
    what stops ``config``'s model from training as configured (empty when nothing does), its size, and, when
    ``offline`` and the model is on the Hub but not in this machine's cache, why it was not checked."""
    spec = config.model
    found: dict[str, Any] = {"problems": [], "parameters": None, "unchecked": None}
    if offline and not _cached(spec):  # said before torch is imported: a dry run's seconds
        found["unchecked"] = (
            f"model.path {spec.path!r} is not a directory here, so it names a Hub repository, and that is not "
            "in this machine's Hugging Face cache; a dry run reaches no network, so the model (its config, "
            "tokenizer and chat template) was not checked: the launch checks it before anything is written"
        )
        return found
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from composer_serverless.models.loading import hf_config

    hub = {
        "trust_remote_code": spec.trust_remote_code,
        **({"revision": spec.revision} if spec.revision else {}),
    }
    try:
        hf = hf_config(spec, spec.path)
        tokenizer = AutoTokenizer.from_pretrained(spec.path, **hub)
    except Exception as e:  # every failure to load means one thing to the user: this model will not do
        found["problems"] = [_loading_problem(spec, e)]
        return found
    try:
        with torch.device("meta"):
            extra = {"attn_implementation": spec.attn_implementation} if spec.attn_implementation else {}
            model = AutoModelForCausalLM.from_config(hf, trust_remote_code=spec.trust_remote_code, **extra)
    except Exception as e:  # an architecture, kernel or remote code that cannot be built
        found["problems"] = [
            f"model.path {spec.path!r}: the model cannot be built from its config: {type(e).__name__}: {e}"
        ]
        return found
    problems = (
        _vocabulary(model, tokenizer)
        + _objective(config, model, hf)
        + _chat(config, tokenizer)
        + _tool_template(config, tokenizer)
    )
    found["problems"] = problems + _lora(spec, model) + _checkpointing(spec, model)
    found["parameters"] = parameters(spec, model)
    return found


def _cached(spec: Any) -> bool:
    """Whether the model can be read without the network: a directory, or a Hub repository whose config is in
    this machine's Hugging Face cache (``HF_HUB_OFFLINE`` is set: nothing is downloaded)."""
    from transformers.utils.hub import cached_file

    if os.path.isdir(spec.path):
        return True
    found = cached_file(
        spec.path,
        "config.json",
        revision=spec.revision,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )
    return found is not None


def parameters(spec: Any, model: Any) -> dict[str, int]:
    """The model's parameters, and those that train: all of them, or with LoRA the adapters' ``r x (in +
    out)`` per adapted linear layer (every one but the output head for 'all-linear', as peft chooses)."""
    total = sum(p.numel() for p in model.parameters())
    if spec.lora is None:
        return {"total": total, "trainable": total}
    import torch

    head = model.get_output_embeddings()
    targets = spec.lora.target_modules
    adapters = sum(
        spec.lora.r * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and m is not head
        and (targets == "all-linear" or name.rsplit(".", 1)[-1] in targets)
    )
    return {"total": total + adapters, "trainable": adapters}


def _loading_problem(spec: Any, error: Exception) -> str:
    text = f"{type(error).__name__}: {error}"
    if "trust_remote_code" in text and not spec.trust_remote_code:
        return (
            f"model.path {spec.path!r} ships its own Python code (its config's auto_map), which runs only "
            "with your consent\n  fix: --set model.trust_remote_code=true, if you trust that repository"
        )
    return f"model.path {spec.path!r} cannot be loaded: {text}"


def _vocabulary(model: Any, tokenizer: Any) -> list[str]:
    found = []
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        found.append(
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding only {rows} rows, so some "
            "token ids would index past it\n  fix: use the tokenizer published with the model"
        )
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        found.append("the tokenizer has neither a pad nor an end-of-text token; batches cannot be padded")
    return found


def _objective(config: Any, model: Any, hf: Any) -> list[str]:
    if config.train.objective != "composer":
        return []
    import torch

    found = []
    if model.base_model is model:
        found.append(
            f"{type(model).__name__} has no separate backbone (base_model), which the composer losses need"
        )
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        found.append(
            f"{type(model).__name__}'s output head is not a linear layer, which the composer losses need"
        )
    if config.model.router_aux_loss is not None:
        found.append("model.router_aux_loss applies to the lm objective only\n  fix: unset it")
    if config.composer.sdpo_on:
        dropping = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        dropping += [
            n for n, v in vars(hf.get_text_config()).items() if "drop" in n and isinstance(v, float) and v > 0
        ]
        lora = config.model.lora
        if lora is not None and lora.dropout > 0:
            dropping.append("model.lora.dropout")
        if dropping:
            found.append(
                f"SDPO's teacher pass reuses the student's weights, but this model drops units in training "
                f"({', '.join(dropping[:4])}{', ...' if len(dropping) > 4 else ''}), so the two passes would be "
                "different networks\n  fix: --set model.dropout=off (and model.lora.dropout=0)"
            )
    return found


def _chat(config: Any, tokenizer: Any) -> list[str]:
    from composer_serverless.data.chat import render_chat
    from composer_serverless.data.corpus import TOOLS_FIELD
    from composer_serverless.data.records import read_rows

    chat_data = not config.data.is_stdlib and config.data.format == "chat" and config.train.objective == "lm"
    chat_prompts = config.composer is not None and config.composer.chat_template
    if not (chat_data or chat_prompts):
        return []
    if getattr(tokenizer, "chat_template", None) is None:
        return [
            "the tokenizer has no chat template, so "
            + ("data.format = 'chat' records" if chat_data else "composer.chat_template prompts")
            + " cannot be rendered\n  fix: use a chat model's tokenizer, or render the text yourself"
        ]
    if not chat_data:
        return []
    field = config.data.messages_field
    for row, where in itertools.islice(read_rows(config.data.corpus), CHAT_RECORDS_CHECKED):
        try:
            render_chat(tokenizer, row.get(field) or [], row.get(TOOLS_FIELD))
        except ValueError as e:
            return [f"{where}: {e}"]
    return []


def _tool_template(config: Any, tokenizer: Any) -> list[str]:
    """Episodes need a chat template that renders the tools' schemas and the tools' answers."""
    if config.composer is None or config.composer.episodes is None:
        return []
    from composer_serverless.environments.template import tool_template_problem

    problem = tool_template_problem(tokenizer, config.model.path)
    return [] if problem is None else [problem]


def _lora(spec: Any, model: Any) -> list[str]:
    if spec.lora is None or spec.lora.target_modules == "all-linear":
        return []
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in spec.lora.target_modules if t not in names]
    if not missing:
        return []
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear"})
    return [
        f"model.lora.target_modules {missing} name no module of {type(model).__name__}; its linear layers are "
        f"{linear}\n  fix: pick from those, or 'all-linear'"
    ]


def _checkpointing(spec: Any, model: Any) -> list[str]:
    if spec.gradient_checkpointing and not getattr(model, "supports_gradient_checkpointing", False):
        return [f"{type(model).__name__} does not support gradient checkpointing\n  fix: unset it"]
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description="the launcher's model check (the run config on stdin)")
    parser.add_argument("--offline", action="store_true", help="read the Hub from this machine's cache only")
    offline = parser.parse_args().offline
    if offline:  # before transformers and huggingface_hub read it, at import
        os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers.utils import logging as hf_logging

    from composer_serverless.config import RunConfig

    hf_logging.set_verbosity_error()
    config = RunConfig.model_validate_json(sys.stdin.read())
    print(json.dumps(examine(config, offline)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
