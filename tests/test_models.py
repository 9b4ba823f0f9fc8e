"""The tiny model and tokenizer load back through the same from_pretrained path a hub model takes."""

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from composer_serverless.models.loading import EOS_TOKEN, PAD_TOKEN, load_pretrained
from tests.conftest import TINY


def test_build_then_from_pretrained_round_trip(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.hidden_size == TINY.hidden_size and model.config.num_hidden_layers == TINY.num_layers
    assert model.config.vocab_size == len(tokenizer) <= TINY.vocab_size
    saved = load_file(tiny_model_dir / "model.safetensors")
    loaded = model.state_dict()
    assert saved and all(torch.equal(loaded[name], tensor) for name, tensor in saved.items())


def test_tokenizer_is_byte_level_with_distinct_pad_and_eos(tiny_model_dir):
    _, tokenizer = load_pretrained(tiny_model_dir)
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == PAD_TOKEN
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    # Byte-level BPE: any text, including characters never seen in training, decodes back exactly.
    text = "def f(x):\n    return x ** 2  # ünïcödé ✓ 🚀\n"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned


def test_load_pretrained_bfloat16(tiny_model_dir):
    model, _ = load_pretrained(tiny_model_dir, "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_same_seed_same_weights(tmp_path, corpus):
    from composer_serverless.data.corpus import training_text
    from composer_serverless.models.loading import build_tiny

    dirs = [
        build_tiny(TINY, training_text(corpus, 200_000, seed=0), tmp_path / str(i), seed=7) for i in range(2)
    ]
    a, b = (load_file(d / "model.safetensors") for d in dirs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (dirs[0] / "tokenizer.json").read_bytes() == (dirs[1] / "tokenizer.json").read_bytes()
