"""The live harvest: while the launcher watches a run with ``harvest.live``, a thread of it harvests the
replicas' latest rollouts between rounds, so the replay channel learns from the student's current mistakes.

The launcher does it, not the replicas, because the launcher holds the teachers' keys: replicas never need
them (the local executor withholds them from their environment; the cloud executors never send them). So a
run whose launcher detached, or died, stops harvesting; ``launch --resume`` starts it again, and rounds
already harvested are not asked twice (each harvest leaves a report in the run).

Round k is harvested once every replica has recorded its rollouts of k, or a later round's rollouts exist
(the ones missing will not come); of several rounds ready, only the newest is harvested: the older ones are
mistakes the student may no longer make. Rounds after ``rounds - 2`` are not harvested: their pairs would be
taken by no round. The cap, ``max_usd``, holds over the whole run: each harvest's budget starts from what the
earlier ones spent (their reports, exactly). A harvest cut short when the watch ends counts everything it had
in flight at its worst case, since those requests may still be billed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from fractions import Fraction
from typing import Any

from rich.console import Console
from rich.markup import escape

from composer_serverless.config import HarvestConfig, RunConfig
from composer_serverless.harvest.cache import AnswerCache
from composer_serverless.harvest.costs import Budget
from composer_serverless.harvest.harvester import harvest, pairs_jsonl
from composer_serverless.harvest.states import latest_rollout_round, read_rollouts, rollout_ranks
from composer_serverless.harvest.stats import usd
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)

POLL_S = 1.0


def harvested_rounds(run: ObjectStore) -> dict[int, dict[str, Any]]:
    """The reports of the run's harvests so far, by round."""
    reports = {}
    for name in run.list(layout.HARVEST_REPORTS):
        if name.endswith(".json") and name.removesuffix(".json").isdigit():
            reports[int(name.removesuffix(".json"))] = json.loads(run.get(f"{layout.HARVEST_REPORTS}/{name}"))
    return reports


def spent_so_far(reports: dict[int, dict[str, Any]]) -> Fraction:
    return sum((Fraction(r["spent_exact"]) for r in reports.values()), Fraction(0))


def ready_round(run: ObjectStore, config: RunConfig, done: set[int]) -> int | None:
    """The round to harvest now, if any (see the module)."""
    newest = latest_rollout_round(run)
    last_useful = config.diloco.rounds - 2
    for k in range(min(newest, last_useful), 0, -1):
        if k in done:
            return None
        if len(rollout_ranks(run, k)) == config.diloco.replicas or newest > k:
            return k
    return None


class LiveHarvester:
    """Harvests one run between its rounds, on a daemon thread, until ``stop``."""

    def __init__(self, run: ObjectStore, config: RunConfig, console: Console) -> None:
        assert config.harvest is not None
        self.run = run
        self.config = config
        self.harvest: HarvestConfig = config.harvest
        self._console = console
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._main, name=f"harvest-{config.run_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop harvesting: a harvest in progress is cancelled and reported (see the module)."""
        self._stopping.set()
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                loop.call_soon_threadsafe(task.cancel)
        self._thread.join(timeout=30)

    def _main(self) -> None:
        asyncio.run(self._watch())

    async def _watch(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        capped = False
        try:
            while not self._stopping.is_set():
                try:
                    reports = await asyncio.to_thread(harvested_rounds, self.run)
                    spent = spent_so_far(reports)
                    k = await asyncio.to_thread(ready_round, self.run, self.config, set(reports))
                    if k is not None and spent < Fraction(self.harvest.max_usd):
                        await self._harvest(k, spent)
                    elif k is not None and not capped:
                        capped = True
                        self._say(
                            f"[yellow]harvest:[/] the cap of {usd(self.harvest.max_usd)} is spent; no more"
                        )
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the run goes on without pairs rather than fail for them
                    logger.exception("the live harvest failed; it tries again at the next poll")
                    self._say(f"[yellow]harvest failed:[/] {escape(f'{type(e).__name__}: {e}')}")
                await asyncio.sleep(POLL_S)
        except asyncio.CancelledError:
            return

    async def _harvest(self, k: int, spent: Fraction) -> None:
        states = await asyncio.to_thread(read_rollouts, self.run, k)
        if not states:  # pruned before it could be read (the run is rounds ahead): nothing to ask
            return
        budget = Budget(Fraction(self.harvest.max_usd), spent=spent)
        cache = AnswerCache(self.run.child(layout.HARVEST_CACHE))
        try:
            result = await harvest(states, self.harvest, cache, budget)
        except asyncio.CancelledError:
            # Requests in flight may yet be billed: counted at their worst case, so the cap stays hard.
            upper = budget.spent - spent + budget.in_flight
            report = {"round": k, "cancelled": True, "spent_exact": str(upper), "spent_usd": float(upper)}
            self.run.put(layout.harvest_report(k), json.dumps(report, sort_keys=True).encode())
            raise
        pairs_key = None
        if result.pairs:
            pairs_key = layout.harvested_pairs(k)
            await asyncio.to_thread(self.run.put, pairs_key, pairs_jsonl(result.pairs))
        report = {**result.to_json(), "round": k, "spent_exact": str(result.spent), "pairs_file": pairs_key}
        await asyncio.to_thread(
            self.run.put, layout.harvest_report(k), json.dumps(report, sort_keys=True).encode()
        )
        total = spent + result.spent
        self._say(
            f"  harvest of round {k}: {len(result.pairs)} pairs from {result.prompts} prompts, "
            f"{usd(result.spent)} ({usd(total)} of the {usd(self.harvest.max_usd)} cap)"
            + "".join(f"\n  [yellow]harvest:[/] {escape(p)}" for p in result.problems)
        )

    def _say(self, line: str) -> None:
        self._console.print(line, highlight=False)
