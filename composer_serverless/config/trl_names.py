"""TRL's names for what this project names otherwise (GRPOConfig, TrainingArguments, TRL's script and model
arguments), so that a key a TRL user writes from habit is answered with our name for the same thing, and
with what differs, instead of a bare "unknown key" (``loading.py``). docs/coming-from-trl.md shows the table.
"""

from __future__ import annotations

from typing import NamedTuple


class TrlName(NamedTuple):
    """``ours``: the dotted key that does TRL's job here (None: nothing does); ``note``: what differs."""

    ours: str | None
    note: str


# TRL's key -> ours. Only names a TRL user might write where they are not a key of ours: a name we share with
# TRL (seed, warmup_steps, weight_decay) is no entry.
TRL_NAMES: dict[str, TrlName] = {
    "learning_rate": TrlName("train.lr", "the composer objective's default is TRL's, 1e-6"),
    "num_generations": TrlName("composer.rollout.group_size", "completions per prompt, the GRPO group"),
    "max_completion_length": TrlName(
        "composer.rollout.max_new_tokens", "the generation limit per completion, EOS included"
    ),
    "beta": TrlName(
        "composer.grpo.kl",
        "TRL's beta is the KL weight; composer.beta here is the replay channel's weight",
    ),
    "epsilon": TrlName("composer.grpo.eps_low", "the lower clip range of the importance ratio"),
    "epsilon_high": TrlName("composer.grpo.eps_high", "the upper clip range (DAPO's clip-higher)"),
    "loss_type": TrlName("composer.grpo.loss_type", "grpo, bnpo, dr_grpo or dapo (the default, as in TRL)"),
    "scale_rewards": TrlName(
        "composer.grpo.scale_rewards", "'group' or 'none'; TRL's 'batch' is not offered"
    ),
    "temperature": TrlName("composer.rollout.temperature", "eval.temperature is the evaluation's"),
    "reward_funcs": TrlName(
        "composer.rewards", "one [[composer.rewards]] table per reward, its function in fn"
    ),
    "reward_weights": TrlName("composer.rewards", "each [[composer.rewards]] table's weight"),
    "per_device_train_batch_size": TrlName(
        "composer.rollout.prompts_per_step",
        "prompts per inner step on each replica; TRL's batch counts completions (prompts x num_generations)",
    ),
    "gradient_accumulation_steps": TrlName(
        "train.micro_batch_size",
        "the size of a micro-batch, not their number: a step's gradient accumulates over micro-batches of it",
    ),
    "num_iterations": TrlName(
        None, "one optimizer step per batch of rollouts, TRL's default num_iterations = 1"
    ),
    "max_steps": TrlName("diloco.rounds", "each replica runs diloco.rounds x diloco.sync_every inner steps"),
    "eval_steps": TrlName("eval.every_rounds", "counted in outer rounds"),
    "num_generations_eval": TrlName("eval.samples", "completions per held-out prompt"),
    "max_grad_norm": TrlName("train.grad_clip", "the inner gradient's norm is clipped to it"),
    "lr_scheduler_type": TrlName("train.schedule", "'constant' or 'cosine'"),
    "warmup_ratio": TrlName("train.warmup_steps", "counted in inner steps, not as a ratio"),
    "adam_beta1": TrlName("train.betas", "one pair [beta1, beta2]"),
    "adam_beta2": TrlName("train.betas", "one pair [beta1, beta2]"),
    "optim": TrlName("train.optimizer", "'adamw' or 'sgd'"),
    "bf16": TrlName("model.dtype", "model.dtype = 'bf16' computes in bfloat16 over float32 master weights"),
    "fp16": TrlName(None, "float16 needs loss scaling, which is not offered: use model.dtype = 'bf16'"),
    "torch_dtype": TrlName("model.dtype", "'bf16' or 'fp32' (also 'bfloat16', 'float32')"),
    "disable_dropout": TrlName("model.dropout", "'off' (the default) or 'as_published'"),
    "model_name_or_path": TrlName("model.path", "a Hub id or a save_pretrained directory"),
    "model_revision": TrlName("model.revision", "a branch, tag or commit"),
    "use_peft": TrlName("model.lora", "a [model.lora] table switches LoRA on"),
    "lora_r": TrlName("model.lora.r", "in the [model.lora] table"),
    "lora_alpha": TrlName("model.lora.alpha", "in the [model.lora] table"),
    "lora_dropout": TrlName("model.lora.dropout", "in the [model.lora] table"),
    "lora_target_modules": TrlName("model.lora.target_modules", "in the [model.lora] table"),
    "dataset_name": TrlName("composer.data.prompts", "hf://datasets/OWNER/NAME, or files (JSONL, Parquet)"),
    "dataset_config": TrlName("composer.data.subset", "the dataset's configuration, e.g. 'main'"),
    "dataset_train_split": TrlName("composer.data.train_split", "the split trained on"),
    "dataset_test_split": TrlName(
        "composer.data.heldout_split", "the split the global model is evaluated on"
    ),
    "use_vllm": TrlName(
        "composer.rollout.engine",
        "no vLLM: 'paged' is transformers' continuous batching (the default on a GPU)",
    ),
    "top_p": TrlName(
        None, "sampling is pure softmax(logits / temperature), as the policy gradient's ratios need"
    ),
    "top_k": TrlName(
        None,
        "sampling is pure softmax(logits / temperature), as the policy gradient's ratios need "
        "(composer.sdpo.top_k is SDPO's, another thing)",
    ),
    "min_p": TrlName(
        None, "sampling is pure softmax(logits / temperature), as the policy gradient's ratios need"
    ),
    "repetition_penalty": TrlName(
        None, "sampling is pure softmax(logits / temperature), as the policy gradient's ratios need"
    ),
    "report_to": TrlName(
        "tracking.report_to", "a tracker's name, a list of them, 'all' or 'none', as in TRL"
    ),
    "run_name": TrlName("tracking.name", "the tracker run's name; the run id when unset"),
    "logging_dir": TrlName("tracking.dir", "local files of the trackers"),
    "log_completions": TrlName("tracking.completions_per_round", "completions kept per replica per round"),
    "output_dir": TrlName("store", "the run's checkpoints and metrics go to <store>/<run_id>"),
    "hub_model_id": TrlName("output.push_to_hub", "the Hub repo the final model is pushed to"),
    "push_to_hub": TrlName("output.push_to_hub", "the repo id itself (TRL's is a flag beside hub_model_id)"),
    "hub_private_repo": TrlName("output.private", "true by default here"),
}


def trl_hint(key: str) -> str | None:
    """What to tell a user who wrote TRL's ``key`` where it is no key of ours; None if it is not TRL's."""
    name = TRL_NAMES.get(key)
    if name is None:
        return None
    if name.ours is None:
        return f"that is TRL's name, with no equivalent here: {name.note}"
    return f"that is TRL's name; here it is `{name.ours}` ({name.note})"


def describe() -> list[tuple[str, str, str]]:
    """The table as docs/coming-from-trl.md shows it: (TRL's key, ours or '-', what differs)."""
    return [(trl, f"`{name.ours}`" if name.ours else "-", name.note) for trl, name in TRL_NAMES.items()]
