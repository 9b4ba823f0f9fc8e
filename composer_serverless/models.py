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
from pathlib import Path
from typing import Any

import torch

from composer_serverless.config import TinyModelConfig

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
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


def char_tokenizer(alphabet: str | None = None) -> Any:
    """One token per character of ``alphabet`` (default: printable ASCII), plus end-of-text, padding and
    unknown (any other character).

    The vocabulary is the exploration problem of RL from scratch: a fresh model samples a given one-character
    answer followed by EOS with probability about 1 / V^2, 1e-4 over printable ASCII and 1e-3 over 30 symbols.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([EOS_TOKEN, PAD_TOKEN, UNK_TOKEN, *(alphabet or CHARS)])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
    )


def build_tiny(config: TinyModelConfig, texts: Iterable[str], out_dir: Path, *, seed: int) -> Path:
    """Make the tokenizer (BPE fit on ``texts``, or characters), initialise a Llama model with ``seed``, and
    save both to ``out_dir``. ``texts`` is not read for the character tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if config.tokenizer == "chars":
        tokenizer = char_tokenizer(config.alphabet)
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
    with _no_progress_bars():  # one shard of a tiny model: a bar would only clutter the launcher's status
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
def _no_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_pretrained(path: str | Path, dtype: str = "float32") -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer from a hub id or a directory written by ``save_pretrained``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
