"""The stdlib corpus split, the replicas' rows of the global batch and the resumable token streams."""

import pytest
import torch

from composer_serverless.data.corpus import shuffled, stdlib_corpus
from composer_serverless.data.packing import Batches, TokenStream
from composer_serverless.models.loading import load_pretrained


def test_split_is_deterministic_and_disjoint(corpus):
    again = stdlib_corpus(5.0)
    assert again.train == corpus.train and again.heldout == corpus.heldout
    assert not set(corpus.train) & set(corpus.heldout)
    share = len(corpus.heldout) / (len(corpus.train) + len(corpus.heldout))
    assert 0.02 < share < 0.08
    assert all(name.endswith(".py") and "site-packages" not in name for name in corpus.train)


def test_shuffled_is_a_seeded_permutation(corpus):
    order = shuffled(corpus.train, seed=0)
    assert sorted(order) == sorted(corpus.train) and order != corpus.train
    assert shuffled(corpus.train, seed=0) == order
    assert shuffled(corpus.train, seed=1) != order


def test_stream_resumes_exactly(corpus, tiny_model_dir):
    _, tokenizer = load_pretrained(tiny_model_dir)
    files = shuffled(corpus.train, seed=0)[::50]
    stream = TokenStream(corpus, files, tokenizer, 64, seed=3)
    for _ in range(40):
        stream.next_sequence()[0]
    state = stream.state_dict()
    expected = [stream.next_sequence()[0] for _ in range(30)]
    resumed = TokenStream(corpus, files, tokenizer, 64, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.next_sequence()[0] for _ in range(30)] == expected
    assert all(len(s) == 64 for s in expected)


def test_stream_wraps_into_a_reshuffled_epoch(corpus, tiny_model_dir):
    _, tokenizer = load_pretrained(tiny_model_dir)
    files = corpus.heldout[:2]
    stream = TokenStream(corpus, files, tokenizer, 256, seed=0)
    while stream.state_dict()["epoch"] == 0:
        stream.next_sequence()[0]
    assert stream.state_dict()["epoch"] == 1


def test_batches_mix_files_and_resume(corpus, tiny_model_dir):
    _, tokenizer = load_pretrained(tiny_model_dir)
    files = shuffled(corpus.train, seed=0)[::10]
    batches = Batches(corpus, files, tokenizer, 32, 4, seed=0)
    first = batches.next()[0]
    assert first.shape == (4, 32)
    assert len({tuple(row.tolist()) for row in first}) == 4
    state = batches.state_dict()
    expected = batches.next()[0]
    again = Batches(corpus, files, tokenizer, 32, 4, seed=0)
    again.load_state_dict(state)
    assert again.next()[0].equal(expected)


def test_one_stream_per_row_reads_each_rows_files_in_order(corpus, tiny_model_dir):
    """The default: row r is the stream over files[r::batch_size], one sequence per step."""
    _, tokenizer = load_pretrained(tiny_model_dir)
    files = shuffled(corpus.train, seed=0)[::10]
    batches = Batches(corpus, files, tokenizer, 32, 4, seed=5)
    rows = [TokenStream(corpus, files[r::4], tokenizer, 32, seed=5 * 7919 + r) for r in range(4)]
    for _ in range(3):
        assert batches.next()[0].tolist() == [row.next_sequence()[0] for row in rows]


def test_rows_take_turns_over_their_streams_and_resume_mid_cycle(corpus, tiny_model_dir):
    _, tokenizer = load_pretrained(tiny_model_dir)
    files = shuffled(corpus.train, seed=0)[::10]
    batches = Batches(corpus, files, tokenizer, 32, 2, seed=5, streams_per_row=3)
    streams = [TokenStream(corpus, files[i::6], tokenizer, 32, seed=5 * 7919 + i) for i in range(6)]
    # Steps 0, 1, 2 read streams (0, 1), (2, 3), (4, 5): six files; step 3 goes back to streams 0 and 1.
    expected = [[streams[2 * (t % 3) + r].next_sequence()[0] for r in range(2)] for t in range(5)]
    got = [batches.next()[0].tolist() for _ in range(2)]
    state = batches.state_dict()
    resumed = Batches(corpus, files, tokenizer, 32, 2, seed=5, streams_per_row=3)
    resumed.load_state_dict(state)
    got += [resumed.next()[0].tolist() for _ in range(3)]
    assert got == expected
    assert len({tuple(row) for step in got[:3] for row in step}) == 6


