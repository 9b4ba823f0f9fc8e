"""The live harvest: while the launcher watches a run with ``harvest.live``, a thread of it harvests the
replicas' rollouts between rounds, so the replay channel learns from the student's current mistakes.

The launcher does it, not the replicas, because the launcher holds the teachers' keys: replicas never need
them (the local executor withholds them from their environment; the cloud executors never send them). So a
run whose launcher detached, or died, stops harvesting; ``launch --resume`` starts it again, and rounds
already harvested are not asked twice (each harvest leaves a report in the run).

The schedule is fixed (``objectives/harvest_schedule.py``): the pairs of round k are taken by every replica at
the end of round k + ``live_lag``, and the harvester harvests every round from 1 to ``rounds - live_lag - 1``
in order, skipping none, and writes a report for each: its pairs, or why it made none (the cap was spent, it
failed, it was too late). Round k is harvested once the rollouts of every replica of the sync that ended it
(its quorum) are in the store, or those there are once the others' can no longer come: a later round has
rollouts, or, with ``live_lag`` 0 (no later round comes while the replicas wait for the harvest), each missing
member's heartbeat says it is gone (``MemberWatch``). Only the quorum's rollouts are read, so a replica that
joined late changes nothing. A round whose pairs
the replicas already went on without (they timed out, say) is not harvested, and a harvest in progress when
that happens is cancelled: nobody would take its pairs.

While it runs the harvester beats (``layout.HARVESTER``, every ``BEAT_S``), saying what it does; when it stops
it says so, and replicas waiting for a harvest stop waiting at once. The cap, ``max_usd``, holds over the whole
run: each harvest's budget starts from what every earlier harvest may have spent, read from the run's spend
ledger (``layout.HARVEST_SPEND``), where each harvest records a bound of its spend before each request goes
(``costs.Budget``) and its exact spend when it ends, before its pairs and report. So a harvest whose report
was never written (the write failed, the launcher stopped or was killed) is counted all the same, by the
harvest of the round again and by a resumed run's. A harvest cut short counts everything it had in flight at
its worst case, since those requests may still be billed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from rich.console import Console
from rich.markup import escape

from composer_serverless.config import HarvestConfig, RunConfig
from composer_serverless.data.records import RecordError
from composer_serverless.harvest.cache import AnswerCache
from composer_serverless.harvest.costs import Budget
from composer_serverless.harvest.harvester import harvest, pairs_jsonl
from composer_serverless.harvest.states import latest_rollout_round, read_rollouts, rollout_ranks
from composer_serverless.harvest.stats import HarvestResult, usd
from composer_serverless.objectives.harvest_schedule import SILENT_S, Taken, last_harvested, read_taken
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.latest import fixed_participants
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)

POLL_S = 1.0
# Between two heartbeats; replicas take a heartbeat unchanged for ``harvest_schedule.SILENT_S`` for a gone
# launcher, twelve beats later.
BEAT_S = 5.0
STOPPED = "the launcher stopped watching the run (it ended, was cancelled, or the launcher exited)"
# How long ``stop`` waits for the harvester to write its last objects (a slow store) before leaving it behind.
STOP_WAIT_S = 30.0


def harvested_rounds(
    run: ObjectStore, known: dict[int, dict[str, Any]] | None = None
) -> dict[int, dict[str, Any]]:
    """The reports of the run's harvests so far, by round; those in ``known`` are not read again (a report is
    written once), so a long run's poll lists the reports and reads only the new ones."""
    reports = dict(known or {})
    for name in run.list(layout.HARVEST_REPORTS):
        stem = name.removesuffix(".json")
        if name.endswith(".json") and stem.isdigit() and int(stem) not in reports:
            reports[int(stem)] = json.loads(run.get(f"{layout.HARVEST_REPORTS}/{name}"))
    return reports


def counted_spend(run: ObjectStore, known: dict[str, Fraction] | None = None) -> dict[str, Fraction]:
    """Every entry of the run's spend ledger, by name: what each harvest so far may have spent. Those in
    ``known`` are not read again: the harvester reads the ledger only between its own harvests, when every
    entry it lists is final."""
    spend = dict(known or {})
    for name in run.list(layout.HARVEST_SPEND):
        if name.endswith(".json") and name not in spend:
            spend[name] = Fraction(json.loads(run.get(f"{layout.HARVEST_SPEND}/{name}"))["spent_exact"])
    return spend


