"""Reading the user's data: record files (JSONL, Parquet) through fsspec (``records.py``), the lm objective's
documents (``corpus.py``), chat records rendered with the tokenizer's template and their assistant tokens
located (``chat.py``), and each replica's rows of one global batch, packed (``packing.py``)."""
