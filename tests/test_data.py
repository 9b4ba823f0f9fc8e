"""The stdlib corpus split, rank shards and the resumable token streams."""

import pytest

from composer_serverless.models import load_pretrained
from composer_serverless.replicas.data import Batches, TokenStream, shard, stdlib_corpus


def test_split_is_deterministic_and_disjoint(corpus):
    again = stdlib_corpus(5.0)
    assert again.train == corpus.train and again.heldout == corpus.heldout
    assert not set(corpus.train) & set(corpus.heldout)
    share = len(corpus.heldout) / (len(corpus.train) + len(corpus.heldout))
    assert 0.02 < share < 0.08
    assert all(name.endswith(".py") and "site-packages" not in name for name in corpus.train)


def test_shards_partition_the_train_files(corpus):
    shards = [shard(corpus.train, rank, 3, seed=0) for rank in range(3)]
    assert sorted(f for s in shards for f in s) == sorted(corpus.train)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert shard(corpus.train, 1, 3, seed=1) != shards[1]


def test_stream_resumes_exactly(corpus, tiny_model_dir):
    _, tokenizer = load_pretrained(tiny_model_dir)
    files = shard(corpus.train, 0, 50, seed=0)
    stream = TokenStream(corpus, files, tokenizer, 64, seed=3)
    for _ in range(40):
        stream.next_sequence()
    state = stream.state_dict()
    expected = [stream.next_sequence() for _ in range(30)]
    resumed = TokenStream(corpus, files, tokenizer, 64, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.next_sequence() for _ in range(30)] == expected
    assert all(len(s) == 64 for s in expected)


def test_stream_wraps_into_a_reshuffled_epoch(corpus, tiny_model_dir):
    _, tokenizer = load_pretrained(tiny_model_dir)
    files = corpus.heldout[:2]
    stream = TokenStream(corpus, files, tokenizer, 256, seed=0)
    while stream.state_dict()["epoch"] == 0:
        stream.next_sequence()
    assert stream.state_dict()["epoch"] == 1


def test_batches_mix_files_and_resume(corpus, tiny_model_dir):
    _, tokenizer = load_pretrained(tiny_model_dir)
    files = shard(corpus.train, 0, 10, seed=0)
    batches = Batches(corpus, files, tokenizer, 32, 4, seed=0)
    first = batches.next()
    assert first.shape == (4, 32)
    assert len({tuple(row.tolist()) for row in first}) == 4
    state = batches.state_dict()
    expected = batches.next()
    again = Batches(corpus, files, tokenizer, 32, 4, seed=0)
    again.load_state_dict(state)
    assert again.next().equal(expected)


def test_one_stream_per_row_reads_each_rows_files_in_order(corpus, tiny_model_dir):
    """The default: row r is the stream over files[r::batch_size], one sequence per step (what every
    figure in docs/RESULTS.md was measured with)."""
    _, tokenizer = load_pretrained(tiny_model_dir)
    files = shard(corpus.train, 0, 10, seed=0)
    batches = Batches(corpus, files, tokenizer, 32, 4, seed=5)
    rows = [TokenStream(corpus, files[r::4], tokenizer, 32, seed=5 * 7919 + r) for r in range(4)]
    for _ in range(3):
        assert batches.next().tolist() == [row.next_sequence() for row in rows]


def test_rows_take_turns_over_their_streams_and_resume_mid_cycle(corpus, tiny_model_dir):
    _, tokenizer = load_pretrained(tiny_model_dir)
    files = shard(corpus.train, 0, 10, seed=0)
    batches = Batches(corpus, files, tokenizer, 32, 2, seed=5, streams_per_row=3)
    streams = [TokenStream(corpus, files[i::6], tokenizer, 32, seed=5 * 7919 + i) for i in range(6)]
    # Steps 0, 1, 2 read streams (0, 1), (2, 3), (4, 5): six files; step 3 goes back to streams 0 and 1.
    expected = [[streams[2 * (t % 3) + r].next_sequence() for r in range(2)] for t in range(5)]
    got = [batches.next().tolist() for _ in range(2)]
    state = batches.state_dict()
    resumed = Batches(corpus, files, tokenizer, 32, 2, seed=5, streams_per_row=3)
    resumed.load_state_dict(state)
    got += [resumed.next().tolist() for _ in range(3)]
    assert got == expected
    assert len({tuple(row) for step in got[:3] for row in step}) == 6


def test_too_few_files_for_a_batch(corpus, tiny_model_dir):
    _, tokenizer = load_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="cannot feed 8 rows"):
        Batches(corpus, corpus.heldout[:3], tokenizer, 32, 8, seed=0)


def test_eval_set_does_not_depend_on_the_batch_size(tiny_model_dir):
    from composer_serverless.config import validate_config
    from composer_serverless.replicas.objective import LMObjective, evaluate

    model, tokenizer = load_pretrained(tiny_model_dir)
    losses = []
    for batch_size in (4, 32):
        config = validate_config(
            {"model": {"tiny": {}}, "data": {"seq_len": 16, "batch_size": batch_size}, "eval": {"sequences": 20},
             "diloco": {"sync_every": 1, "rounds": 1}}
        )
        losses.append(evaluate(LMObjective(config, tokenizer, rank=0), model)["eval/loss"])
    # Same sequences, different batching: equal up to float summation order.
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
