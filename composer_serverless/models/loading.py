"""Load the model and tokenizer a run trains, and build the tiny offline demo model.

Replicas always load through ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``, exactly as they
would load a hub model, so the demo exercises the same path a user's 7B model takes. The tiny model is a
Llama-family model with either a byte-level BPE tokenizer fit on the demo corpus or a character tokenizer
over printable ASCII; both are written with ``save_pretrained`` (safetensors, JSON), so nothing about them is
special once built.
"""

from __future__ import annotations

import contextlib
import logging
import string
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from composer_serverless.config import ModelConfig, TinyModelConfig

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
# ChatML's turn markers, tokens of their own in the tokenizers of the models whose templates we ship.
CHAT_START = "<|im_start|>"
CHAT_END = "<|im_end|>"
TEMPLATES = Path(__file__).parent / "templates"
# Printable ASCII without the vertical whitespace nobody types (\r, \x0b, \x0c): 96 characters.
CHARS = "".join(c for c in string.printable if c not in "\r\x0b\x0c")
# Room for positions: evaluation and packing never exceed the configured sequence length.
TINY_MAX_POSITIONS = 4096

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """Fit a byte-level BPE tokenizer (GPT-2 style: every byte is representable, no unknown token).

    Padding has its own token, distinct from end-of-text, so masking padding never masks a real EOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )


def chat_template_text(name: str) -> str:
    """A chat template shipped with the package (``models/templates/<name>.jinja``), exactly as published."""
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def char_tokenizer(alphabet: str | None = None, chat_template: str | None = None) -> Any:
    """One token per character of ``alphabet`` (default: printable ASCII), plus end-of-text, padding and
    unknown (any other character).

    The vocabulary is the exploration problem of RL from scratch: a fresh model samples a given one-character
    answer followed by EOS with probability about 1 / V^2, 1e-4 over printable ASCII and 1e-3 over 30 symbols.

    With ``chat_template`` (a name in ``models/templates``, all ChatML) the tokenizer carries that template
    and, as the published tokenizer does, ``<|im_start|>`` and ``<|im_end|>`` as single tokens with
    ``<|im_end|>`` as EOS: a turn the model writes then ends where generation stops.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chat = [CHAT_START, CHAT_END] if chat_template is not None else []
    specials = [EOS_TOKEN, PAD_TOKEN, UNK_TOKEN, *chat]
    vocab = {token: i for i, token in enumerate([*specials, *(alphabet or CHARS)])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=CHAT_END if chat else EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=chat,
    )
    if chat_template is not None:
        fast.chat_template = chat_template_text(chat_template)
    return fast


def build_tiny(config: TinyModelConfig, texts: Iterable[str], out_dir: Path, *, seed: int) -> Path:
    """Make the tokenizer (BPE fit on ``texts``, or characters), initialise a Llama model with ``seed``, and
    save both to ``out_dir``. ``texts`` is not read for the character tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if config.tokenizer == "chars":
        tokenizer = char_tokenizer(config.alphabet, config.chat_template)
    else:
        tokenizer = train_tokenizer(texts, config.vocab_size)
    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=TINY_MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(model_config)
    out_dir.mkdir(parents=True, exist_ok=True)
    with no_progress_bars():  # one shard of a tiny model: a bar would only clutter the launcher's status
        model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    logger.info(
        "built tiny model: %d parameters, vocabulary %d, in %s",
        sum(p.numel() for p in model.parameters()),
        len(tokenizer),
        out_dir,
    )
    return out_dir


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' own progress bars ("Loading weights", "Writing model shards") off meanwhile, put back as
    they were: on a command's terminal they are noise between its lines, in a log a line of carriage returns."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


@dataclass
class Loaded:
    """A model ready to train.

    Attributes:
        model: the Hugging Face causal LM the objective computes with (with LoRA layers injected, if any).
        tokenizer: its tokenizer, with a pad token.
        adapters: the peft wrapper when training LoRA adapters: it switches them off (the base model as
            reference) and saves them; None for a full fine-tune.
    """

    model: nn.Module
    tokenizer: Any
    adapters: Any = None


def hf_config(spec: ModelConfig, source: str | Path) -> Any:
    """The checkpoint's config with the run's changes: overrides, the router loss, dropout off.

    Modules copy config values when they are built, so these changes must reach the config before the model
    is instantiated; editing ``model.config`` afterwards changes nothing.

    Raises:
        ValueError: an override names a key the config does not have, or the router loss is asked of a model
            without a router.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(source), **_hub_options(spec))
    text = config.get_text_config()
    for key, value in spec.config_overrides.items():
        target = config if hasattr(config, key) else text if hasattr(text, key) else None
        if target is None:
            raise ValueError(f"model.config_overrides: {type(config).__name__} has no {key!r}")
        setattr(target, key, value)
    if spec.router_aux_loss is not None:
        if not hasattr(text, "output_router_logits"):
            raise ValueError(
                f"model.router_aux_loss: {type(text).__name__} has no router (output_router_logits); "
                "it applies to mixture-of-experts models"
            )
        text.output_router_logits = True
        text.router_aux_loss_coef = spec.router_aux_loss
    if spec.dropout == "off":
        zero_dropout(config)
    return config