@pytest.mark.parametrize("streams_per_row", [1, 2])
def test_replicas_rows_together_are_the_single_process_batch(corpus, tiny_model_dir, streams_per_row):
    """N replicas of batch b read, step by step, exactly the rows one process of batch N x b reads: a
    DiLoCo run and its data-parallel (or N = 1) baseline train on the same tokens."""
    _, tokenizer = load_pretrained(tiny_model_dir)
    files = shuffled(corpus.train, seed=0)[::10]
    single = Batches(corpus, files, tokenizer, 16, 6, seed=2, streams_per_row=streams_per_row)
    replicas = [
        Batches(corpus, files, tokenizer, 16, 2, seed=2, streams_per_row=streams_per_row, replicas=3, rank=r)
        for r in range(3)
    ]
    for _ in range(5):
        union = torch.cat([replica.next()[0] for replica in replicas])
        assert union.equal(single.next()[0])
    # The replicas' rows differ from one another: no two replicas train on the same sequence.
    rows = [tuple(row.tolist()) for replica in replicas for row in replica.next()[0]]
    assert len(set(rows)) == 6


def test_too_few_files_for_a_batch(corpus, tiny_model_dir):
    _, tokenizer = load_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="cannot feed 8 rows"):
        Batches(corpus, corpus.heldout[:3], tokenizer, 32, 8, seed=0)
    with pytest.raises(ValueError, match=r"cannot feed 8 rows x 1 streams per row \(4 replicas x 2 rows\)"):
        Batches(corpus, corpus.heldout[:3], tokenizer, 32, 2, seed=0, replicas=4, rank=3)
    with pytest.raises(ValueError, match="rank 4 is not one of 4 replicas"):
        Batches(corpus, corpus.heldout, tokenizer, 32, 2, seed=0, replicas=4, rank=4)


def test_eval_set_does_not_depend_on_the_batch_size(tiny_model_dir):
    from composer_serverless.config import validate_config
    from composer_serverless.objectives.lm import LMObjective
    from composer_serverless.objectives.objective import evaluate

    model, tokenizer = load_pretrained(tiny_model_dir)
    losses = []
    for batch_size in (4, 32):
        config = validate_config(
            {
                "model": {"tiny": {}},
                "data": {"seq_len": 16, "batch_size": batch_size},
                "eval": {"sequences": 20},
                "diloco": {"sync_every": 1, "rounds": 1},
            }
        )
        losses.append(evaluate(LMObjective(config, tokenizer, rank=0), model)["eval/loss"])
    # Same sequences, different batching: equal up to float summation order.
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_a_global_batch_the_corpus_cannot_feed_is_refused_before_launch(corpus):
    from composer_serverless.config import ConfigError, validate_config
    from composer_serverless.objectives.inputs import check_text

    def config(replicas: int, batch_size: int, streams_per_row: int = 1):
        return validate_config(
            {
                "model": {"tiny": {}},
                "data": {"batch_size": batch_size, "streams_per_row": streams_per_row},
                "diloco": {"replicas": replicas, "sync_every": 1, "rounds": 1},
            }
        )

    files = len(corpus.train)
    check_text(config(1, files))  # one stream per file: just enough
    with pytest.raises(
        ConfigError,
        match=rf"2 replicas x batch_size {files} x streams_per_row 1 = {2 * files} streams.*\n  fix:",
    ):
        check_text(config(2, files))
    with pytest.raises(ConfigError, match="streams_per_row 2"):
        check_text(config(1, files, streams_per_row=2))
