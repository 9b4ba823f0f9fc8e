"""JSONL readers: records through fsspec, file:line errors, shards and resumable cycles."""

import fsspec
import pytest

from composer_serverless.data.records import (
    Cycle,
    PreferencePair,
    PromptRecord,
    RecordError,
    read_pairs,
    read_prompts,
    shard_records,
)


def test_prompt_records_are_rows_with_any_columns_and_blank_lines_are_skipped(jsonl):
    path = jsonl(
        "train.jsonl",
        [
            {"prompt": "add 2 3=", "answer": "5", "task": "add"},
            "",
            {
                "prompt": "def f",
                "tests": ["assert f() == 1", "assert f() != 2"],
                "hint": "return 1",
                "meta": {"id": 3},
                "difficulty": 2,
            },
            {"prompt": "p", "tests": "assert True"},
        ],
    )
    records = read_prompts(path)
    assert records[0] == PromptRecord("add 2 3=", {"answer": "5", "task": "add"}, source=f"{path}:1")
    assert (records[0].answer, records[0].task) == ("5", "add")
    assert records[1].tests == ("assert f() == 1", "assert f() != 2")
    assert (records[1].hint, records[1].task, records[1].source) == ("return 1", "default", f"{path}:3")
    assert records[1].columns["meta"] == {"id": 3} and records[1].columns["difficulty"] == 2
    assert records[2].tests == ("assert True",)


def test_a_column_map_renames_columns_and_a_conversation_keeps_its_system_turn(jsonl):
    """A GSM8K-shaped row (question, solution) mapped as TRL users rename columns; a conversational one."""
    system = {"role": "system", "content": "Answer with a number."}
    path = jsonl(
        "rows.jsonl",
        [
            {"question": "2 + 3?", "solution": "5"},
            {"question": [system, {"role": "user", "content": "4 + 4?"}], "solution": "8"},
        ],
    )
    plain, chat = read_prompts(path, {"prompt": "question"})
    assert plain.prompt == "2 + 3?" and plain.columns == {"solution": "5"} and not plain.conversational
    assert chat.prompt == (system, {"role": "user", "content": "4 + 4?"}) and chat.conversational
    (renamed, _) = read_prompts(path, {"prompt": "question", "answer": "solution"})
    assert renamed.answer == "5" and "solution" not in renamed.columns


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "x", "answer": "1"', r"not valid JSON"),
        ('["prompt", "x"]', r"expected a JSON object, got list"),
        ('{"answer": "1"}', r"no 'prompt' column \(its columns: answer\)"),
        ('{"prompt": "", "answer": "1"}', r"'prompt' is empty"),
        ('{"prompt": [{"role": "user"}]}', r"message 0 of 'prompt' must be"),
        (
            '{"prompt": [{"role": "assistant", "content": "a"}]}',
            r"the prompt's last message is the assistant's",
        ),
        ('{"prompt": "x", "answer": [7]}', r"'answer' must be a string, got \[7\]"),
        ('{"prompt": "x", "tests": [1]}', r"'tests' must be a string or a list of non-empty strings"),
        ('{"prompt": "x", "completions": "y"}', r"column 'completions' would clash"),
    ],
)
def test_a_malformed_prompt_record_is_named_by_file_and_line(jsonl, line, message):
    path = jsonl("bad.jsonl", [{"prompt": "fine", "answer": "1"}, "", line])
    with pytest.raises(RecordError, match=rf"^{path}:3: {message}"):
        read_prompts(path)


def test_a_mapped_column_a_row_lacks_is_named_with_the_columns_it_has(jsonl):
    path = jsonl("rows.jsonl", [{"questoin": "2 + 3?", "solution": "5"}])
    with pytest.raises(
        RecordError, match=rf"^{path}:1: column 'question' \(mapped to 'prompt'.*did you mean 'questoin'"
    ):
        read_prompts(path, {"prompt": "question"})


