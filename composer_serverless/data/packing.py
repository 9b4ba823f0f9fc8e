"""A replica's batches of the causal-LM objective: token streams packed from documents, and this replica's rows
of one global batch, both resumable from a few integers. A batch is token ids and labels: the ids where a token
is trained on, ``IGNORE`` where it is not (a chat record's user turns)."""

from __future__ import annotations

import random
from typing import Any

import torch

from composer_serverless.data.corpus import Documents

# The label of a token the loss skips (Hugging Face's ignore index).
IGNORE = -100


class TokenStream:
    """Fixed-length token sequences packed from documents, end-of-text between them; resumable.

    The position is (epoch, document index, token offset in that document): a few integers, so a restarted
    replica re-tokenizes one document and continues exactly where its checkpoint left it.
    """

    def __init__(
        self,
        corpus: Documents,
        files: tuple[str, ...],
        tokenizer: Any,
        seq_len: int,
        *,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if not files:
            raise ValueError("a token stream needs at least one file")
        self._corpus = corpus
        self._files = files
        self._tokenizer = tokenizer
        self._seq_len = seq_len
        self._seed = seed
        self._shuffle = shuffle
        self.load_state_dict({"epoch": 0, "index": 0, "offset": 0})

    def _epoch_order(self) -> list[str]:
        order = list(self._files)
        if self._shuffle:
            random.Random(self._seed * 1_000_003 + self._epoch).shuffle(order)
        return order

    def _load_file(self) -> None:
        self._tokens, self._mask = self._corpus.tokens(self._order[self._index], self._tokenizer)

    def _advance_file(self) -> None:
        self._index += 1
        self._offset = 0
        if self._index == len(self._order):
            self._epoch += 1
            self._index = 0
            self._order = self._epoch_order()
        self._load_file()

    def next_sequence(self) -> tuple[list[int], list[bool]]:
        """The next ``seq_len`` token ids, and whether each is trained on."""
        sequence: list[int] = []
        mask: list[bool] = []
        while len(sequence) < self._seq_len:
            if self._offset == len(self._tokens):
                self._advance_file()
            end = self._offset + self._seq_len - len(sequence)
            sequence.extend(self._tokens[self._offset : end])
            mask.extend(self._mask[self._offset : end])
            self._offset = min(end, len(self._tokens))
        return sequence, mask

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "index": self._index, "offset": self._offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._epoch, self._index, self._offset = (
            int(state["epoch"]),
            int(state["index"]),
            int(state["offset"]),
        )
        self._order = self._epoch_order()
        self._load_file()


class Batches:
    """One replica's rows of a global batch whose rows come from independent streams over disjoint documents.

    Packing consecutive sequences of one document into a batch would make its gradient as noisy as one
    document; dealing the documents out to one stream per row keeps every batch a mix of them. The streams
    belong to the *global* batch of ``replicas * batch_size`` rows, and replica ``rank`` reads rows
    ``rank * batch_size`` to ``(rank + 1) * batch_size - 1`` of it: so the union of N replicas' batches at a
    step is exactly the batch one process with ``N * batch_size`` rows reads at that step. A DiLoCo run and a
    data-parallel (or N = 1) run of the same global batch therefore train on the same tokens in the same
    order, and a comparison between them measures the method, not which documents each happened to read.

    With ``streams_per_row`` = k, each global row g takes its sequences from k streams in turn (at step t,
    stream ``(t mod k) * rows + g``, where rows is the global batch's), so any k consecutive steps see k
    documents per row: with one stream per row, a replica trains on the same ``batch_size`` documents for
    tens of steps (a file of the demo corpus holds tens of sequences).
    """

    def __init__(
        self,
        corpus: Documents,
        files: tuple[str, ...],
        tokenizer: Any,
        seq_len: int,
        batch_size: int,
        *,
        seed: int,
        streams_per_row: int = 1,
        replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if not 0 <= rank < replicas:
            raise ValueError(f"rank {rank} is not one of {replicas} replicas")
        rows = batch_size * replicas
        count = rows * streams_per_row
        if len(files) < count:
            raise ValueError(
                f"{len(files)} documents cannot feed {rows} rows x {streams_per_row} streams per row "
                f"({replicas} replicas x {batch_size} rows); lower data.batch_size or data.streams_per_row"
            )
        self._batch_size = batch_size
        self._streams_per_row = streams_per_row
        # This replica's streams, turn by turn: turn j's rows are self._streams[j * batch_size:][:batch_size].
        mine = [j * rows + rank * batch_size + r for j in range(streams_per_row) for r in range(batch_size)]
        self._streams = [
            TokenStream(corpus, files[i::count], tokenizer, seq_len, seed=seed * 7919 + i) for i in mine
        ]
        self._step = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(batch_size, seq_len)`` token ids and their labels (``IGNORE`` where not trained on)."""
        first = (self._step % self._streams_per_row) * self._batch_size
        self._step += 1
        rows = [s.next_sequence() for s in self._streams[first : first + self._batch_size]]
        ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
        trained = torch.tensor([r[1] for r in rows], dtype=torch.bool)
        return ids, ids.masked_fill(~trained, IGNORE)

    def state_dict(self) -> dict[str, Any]:
        return {"streams": [s.state_dict() for s in self._streams], "step": self._step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for stream, stream_state in zip(self._streams, state["streams"], strict=True):
            stream.load_state_dict(stream_state)
        self._step = int(state.get("step", 0))