def next_round(config: RunConfig, reports: dict[int, dict[str, Any]]) -> int | None:
    """The first round of the schedule without a report: rounds are harvested in order, none passed over."""
    assert config.harvest is not None
    last = last_harvested(config.diloco.rounds, config.harvest.live_lag)
    return next((k for k in range(1, last + 1) if k not in reports), None)


class MemberWatch:
    """What the harvester has seen of the replicas' heartbeats (``layout.heartbeat``): each one's last bytes and
    when they last changed, on the harvester's monotonic clock (no two machines' clocks are compared)."""

    def __init__(
        self, run: ObjectStore, silent_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._run = run
        self.silent_s = SILENT_S if silent_s is None else silent_s
        self._clock = clock
        self._seen: dict[int, tuple[bytes | None, float]] = {}
        self._gone: set[tuple[int, int]] = set()

    def gone(self, rank: int, k: int) -> bool:
        """Whether replica ``rank``, a member of the quorum that ended round ``k`` that has not recorded its
        rollouts of it, never will: its heartbeat names no round or one before k (it failed, or started again:
        the replica in the quorum had trained round k), or has not changed, or not been there, for
        ``silent_s`` (it was killed). Once gone for round k, gone for good."""
        try:
            raw: bytes | None = self._run.get(layout.heartbeat(rank))
        except FileNotFoundError:
            raw = None
        now = self._clock()
        last = self._seen.get(rank)
        if last is None or last[0] != raw:
            last = self._seen[rank] = (raw, now)
        if (raw is not None and not _beats_round(raw, k)) or now - last[1] >= self.silent_s:
            self._gone.add((rank, k))
        return (rank, k) in self._gone


def _beats_round(raw: bytes, k: int) -> bool:
    """Whether a heartbeat names round ``k`` or a later one."""
    try:
        beat = json.loads(raw)
    except ValueError:
        return False
    round_ = beat.get("round") if isinstance(beat, dict) else None
    return isinstance(round_, int) and round_ >= k


def ready_ranks(run: ObjectStore, config: RunConfig, k: int, members: MemberWatch) -> list[int] | None:
    """The replicas whose rollouts of round ``k`` are harvested, once they are all in the store: the quorum
    of the sync that ended round k (with ``live_lag`` 0, less the members that ``members`` finds gone); or,
    once a later round has rollouts, the replicas that recorded k (the others' will not come). None while
    they are not there."""
    assert config.harvest is not None
    dl = config.diloco
    recorded = rollout_ranks(run, k)
    quorum = fixed_participants(run, k, dl.fragments - 1, dl.replicas)
    if quorum is not None:
        missing = [rank for rank in quorum if rank not in recorded]
        if not missing:
            return quorum
        # With live_lag 0 every replica waits for this harvest at round k's end: no later round brings
        # rollouts, so a member that is gone is not waited for. (Each is looked at: silence is timed per look.)
        if config.harvest.live_lag == 0 and all([members.gone(rank, k) for rank in missing]):
            return [rank for rank in quorum if rank in recorded]
    if latest_rollout_round(run) > k:
        return recorded
    return None


def _too_late(taken_at: int, decided: Taken) -> str:
    """Why a round is not harvested, or its harvest is cancelled: the replicas went on without its pairs."""
    return f"too late: the end of round {taken_at} took nothing ({decided.detail})"


def _spend_entry(k: int, spent: Fraction, *, final: bool) -> bytes:
    """A ledger entry: a bound of what a harvest of round ``k`` spent, or (``final``) what it spent."""
    doc = {"round": k, "spent_exact": str(spent), "spent_usd": float(spent), "final": final}
    return json.dumps(doc, sort_keys=True).encode()


def _report(k: int, spent: Fraction, **fields: Any) -> bytes:
    doc = {"round": k, "pairs": 0, "pairs_file": None, **fields, "spent_exact": str(spent)}
    return json.dumps({**doc, "spent_usd": float(spent)}, sort_keys=True).encode()


class LiveHarvester:
    """Harvests one run between its rounds, on a daemon thread, until ``stop``."""

    def __init__(self, run: ObjectStore, config: RunConfig, console: Console) -> None:
        assert config.harvest is not None
        self.run = run
        self.config = config
        self.harvest: HarvestConfig = config.harvest
        self._console = console
        self._stopping = threading.Event()
        self._stop_reason = STOPPED
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._doing = "starting"
        self._beats = 0
        self._beat_lock = threading.Lock()
        self._said_stopped = False
        self._capped = False
        self._reports: dict[int, dict[str, Any]] = {}
        self._spend: dict[str, Fraction] = {}
        self._members = MemberWatch(run)
        self._thread = threading.Thread(target=self._main, name=f"harvest-{config.run_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, reason: str = STOPPED) -> None:
        """Stop harvesting: a harvest in progress is cancelled and reported (see the module), and the
        heartbeat says the harvester stopped, and ``reason``. Waits ``STOP_WAIT_S`` at most: a harvester still
        writing then is left behind, saying so; what it may have spent is in the ledger already."""
        self._stop_reason = reason
        self._stopping.set()
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                loop.call_soon_threadsafe(task.cancel)
        self._thread.join(timeout=STOP_WAIT_S)
        if self._thread.is_alive():
            why = (
                f"the harvester did not stop within {STOP_WAIT_S:g}s (a slow store?) and is left behind: its "
                "last report or heartbeat may not be written; what it may have spent is in the run's spend "
                "ledger, and `launch --resume` harvests any round left without a report"
            )
            logger.warning(why)
            self._say(f"[yellow]harvest:[/] {escape(why)}")

    def _main(self) -> None:
        asyncio.run(self._watch())

    async def _watch(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        beating = asyncio.create_task(self._beat())
        try:
            while not self._stopping.is_set():
                try:
                    reports = await asyncio.to_thread(harvested_rounds, self.run, self._reports)
                    self._reports = reports
                    k = next_round(self.config, reports)
                    reported = False
                    if k is None:
                        self._doing = "done: every round of the schedule is reported"
                    else:
                        reported = await self._step(k)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the run goes on without pairs rather than fail for them
                    logger.exception("the live harvest failed; it tries again at the next poll")
                    self._say(f"[yellow]harvest failed:[/] {escape(f'{type(e).__name__}: {e}')}")
                    reported = False
                if not reported:  # else the next round may be ready already
                    await asyncio.sleep(POLL_S)
        except asyncio.CancelledError:
            pass
        finally:
            beating.cancel()
            self._put_beat({"state": "stopped", "reason": self._stop_reason, "time": time.time()})

    async def _beat(self) -> None:
        while True:
            self._beats += 1
            beat = {"state": self._doing, "beat": self._beats, "time": time.time()}
            await asyncio.to_thread(self._put_beat, beat)
            await asyncio.sleep(BEAT_S)

    def _put_beat(self, beat: dict[str, Any]) -> None:
        """Write a heartbeat; none after the one that says the harvester stopped (a beat cancelled while its
        write was under way on another thread must not land after it)."""
        with self._beat_lock:
            if self._said_stopped:
                return
            self.run.put(layout.HARVESTER, json.dumps(beat, sort_keys=True).encode())
            self._said_stopped = beat["state"] == "stopped"

    async def _step(self, k: int) -> bool:
        """Harvest round ``k`` if it is time to, or report why it is not harvested; True once reported."""
        taken_at = k + self.harvest.live_lag
        decided = await asyncio.to_thread(read_taken, self.run, taken_at, k)
        if decided is not None:  # the replicas went on without it: its pairs would be taken by no round
            await self._skip(k, _too_late(taken_at, decided))
            return True
        ranks = await asyncio.to_thread(ready_ranks, self.run, self.config, k, self._members)
        if ranks is None:
            self._doing = f"waiting for the rollouts of round {k}"
            return False
        self._spend = await asyncio.to_thread(counted_spend, self.run, self._spend)
        spent = sum(self._spend.values(), Fraction(0))
        if spent >= Fraction(self.harvest.max_usd):
            if not self._capped:
                self._capped = True
                self._say(f"[yellow]harvest:[/] the cap of {usd(self.harvest.max_usd)} is spent; no more")
            await self._skip(k, f"the cap of {usd(self.harvest.max_usd)} is spent")
            return True
        self._doing = f"harvesting round {k}"
        await self._harvest(k, ranks, spent)
        return True

    async def _skip(self, k: int, why: str) -> None:
        await asyncio.to_thread(self.run.put, layout.harvest_report(k), _report(k, Fraction(0), skipped=why))
        self._say(f"  harvest of round {k}: none ({escape(why)})")

    async def _harvest(self, k: int, ranks: list[int], spent: Fraction) -> None:
        try:
            states = await asyncio.to_thread(read_rollouts, self.run, k, ranks)
        except (RecordError, ValueError, FileNotFoundError) as e:  # a replica's file is not rollouts
            why = f"{type(e).__name__}: {e}"
            await asyncio.to_thread(
                self.run.put, layout.harvest_report(k), _report(k, Fraction(0), failed=why)
            )
            self._say(f"  [yellow]harvest of round {k}:[/] {escape(why)}")
            return
        if not states:
            await self._skip(k, f"no rollouts of round {k} to ask about")
            return
        ledger = layout.harvest_spend(k, uuid.uuid4().hex[:12])

        async def record(bound: Fraction) -> None:
            await asyncio.to_thread(self.run.put, ledger, _spend_entry(k, bound, final=False))

        budget = Budget(Fraction(self.harvest.max_usd), spent=spent, record=record)
        cache = AnswerCache(self.run.child(layout.HARVEST_CACHE))
        asking = asyncio.create_task(harvest(states, self.harvest, cache, budget))
        taken_at = k + self.harvest.live_lag
        try:
            while not asking.done():
                await asyncio.wait({asking}, timeout=POLL_S)
                decided = (
                    None if asking.done() else await asyncio.to_thread(read_taken, self.run, taken_at, k)
                )
                if decided is not None:
                    await self._cut_short(k, ledger, budget, asking, _too_late(taken_at, decided))
                    return
        except asyncio.CancelledError:
            await self._cut_short(k, ledger, budget, asking, "the launcher stopped watching the run")
            raise
        try:
            result = asking.result()
        except Exception as e:
            logger.exception("the harvest of round %d failed", k)
            await self._cut_short(k, ledger, budget, asking, None, failed=f"{type(e).__name__}: {e}")
            return
        await self._finish(k, ranks, ledger, spent, result)

    async def _cut_short(
        self,
        k: int,
        ledger: str,
        budget: Budget,
        asking: asyncio.Task[HarvestResult],
        cancelled: str | None,
        failed: str | None = None,
    ) -> None:
        """Report a harvest that ended without its pairs. Requests in flight may yet be billed: they are
        counted at their worst case, so the cap stays hard. Written here and now (a second cancel cannot
        interrupt a write that does not wait), the ledger first."""
        asking.cancel()
        await asyncio.gather(asking, return_exceptions=True)
        upper = budget.spent - budget.spent_before + budget.in_flight
        why = {"cancelled": cancelled} if cancelled is not None else {"failed": failed}
        self.run.put(ledger, _spend_entry(k, upper, final=True))
        self.run.put(layout.harvest_report(k), _report(k, upper, **why))
        self._say(
            f"  [yellow]harvest of round {k}:[/] {escape(cancelled or failed or '')}, {usd(upper)} counted"
        )

    async def _finish(
        self, k: int, ranks: list[int], ledger: str, spent: Fraction, result: HarvestResult
    ) -> None:
        """Write what the harvest spent to the ledger, then its pairs, then its report (the replicas take the
        pairs once the report is there)."""
        await asyncio.to_thread(self.run.put, ledger, _spend_entry(k, result.spent, final=True))
        pairs_key = None
        if result.pairs:
            pairs_key = layout.harvested_pairs(k)
            await asyncio.to_thread(self.run.put, pairs_key, pairs_jsonl(result.pairs))
        report = {**result.to_json(), "ranks": ranks, "pairs_file": pairs_key}
        await asyncio.to_thread(self.run.put, layout.harvest_report(k), _report(k, result.spent, **report))
        total = spent + result.spent
        self._say(
            f"  harvest of round {k}: {len(result.pairs)} pairs from {result.prompts} prompts, "
            f"{usd(result.spent)} ({usd(total)} of the {usd(self.harvest.max_usd)} cap)"
            + "".join(f"\n  [yellow]harvest:[/] {escape(p)}" for p in result.problems)
        )

    def _say(self, line: str) -> None:
        self._console.print(line, highlight=False)