def test_preference_pairs_with_and_without_reference_log_probs(jsonl):
    path = jsonl(
        "pairs.jsonl",
        [
            {"prompt": "p", "chosen": "a", "rejected": "b"},
            {"prompt": "q", "chosen": "c", "rejected": "d", "chosen_ref_logp": -1.5, "rejected_ref_logp": -2},
        ],
    )
    assert read_pairs(path) == [
        PreferencePair("p", "a", "b", source=f"{path}:1"),
        PreferencePair("q", "c", "d", -1.5, -2.0, source=f"{path}:2"),
    ]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "p", "chosen": "a", "rejected": "a"}, "chosen and rejected are the same text"),
        (
            {"prompt": "p", "chosen": "a", "rejected": "b", "chosen_ref_logp": -1.0},
            "give both chosen_ref_logp",
        ),
        (
            {"prompt": "p", "chosen": "a", "rejected": "b", "chosen_ref_logp": 0.5, "rejected_ref_logp": -1},
            "<= 0",
        ),
        ({"prompt": "p", "chosen": "a"}, "'rejected' must be a non-empty string"),
    ],
)
def test_a_malformed_pair_is_named_by_file_and_line(jsonl, record, message):
    path = jsonl("pairs.jsonl", [record])
    with pytest.raises(RecordError, match=rf"^{path}:1: .*{message}"):
        read_pairs(path)


def test_records_are_read_through_fsspec_urls_and_globs():
    fs = fsspec.filesystem("memory")
    fs.pipe("/composer-data/a.jsonl", b'{"prompt": "a", "answer": "1"}\n')
    fs.pipe("/composer-data/b.jsonl", b'{"prompt": "b", "answer": "2"}\n')
    records = read_prompts("memory://composer-data/*.jsonl")
    assert [r.prompt for r in records] == ["a", "b"]
    assert records[1].source == "memory:///composer-data/b.jsonl:1"
    with pytest.raises(FileNotFoundError, match="no file matches"):
        read_prompts("memory://composer-data/none-*.jsonl")


def test_an_empty_file_is_an_error(jsonl):
    path = jsonl("empty.jsonl", [""])
    with pytest.raises(RecordError, match="no records"):
        read_prompts(path)


def test_shards_are_disjoint_and_cover_every_record():
    records = list(range(10))
    shards = [shard_records(records, rank, 3) for rank in range(3)]
    assert sorted(sum(shards, [])) == records
    assert shards[1] == [1, 4, 7]
    with pytest.raises(ValueError, match="2 records cannot be sharded over 3 replicas"):
        shard_records([0, 1], 0, 3)


def test_a_cycle_visits_every_item_once_per_epoch_and_resumes_exactly():
    cycle = Cycle(5, seed=3)
    first_epoch = cycle.take(5)
    assert sorted(first_epoch) == [0, 1, 2, 3, 4]
    state = cycle.state_dict()
    ahead = cycle.take(7)
    resumed = Cycle(5, seed=3)
    resumed.load_state_dict(state)
    assert resumed.take(7) == ahead
    assert sorted(ahead[:5]) == [0, 1, 2, 3, 4] and ahead[:5] != first_epoch


@pytest.fixture
def s3_bucket(monkeypatch):
    """A bucket on a real S3 server on loopback (moto), reached through s3fs as in production."""
    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(key, value)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="composer-data")
    yield client
    server.stop()


def test_pairs_are_read_from_s3(s3_bucket):
    s3_bucket.put_object(
        Bucket="composer-data", Key="pairs/a.jsonl", Body=b'{"prompt": "p", "chosen": "a", "rejected": "b"}\n'
    )
    s3_bucket.put_object(
        Bucket="composer-data", Key="pairs/b.jsonl", Body=b'{"prompt": "q", "chosen": "c"}\n'
    )
    with pytest.raises(
        RecordError, match=r"^s3://composer-data/pairs/b.jsonl:1: 'rejected' must be a non-empty string"
    ):
        read_pairs("s3://composer-data/pairs/*.jsonl")
    assert [p.chosen for p in read_pairs("s3://composer-data/pairs/a.jsonl")] == ["a"]
