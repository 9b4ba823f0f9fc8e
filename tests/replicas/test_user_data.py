"""The lm objective on the user's own records: text or chat, JSONL or Parquet, through fsspec; chat rendered
with the tokenizer's template and trained on assistant tokens only; checked before launch."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from composer_serverless.config import ConfigError, validate_config
from composer_serverless.data.chat import render_chat
from composer_serverless.data.corpus import documents
from composer_serverless.data.packing import IGNORE
from composer_serverless.models.loading import load_pretrained
from composer_serverless.objectives.inputs import check_text
from composer_serverless.objectives.lm import LMObjective
from tests.conftest import CHATML_MARKED, arithmetic_chats

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 plus 3?"},
    {"role": "assistant", "content": "6"},
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(corpus: str, model_dir: Path, **data) -> object:
    return validate_config(
        {
            "model": {"path": str(model_dir)},
            "data": {"corpus": corpus, "seq_len": 32, "batch_size": 2, **data},
            "diloco": {"replicas": 2, "sync_every": 2, "rounds": 1},
            "eval": {"sequences": 4},
        }
    )


@pytest.mark.parametrize("marked", [False, True], ids=["located-by-prefix", "generation-markers"])
def test_only_assistant_turns_are_trained_on(chat_model_dir: Path, marked: bool) -> None:
    _, tokenizer = load_pretrained(chat_model_dir)
    if marked:
        tokenizer.chat_template = CHATML_MARKED
    ids, mask = render_chat(tokenizer, CONVERSATION)
    learned = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    skipped = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert learned.replace("\n", "") == "4<|im_end|>6<|im_end|>"
    for text in ("Be brief.", "What is 2 plus 2?", "And 3 plus 3?", "<|im_start|>assistant"):
        assert text in skipped


def test_the_objective_s_labels_cover_assistant_tokens_only(tmp_path: Path, chat_model_dir: Path) -> None:
    chats = _jsonl(tmp_path / "chats.jsonl", arithmetic_chats(40, seed=0))
    config = _config(str(chats), chat_model_dir, format="chat", heldout_percent=10)
    _, tokenizer = load_pretrained(chat_model_dir)
    objective = LMObjective(config, tokenizer, rank=0)
    batches = [objective._train.next() for _ in range(10)]
    # Row by row: a row boundary may cut an end-of-turn marker, never join two rows' text.
    learned = [
        tokenizer.decode(row[row_labels != IGNORE])
        for ids, labels in batches
        for row, row_labels in zip(ids, labels, strict=True)
    ]
    text = "".join(learned)
    assert any(c.isdigit() for c in text)
    # Answers and their end-of-turn marker (which a row boundary may cut), nothing of the other turns.
    assert set(text) <= set("0123456789\n<|im_end>"), text
    assert "plus" not in text and "Answer" not in text and "start" not in text


def test_text_and_chat_records_from_parquet_and_s3(tmp_path: Path, s3_url: str, chat_model_dir: Path) -> None:
    import fsspec

    rows = [{"body": f"document number {i} " * 5} for i in range(30)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "texts.parquet")
    with fsspec.open(f"{s3_url}/chats.jsonl", "w", skip_instance_cache=True) as f:
        f.write("".join(json.dumps(c) + "\n" for c in arithmetic_chats(20, seed=1)))
    texts = documents(_config(str(tmp_path / "texts.parquet"), chat_model_dir, text_field="body").data)
    assert len(texts.train) + len(texts.heldout) == 30
    assert texts.values[f"{tmp_path / 'texts.parquet'}:3"] == rows[2]["body"]
    chats = documents(_config(f"{s3_url}/chats.jsonl", chat_model_dir, format="chat").data)
    assert len(chats.train) + len(chats.heldout) == 20 and all(k.startswith("s3://") for k in chats.values)


@pytest.mark.parametrize(
    ("rows", "options", "message"),
    [
        ([{"txt": "a"}], {}, r"chats.jsonl:1: 'text' must be a non-empty string"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], {"format": "chat"}, "with an assistant turn"),
        ([{"text": "a"}] * 3, {"batch_size": 4}, r"= 8 streams, but the .* has [0-9] train documents"),
    ],
)
def test_records_the_run_cannot_use_are_refused_before_launch(
    tmp_path: Path, tiny_model_dir: Path, rows: list[dict], options: dict, message: str
) -> None:
    path = _jsonl(tmp_path / "chats.jsonl", rows)
    with pytest.raises(ConfigError, match=message):
        check_text(_config(str(path), tiny_model_dir, **options))


def test_records_options_are_refused_for_the_demo_corpus() -> None:
    with pytest.raises(ConfigError, match="format apply to your records only"):
        validate_config(
            {"model": {"tiny": {}}, "data": {"format": "chat"}, "diloco": {"sync_every": 1, "rounds": 1}}
        )
    with pytest.raises(ConfigError, match="neither 'stdlib' nor record files"):
        validate_config(
            {"model": {"tiny": {}}, "data": {"corpus": "data.csv"}, "diloco": {"sync_every": 1, "rounds": 1}}
        )


@pytest.mark.slow
def test_a_short_chat_run_lowers_the_held_out_loss(tmp_path: Path, chat_model_dir: Path) -> None:
    from composer_serverless.launch.launcher import launch

    train = _jsonl(tmp_path / "train.jsonl", arithmetic_chats(200, seed=2))
    heldout = _jsonl(tmp_path / "heldout.jsonl", arithmetic_chats(16, seed=3))
    config = validate_config(
        {
            "run_id": "chat",
            "store": str(tmp_path / "store"),
            "model": {"path": str(chat_model_dir)},
            "data": {
                "corpus": str(train),
                "heldout": str(heldout),
                "format": "chat",
                "seq_len": 64,
                "batch_size": 4,
            },
            "train": {"lr": 3e-3},
            "diloco": {"replicas": 2, "sync_every": 10, "rounds": 3},
            "eval": {"sequences": 16},
            "executor": {"threads_per_replica": 1},
        }
    )
    summary = launch(config, "chat", Console(file=io.StringIO()))
    assert summary["rounds_committed"] == 3 and summary["replicas_bit_identical"]
    assert summary["final_eval_loss"] < 0.8 * summary["initial_eval_loss"], summary["eval_loss_by_round"]
