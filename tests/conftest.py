import pytest

from composer_serverless.config import TinyModelConfig

# Small enough to build in a few seconds, large enough to be a real Llama with a real BPE vocabulary.
TINY = TinyModelConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, tokenizer_corpus_mb=0.3)


@pytest.fixture(scope="session")
def corpus():
    from composer_serverless.replicas.data import stdlib_corpus

    return stdlib_corpus(5.0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, corpus):
    """A tiny Llama and its tokenizer, built once per session and saved with save_pretrained."""
    from composer_serverless.models import build_tiny
    from composer_serverless.replicas.data import training_text

    out = tmp_path_factory.mktemp("tiny-model")
    return build_tiny(TINY, training_text(corpus, int(TINY.tokenizer_corpus_mb * 1e6), seed=0), out, seed=0)
