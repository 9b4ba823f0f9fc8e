"""The data schema of the causal-LM objective: the offline demo corpus, or the user's text or chat records."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from composer_serverless.config.base import StrictModel

STDLIB = "stdlib"
# What a record file may be: JSON lines (optionally gzipped; fsspec infers the compression) or Parquet.
RECORD_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")


class DataConfig(StrictModel):
    """What the causal-LM objective trains on, split into train and held-out documents.

    Each step reads a global batch of ``diloco.replicas * batch_size`` rows and replica r trains on its
    ``batch_size`` of them, so runs with the same global batch (N = 4 x 4 rows, N = 1 x 16) see the same
    tokens in the same order, and comparing them compares the method, not the data.

    A document is a file of the standard-library corpus or a record of the user's files. Documents are packed
    into ``seq_len``-token rows with an end-of-text token between them. Chat records are rendered with the
    tokenizer's chat template and only their assistant tokens are trained on.
    """

    corpus: str = Field(
        STDLIB,
        min_length=1,
        description="'stdlib' (the Python standard library source of the running interpreter, the offline "
        "demo), or your records: a path, fsspec URL (s3://, hf://datasets/...) or glob of JSONL or Parquet "
        "files",
    )
    format: Literal["text", "chat"] = Field(
        "text",
        description="records only: 'text' trains on a text field; 'chat' renders a list of "
        "{role, content} messages with the tokenizer's chat template, loss on assistant tokens only",
    )
    text_field: str = Field("text", min_length=1, description="format 'text': the field holding the text")
    messages_field: str = Field(
        "messages", min_length=1, description="format 'chat': the field holding the messages"
    )
    heldout: str | None = Field(
        None,
        min_length=1,
        description="records only: files of the held-out set; unset: heldout_percent of the corpus's "
        "records, chosen by a hash of where each record is",
    )
    seq_len: int = Field(128, ge=8, le=32768, description="tokens per training sequence")
    batch_size: int = Field(8, ge=1, description="sequences per inner step on each replica")
    streams_per_row: int = Field(
        1,
        ge=1,
        le=64,
        description="documents each batch row takes its sequences from in turn; 1 reads one at a time, so "
        "for tens of steps a replica sees only batch_size documents and replicas drift apart between syncs",
    )
    heldout_percent: float = Field(
        5.0, gt=0, lt=50, description="share of documents held out for evaluation (unless heldout is set)"
    )

    @property
    def is_stdlib(self) -> bool:
        return self.corpus == STDLIB

    @model_validator(mode="after")
    def _records_options_need_records(self) -> DataConfig:
        if self.is_stdlib:
            records_only = ("format", "text_field", "messages_field", "heldout")
            given = [n for n in records_only if getattr(self, n) != type(self).model_fields[n].default]
            if given:
                raise ValueError(f"{', '.join(given)} apply to your records only, not to corpus = 'stdlib'")
            return self
        for url in filter(None, (self.corpus, self.heldout)):
            if not url.endswith(RECORD_SUFFIXES):
                raise ValueError(
                    f"{url!r} is neither 'stdlib' nor record files: name JSONL or Parquet files, ending in "
                    f"{', '.join(RECORD_SUFFIXES)} (a glob such as data/*.jsonl is fine)"
                )
        return self
