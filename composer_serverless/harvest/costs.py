"""What a request may cost, and the hard cap: no request is sent unless the spend so far, the worst case of
every request in flight and its own worst case together stay within ``max_usd``.

Money is counted in exact fractions of a dollar (a float price is converted exactly), so "never more than the
cap" is a comparison of exact numbers, not of rounded sums.

The worst case of a request is ``input bound x input price + max_tokens x output price``:

* **Output** is bounded by the ``max_tokens`` (or ``max_completion_tokens``) the request carries: servers stop
  there, and reasoning tokens count within it.
* **Input** is bounded, without a tokenizer, by the UTF-8 bytes of the request body plus the teacher's
  ``extra_input_tokens``. Every tokenizer these servers use (byte-level BPE as in tiktoken, Llama 3 or
  Qwen; SentencePiece with byte fallback; characters) gives each token of the text at least one byte of it,
  and the body holds every message's text, escaped (which only adds bytes). What the server adds around the
  text, the chat template's role markers and the generation prompt, is a few special tokens per message;
  the body spends more bytes than that on the JSON around each message (``{"role":"user","content":""}``,
  28 bytes) and on the model name and parameters. A server that adds a system prompt of its own adds tokens
  no byte of the request pays for: declare them as ``extra_input_tokens``.

After the answer, the request is settled at what its ``usage`` reports; an answer without usage (or a
response cut off, or timed out after it was sent, which the server may have billed) is charged its worst
case. An error status (429, 5xx, 4xx) is a request the server refused or failed and does not bill: it is
charged nothing. If a teacher ever reports more than the bound, the bound was wrong for it: the charge is
what it reported, and no further request is sent by anyone (``Budget.broken``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from fractions import Fraction

from composer_serverless.config import TeacherConfig

MILLION = 1_000_000


@dataclass(frozen=True)
class Price:
    """USD per token, in and out, exactly."""

    per_input: Fraction
    per_output: Fraction

    @staticmethod
    def of(teacher: TeacherConfig) -> Price:
        return Price(
            Fraction(teacher.usd_per_m_input) / MILLION, Fraction(teacher.usd_per_m_output) / MILLION
        )

    def cost(self, tokens_in: int, tokens_out: int) -> Fraction:
        return tokens_in * self.per_input + tokens_out * self.per_output


def input_token_bound(body: bytes, extra_input_tokens: int = 0) -> int:
    """An upper bound of the input tokens a request with this body is billed for (see the module)."""
    return len(body) + extra_input_tokens


def worst_case(body: bytes, teacher: TeacherConfig) -> Fraction:
    """The most the request with this body may cost at ``teacher``."""
    tokens_in = input_token_bound(body, teacher.extra_input_tokens)
    return Price.of(teacher).cost(tokens_in, teacher.max_tokens)


# Makes a bound of a budget's spend durable (a live harvest's ledger entry in the run).
Record = Callable[[Fraction], Awaitable[None]]


class Budget:
    """The hard cap, shared by every request of a harvest (one event loop).

    ``reserve`` before a request is sent, ``settle`` once it is over. A request whose worst case fits only
    once requests in flight settle waits for them; one that cannot fit even then is refused, as is every
    request once ``broken``. ``spent`` starts at what earlier harvests spent (``spent_before``).

    With ``record``, a reservation is recorded before ``reserve`` returns: ``record`` is given a bound of what
    this budget may have spent, its charges since it was made plus everything in flight at its worst case,
    whenever that exceeds the last bound it was given. So whatever may have been sent is on record even if the
    harvest never gets to report (a live harvest's ledger).
    """

    def __init__(
        self, max_usd: Fraction, spent: Fraction = Fraction(0), record: Record | None = None
    ) -> None:
        self.max_usd = max_usd
        self.spent_before = spent
        self.spent = spent
        self.in_flight = Fraction(0)
        self.broken: str | None = None
        self.refused = 0
        self._changed = asyncio.Condition()
        self._record = record
        self._recorded = Fraction(0)
        self._recording = asyncio.Lock()

    def fits(self, worst: Fraction) -> bool:
        """Whether a request of this worst case could ever be sent (with nothing else in flight)."""
        return self.broken is None and self.spent + worst <= self.max_usd

    async def reserve(self, worst: Fraction) -> bool:
        """Hold ``worst`` for one request; False (and nothing held) if the cap does not allow it. Raises what
        ``record`` raises, holding nothing."""
        async with self._changed:
            while True:
                if not self.fits(worst):
                    self.refused += 1
                    return False
                if self.spent + self.in_flight + worst <= self.max_usd:
                    self.in_flight += worst
                    break
                await self._changed.wait()  # something in flight settles below its worst case, or not
        if self._record is not None:
            try:
                await self._cover()
            except BaseException:
                await self.settle(worst, Fraction(0))  # not sent
                raise
        return True

    async def _cover(self) -> None:
        """Record a bound covering every reservation so far; one write covers every reservation made while
        another was under way."""
        assert self._record is not None
        async with self._recording:
            bound = self.spent - self.spent_before + self.in_flight
            if bound > self._recorded:
                await self._record(bound)
                self._recorded = bound

    async def settle(self, worst: Fraction, charged: Fraction, overrun: str | None = None) -> None:
        """Release a reservation of ``worst`` and add ``charged`` to the spend; ``overrun`` says why a charge
        exceeded its reservation (the bound was wrong), which stops every further request."""
        async with self._changed:
            self.in_flight -= worst
            self.spent += charged
            if overrun is not None and self.broken is None:
                self.broken = overrun
            self._changed.notify_all()