def zero_dropout(config: Any) -> list[str]:
    """Set every dropout and LayerDrop probability of ``config`` (and its sub-configs) to 0; the names set."""
    zeroed = []
    for name, value in vars(config).items():
        if "drop" in name and isinstance(value, float) and not isinstance(value, bool) and value > 0:
            setattr(config, name, 0.0)
            zeroed.append(name)
        elif hasattr(value, "to_dict") and hasattr(value, "get_text_config"):  # a sub-config
            zeroed += [f"{name}.{sub}" for sub in zero_dropout(value)]
    return zeroed


def load_model(spec: ModelConfig, source: str | Path) -> Loaded:
    """Load ``spec``'s model from ``source`` (a hub id or a save_pretrained directory) as it will train.

    Trainable weights are kept in ``master_dtype``; with LoRA the frozen base is kept in ``dtype`` and the
    adapters in ``master_dtype``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stored = spec.dtype if spec.lora is not None else spec.master_dtype
    options: dict[str, Any] = {"dtype": DTYPES[stored], **_hub_options(spec)}
    if spec.attn_implementation is not None:
        options["attn_implementation"] = spec.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(source), config=hf_config(spec, source), **options)
    tokenizer = AutoTokenizer.from_pretrained(str(source), **_hub_options(spec))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if spec.gradient_checkpointing:
        # Non-reentrant: it needs no input that requires grad, so frozen embeddings (LoRA) are fine.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.lora is None:
        return Loaded(model, tokenizer)
    adapters = _with_lora(model, spec)
    return Loaded(adapters.get_base_model(), tokenizer, adapters)


def _with_lora(model: nn.Module, spec: ModelConfig) -> Any:
    from peft import LoraConfig, get_peft_model

    lora = spec.lora
    assert lora is not None
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    # Adapters in the masters' dtype; peft upcasts them to float32 unless told not to.
    return get_peft_model(model, config, autocast_adapter_dtype=spec.master_dtype == "float32")


def merge_adapters(
    spec: ModelConfig, base: str | Path, adapters: Path, out: Path, dtype: str | None = None
) -> None:
    """Save into ``out`` the base model with the LoRA ``adapters`` (a peft directory) merged into its weights,
    and the tokenizer: a plain Hugging Face model that needs neither peft nor the adapters to load. The merge
    is made in the run's dtype; the weights are saved in ``dtype`` (the run's when None)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_model = AutoModelForCausalLM.from_pretrained(
        str(base), config=hf_config(spec, base), dtype=DTYPES[spec.dtype], **_hub_options(spec)
    )
    merged = PeftModel.from_pretrained(base_model, str(adapters)).merge_and_unload(progressbar=False)
    merged.to(DTYPES[dtype or spec.dtype]).save_pretrained(out)
    AutoTokenizer.from_pretrained(str(adapters)).save_pretrained(out)


def save_in_dtype(spec: ModelConfig, source: Path, out: Path, dtype: str) -> None:
    """Save the Hugging Face model and tokenizer in ``source`` into ``out`` with the weights in ``dtype``
    (``from_pretrained`` casts floating-point weights only, and records the dtype in the config)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options = {"trust_remote_code": spec.trust_remote_code}
    AutoModelForCausalLM.from_pretrained(str(source), dtype=DTYPES[dtype], **options).save_pretrained(out)
    AutoTokenizer.from_pretrained(str(source), **options).save_pretrained(out)


def _hub_options(spec: ModelConfig) -> dict[str, Any]:
    options: dict[str, Any] = {"trust_remote_code": spec.trust_remote_code}
    if spec.revision is not None:
        options["revision"] = spec.revision
    return options


def load_pretrained(path: str | Path, dtype: str = "float32") -> tuple[Any, Any]:
    """A causal LM and its tokenizer from a hub id or a save_pretrained directory, weights in ``dtype``."""
    loaded = load_model(ModelConfig(path=str(path), dtype=dtype, master_dtype=dtype), path)
    return loaded.model, loaded.tokenizer
