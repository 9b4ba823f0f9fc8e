"""The replica: an inner loop wrapped in torchft's ``DiLoCo`` (``diloco.py``), synchronised and checkpointed
through the store.

Around DiLoCo the replica keeps the run going through failures:

* After each round (every fragment synced once) it records a digest of the global parameters; every
  participant scores its share of the held-out set (``evaluation.py``), and the round's lowest-rank
  participant adds the shares up and publishes ``state/{k}`` then LATEST.
* Every replica saves its own state (``state.py``), so a run whose replicas all died resumes bit-identically
  from the store.
* Right after every sync, the one moment DiLoCo holds no exchange in flight, it compares itself with the
  store (``catchup.py``): a replica that is a whole round behind (restarted, or failing) loads LATEST; one
  that arrived after the quorum was fixed waits for the round in progress to be published and joins the
  next one in step with the others. When no live replica holds that round (every replica died at once), the
  replicas roll the run back to its newest intact checkpoint by themselves (``recovery.py``) and redo the
  rounds after it, as ``launch --resume`` would.
* A step whose loss is not finite is discarded: the replica restores the global parameters of its last sync
  and goes on; only ``MAX_NONFINITE_STEPS`` of them without a committed round in between stop it.

A replica of G ranks (``node.py``) runs this on every rank, with the model sharded by FSDP2 (``shards.py``):
each rank trains on its share of the batch and syncs its shards, and what the replica decides from the store
(the round to load, whether it is behind, whether to publish) the lead decides and the others follow.
"""

from __future__ import annotations

import contextlib
import logging
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from composer_serverless.accelerator.device import replica_device, synchronize
from composer_serverless.config import RunConfig
from composer_serverless.objectives.objective import Metrics, Objective, add_parts, make_objective
from composer_serverless.objectives.user_code import failed_at
from composer_serverless.rendezvous import checkpoint, layout, recovery, runkey
from composer_serverless.rendezvous.exchange import StaleRoundError
from composer_serverless.rendezvous.feedback import ErrorFeedback
from composer_serverless.rendezvous.latest import latest_round
from composer_serverless.rendezvous.manager import ObjectStoreManager, SyncOutcome
from composer_serverless.rendezvous.replica_log import ReplicaLog
from composer_serverless.rendezvous.runkey import RunKey, run_key
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import Reporter
from composer_serverless.replicas import catchup, evaluation, precision, state
from composer_serverless.replicas.diloco import (
    exchange_settings,
    global_parameters,
    grace_settings,
    make_diloco,
    make_inner_optimizer,
    make_schedule,
    model_names,
    split_fragments,
    transfer_settings,
)
from composer_serverless.replicas.host_diloco import offset_local
from composer_serverless.replicas.meter import RoundMeter, read_step
from composer_serverless.replicas.node import SOLO, Node, training_seed
from composer_serverless.replicas.shards import full_state_dict, local, reshard, shard_model
from composer_serverless.replicas.touches import Touches
from composer_serverless.replicas.weights import check_initial_weights, digest, load_run_model, swapped_in

logger = logging.getLogger(__name__)


# Inner steps with a non-finite loss a replica discards (restoring the global parameters of its last sync)
# between two committed rounds before it stops: once is a bad batch or a spike, again and again is divergence.
MAX_NONFINITE_STEPS = 3


class SyncError(RuntimeError):
    """A replica's syncs failed ``max_failed_syncs`` times in a row; its restart resumes from the store."""


class DivergedError(RuntimeError):
    """The training loss or the global parameters are no longer finite: training further cannot help."""


def run_replica(run: ObjectStore, rank: int, node: Node = SOLO, kind: type[Replica] | None = None) -> None:
    """Train replica ``rank`` of the run at ``run`` (on this process as local rank ``node.local_rank`` of
    its ``node.size``) to the end, reporting through the store, as a ``kind`` of replica (lock-step's).

    The same call starts a fresh replica, restarts one that died, and resumes a run whose replicas all
    died: the replica continues from the store's latest published state and its own saved state.
    """
    config = RunConfig.model_validate_json(run.get(layout.RUN_CONFIG))
    if not 0 <= rank < config.diloco.replicas:
        raise ValueError(f"rank {rank} is outside [0, {config.diloco.replicas})")
    if node.size != config.ranks_per_replica:
        raise ValueError(f"the run has {config.ranks_per_replica} ranks per replica, this node {node.size}")
    run.tolerate_outages(config.diloco.store_outage_s)
    run.configure_transfers(transfer_settings(config.diloco))
    reporter = Reporter(run, rank, silent=not node.lead)
    reporter.beat(state="starting")
    try:
        key = run_key(config.diloco)
        run.ensure_root()
        if key is not None:
            runkey.check_fingerprint(run, key)
            key = key.for_run(config.run_id)
        _train(run, config, rank, reporter, node, key, kind or Replica)
    except BaseException as e:
        # A failure in the user's own code names its line: the launcher says to fix it before a resume.
        where = failed_at(e, config)
        reporter.beat(
            state="failed", error=f"{type(e).__name__}: {e}", **({"user_code": where} if where else {})
        )
        raise


def _train(
    run: ObjectStore,
    config: RunConfig,
    rank: int,
    reporter: Reporter,
    node: Node,
    key: RunKey | None,
    kind: type,
) -> None:
    device = replica_device(node.local_rank)  # the GPU it was given, or a clear error: never a silent CPU
    # The download cache lives as long as training: weights may stay memory-mapped from its files.
    with tempfile.TemporaryDirectory(prefix="composer-serverless-") as cache:
        # One seed for loading, so weights a checkpoint lacks are initialised alike on every replica (and on
        # every rank of one, which FSDP shards from the same whole model); then a seed per rank for training.
        torch.manual_seed(config.seed)
        loaded = load_run_model(run, config, Path(cache))
        torch.manual_seed(training_seed(config.seed, rank, node))
        model = loaded.model.to(device).train()
        if node.size > 1:
            shard_model(model, node.size, device, precision.compute_dtype(config.model))
        kind(
            run, config, rank, reporter, model, loaded.tokenizer, adapters=loaded.adapters, node=node, key=key
        ).run()


class Replica:
    """One replica's model, optimizers, data and DiLoCo, and the loop that runs them to the end of the run."""

    def __init__(
        self,
        run: ObjectStore,
        config: RunConfig,
        rank: int,
        reporter: Reporter,
        model: nn.Module,
        tokenizer: Any,
        *,
        adapters: Any = None,
        node: Node = SOLO,
        key: RunKey | None = None,
    ) -> None:
        dl = config.diloco
        self.run_store = run
        self.key = key
        self.config = config
        self.rank = rank
        self.node = node
        self.reporter = reporter
        self.log = ReplicaLog(logger, rank, node.local_rank if node.size > 1 else None)
        self.model = model
        self.tokenizer = tokenizer
        self.adapters = adapters
        self.device = next(model.parameters()).device
        self.fragments_count = dl.fragments
        self.total_steps = dl.rounds * dl.sync_every
        with self._compute():  # a reference the objective scores now is scored as training will score
            self.objective: Objective = make_objective(
                config, tokenizer, rank, model=model, adapters=adapters, node=node, run=run
            )
        if node.size > 1:
            # An objective that scored a reference just now left the root's whole parameters gathered (FSDP
            # keeps them after a forward, for the backward): the optimizer and DiLoCo must see the shards.
            reshard(model)
        self.inner = make_inner_optimizer(model, config.train)
        # Registered before DiLoCo's own hook, so it runs first: the inner gradients are spent once the step
        # is taken, and freeing them here keeps them from sitting in memory through the sync DiLoCo runs next.
        self.inner.register_step_post_hook(
            lambda optimizer, args, kwargs: optimizer.zero_grad(set_to_none=True)
        )
        self.schedule = make_schedule(self.inner, config.train, self.total_steps)
        self.fragments = split_fragments(model, dl.fragments)
        self.names = model_names(model, self.fragments)
        # Counted on every replica of a run alike (the setting is the run's): every input of a sync has the rows.
        self.touches = (
            Touches(model, self.fragments, node, dl.sync_every) if dl.embedding_average == "touched" else None
        )
        if self.touches is not None:  # before DiLoCo's hook too: a step is counted before the sync it ends
            touches = self.touches
            self.inner.register_step_post_hook(lambda optimizer, args, kwargs: touches.advance())
        self.manager = ObjectStoreManager(
            run,
            run_id=config.run_id or "",
            rank=rank,
            fragments=dl.fragments,
            settings=exchange_settings(dl, node.local_rank, node.size, key),
            grace=grace_settings(dl),
            agree=node.all_true,
            rows=self.touches.take if self.touches is not None else None,
            # The sparse codec drops most of each pseudo-gradient; the rest waits in a residual for later rounds.
            feedback=ErrorFeedback(reset=dl.error_feedback == "reset") if dl.codec == "sparse" else None,
        )
        self.meter = RoundMeter(self.manager, self.device)
        self.epoch = 0  # the run's rollback epoch this replica's state is from (recovery.py)
        self.nonfinite = 0  # steps discarded since the last committed round

    @property
    def completed_rounds(self) -> int:
        return self.manager.current_step() // self.fragments_count

    def run(self) -> None:
        dl = self.config.diloco
        with make_diloco(self.manager, self.fragments, self.inner, dl):
            if self._restore() == 0:
                check_initial_weights(self.run_store, self.model, self.rank, self.node)
                initial = self._evaluate(0, list(range(dl.replicas)))
                if initial is not None:
                    self.reporter.round(0, {"eval": initial, "time": time.time()})
            self._align(late=False)
            self._loop()
        self.reporter.beat(
            state="done",
            round=dl.rounds,
            rounds=dl.rounds,
            step=dl.sync_every,
            steps=dl.sync_every,
        )

    # --- the loop ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        dl = self.config.diloco
        last_step = dl.rounds * dl.fragments
        seen = self.manager.syncs_attempted
        failures = 0
        self.meter.reset()
        while self.manager.current_step() < last_step:
            self._inner_step()
            if self.manager.syncs_attempted == seen:
                continue
            # DiLoCo just finished a sync: nothing is in flight, so this is where the replica may change state.
            # (The new global parameters were computed in host memory and copied to the device blocking.)
            seen = self.manager.syncs_attempted
            outcome = self.manager.last_sync
            assert outcome is not None
            # Agreed: a sync that was stale on one rank and failed on another counts as failed on both. A stale
            # sync (the run is past the round) counts too, but the catch-up after it resets the count: a
            # replica that cannot catch up (nobody publishes the round it waits for) stops after
            # max_failed_syncs instead of waiting and syncing stale rounds for ever.
            committed = self.node.all_true(outcome.committed)
            stale = not committed and self.node.all_true(
                outcome.committed or isinstance(outcome.error, StaleRoundError)
            )
            failures = 0 if committed else failures + 1
            if failures >= dl.max_failed_syncs and not stale:
                raise SyncError(f"{failures} syncs failed in a row; the last: {outcome.error}")
            if outcome.committed and self.manager.current_step() % dl.fragments == 0:
                self._finish_round(outcome)
            if self._align(late=outcome.late):
                self.meter.reset()
                failures = 0
            elif failures >= dl.max_failed_syncs:
                raise SyncError(
                    f"{failures} syncs failed in a row, the last stale ({outcome.error}): the run is past this "
                    "replica's round and it could not catch up (no replica published the round it waited for)"
                )

    def _compute(self) -> contextlib.AbstractContextManager[object]:
        return precision.compute(self.config.model, self.device, sharded=self.node.size > 1)

    def _inner_step(self) -> None:
        """One inner step, measured (``meter.py``); discarded if its loss is not finite (``_discard_step``)."""
        meter = self.meter
        clock = meter.clock
        meter.start_step()
        parts = self.objective.losses(self.model)
        loss: torch.Tensor | None = None
        metrics: Metrics = {}
        while True:  # each micro-batch's backward before the next one's forward
            with self._compute():
                part = next(parts, None)
            if part is None:
                break
            clock.lap("forward")
            part[0].backward()
            clock.lap("backward")
            loss = part[0].detach() if loss is None else loss + part[0].detach()
            metrics = add_parts(metrics, part[1])
        assert loss is not None, "an objective yields at least one micro-batch"
        # Read before the optimizer step, so a non-finite loss never reaches the parameters or the optimizer.
        value, row = read_step(loss, metrics)
        if not self.node.all_true(math.isfinite(value)):  # every rank of the replica discards it, or none
            self._discard_step(value)
            return
        grad_norm = self._grad_norm()
        lr = self.schedule.get_last_lr()[0]
        self.inner.step()  # DiLoCo's hooks run the fragment syncs inside this call; ours frees the gradients
        self.schedule.step()
        clock.lap("optimizer")
        tokens_per_s = meter.end_step(loss.detach(), value, row, lr, grad_norm)
        dl = self.config.diloco
        reward = row.get("rollout/reward_mean")
        self.reporter.beat(
            state="training",
            round=self.completed_rounds + 1,
            rounds=dl.rounds,
            step=min(meter.steps, dl.sync_every),
            steps=dl.sync_every,
            loss=value,
            **({} if reward is None else {"reward": reward}),
            **({} if tokens_per_s is None else {"tokens_per_s": tokens_per_s}),
        )

    def _grad_norm(self) -> torch.Tensor:
        """The step's gradient norm over the whole replica (clipped to ``train.grad_clip`` when set), on the
        device: read with the round's other figures, not now. A sharded model's norm is a DTensor whose
        whole value every rank computes together."""
        clip = self.config.train.grad_clip
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        else:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
        full_tensor = getattr(norm, "full_tensor", None)  # a DTensor (FSDP2 shards)
        return full_tensor() if full_tensor is not None else norm

    def _discard_step(self, value: float) -> None:
        """Drop a step whose loss is ``value`` (not finite) and put the parameters back where the last sync left
        them: whatever drove the loss there (a spike, a bad batch) is not carried on. The inner optimizer never
        saw the step. The step does not count: the round still runs its H steps, on later batches.

        Raises:
            DivergedError: this is the ``MAX_NONFINITE_STEPS``-th such step since the last committed round.
        """
        self.inner.zero_grad(set_to_none=True)
        self.nonfinite += 1
        dl = self.config.diloco
        where = f"in round {self.completed_rounds + 1}, step {self.meter.steps + 1}"
        if self.nonfinite >= MAX_NONFINITE_STEPS:
            raise DivergedError(
                f"replica {self.rank}: the training loss is {value} {where} ({self.nonfinite} non-finite losses "
                f"since the last committed round): training diverged. Lower train.lr (now "
                f"{self.config.train.lr}) or diloco.outer_lr (now {dl.outer_lr}), or set train.grad_clip; the "
                "run's published states before this point are intact"
            )
        synchronize(self.device)  # DiLoCo may still be filling its host copy of the global parameters
        params = self._last_global()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in params:
                    local(p).copy_(params[name])
        feedback = self.manager.feedback
        if feedback is not None and feedback.reset:
            # With error reset the last sync left the local weights at the global ones minus the residual, what
            # this replica has not sent yet; restoring the global ones alone would drop it.
            for index, fragment in enumerate(self.fragments):
                if index in feedback.residuals:
                    offset_local(fragment, feedback.residuals[index].inputs)
        self.log.warning(
            "the training loss is %s %s: step discarded, parameters restored to the last sync's global ones "
            "(%d of %d such steps before the replica stops)",
            value,
            where,
            self.nonfinite,
            MAX_NONFINITE_STEPS - 1,
        )

    def _last_global(self) -> dict[str, torch.Tensor]:
        """The global parameters of the last sync by model name: where a discarded step goes back to."""
        return global_parameters(self.manager, self.names)

    def _finish_round(self, outcome: SyncOutcome) -> None:
        """Record the round; its participants evaluate it together and the lowest-rank one publishes it."""
        round_index = self.completed_rounds
        node = self.node
        self.nonfinite = 0
        # Whose pseudo-gradients the round averaged: a participant whose input was rejected is not one.
        averaged = [p for p in outcome.participants if p not in outcome.rejected]
        row = {**self.meter.row(self.schedule.get_last_lr()[0]), "participants": averaged}
        if outcome.rejected:
            row["rejected"] = outcome.rejected
        self.meter.reset()
        if node.size > 1:
            row.update(self._replica_totals(row))
        params = global_parameters(self.manager, self.names)
        if not all(bool(torch.isfinite(p).all()) for p in params.values()):
            # Averages with a NaN or Inf are rejected, so only the outer step itself can get here.
            raise DivergedError(
                f"replica {self.rank}: the global parameters of round {round_index} are not finite: the outer "
                f"step diverged. Lower diloco.outer_lr (now {self.config.diloco.outer_lr}) or train.lr"
            )
        if self.config.diloco.verify_global:
            row["global_sha256"] = digest(params, node)
        last = round_index == self.config.diloco.rounds
        if last or round_index % self.config.eval.every_rounds == 0:
            scored = self._evaluate(round_index, outcome.participants, params)
            if scored is not None:
                row["eval"] = scored
        row.update(
            self.objective.round_ended(
                round_index, lambda: self._global_model(params), self._waiting(round_index)
            )
        )
        # Recorded before publishing: a publisher that dies while it publishes loses no point of the curve.
        self.reporter.round(round_index, row)
        # A checkpoint every checkpoint_every rounds and at the last: the global state and every replica's own.
        # Between checkpoints the global state is published only when a replica that fell behind asks for it.
        is_checkpoint = last or round_index % self.config.diloco.checkpoint_every == 0
        written = 0
        if outcome.participants[0] == self.rank:
            healing = node.lead and catchup.heal_requested(self.run_store, round_index)
            if is_checkpoint or node.broadcast(healing):
                written += checkpoint.write_global(
                    self.run_store, round_index, state.global_state(self.manager), node.local_rank, self.key
                )
                node.barrier()  # LATEST names a state only once every rank's part of it is written
                if node.lead:
                    checkpoint.advance(
                        self.run_store,
                        round_index,
                        checkpoint=is_checkpoint,
                        keep=self.config.diloco.keep_checkpoints,
                    )
            if last:
                self._upload_final(params)
            if node.lead:
                checkpoint.prune_exchanges(self.run_store, round_index, keep_rollouts=self._rollouts_kept())
        if is_checkpoint:
            written += checkpoint.save_replica(
                self.run_store,
                self.rank,
                round_index,
                self._own_state(params),
                node.local_rank,
                prune=node.size == 1,
                key=self.key,
            )
            if node.size > 1:
                node.barrier()
                if node.lead:
                    checkpoint.prune_replica(self.run_store, self.rank, round_index)
        written = int(node.sum([written])[0])
        if written:
            self.reporter.round(round_index, {**row, "checkpoint_bytes_up": written})
        if node.lead:
            self.log.info(
                "round %d/%d: train loss %s, participants %s",
                round_index,
                self.config.diloco.rounds,
                row["train_loss"],
                outcome.participants,
            )

    def _waiting(self, round_index: int) -> Callable[[str], None]:
        """How the objective says, at the end of ``round_index``, what the replica waits for: its heartbeat."""
        dl = self.config.diloco

        def beat(what: str) -> None:
            self.reporter.beat(
                state=what, round=round_index, rounds=dl.rounds, step=dl.sync_every, steps=dl.sync_every
            )

        return beat

    def _rollouts_kept(self) -> int:
        """Rounds of recorded rollouts kept: with a live harvest, those whose harvest may not have been taken
        yet (the last ``live_lag``) too, so a harvest that runs late still finds them."""
        harvest = self.config.harvest
        lag = harvest.live_lag if harvest is not None and harvest.live else 0
        return max(checkpoint.KEEP_ROUNDS, lag)

    @contextlib.contextmanager
    def _global_model(self, params: dict[str, torch.Tensor]) -> Iterator[nn.Module]:
        """The model holding the round's global parameters (in the precision training computes in)."""
        with swapped_in(self.model, params), self._compute():
            yield self.model

    def _replica_totals(self, row: dict[str, Any]) -> dict[str, Any]:
        """A replica's figures from its ranks' own: the train loss averaged (each rank's is of its equal share
        of the batch), the traffic summed, with each rank's part of it (each moves its own shards)."""
        totals: dict[str, Any] = {}
        if row["train_loss"] is not None:
            totals["train_loss"] = self.node.sum([row["train_loss"]])[0] / self.node.size
        for key in ("bytes_up", "bytes_down"):
            per_rank = [int(b) for b in self.node.gather(float(row[key]))]
            totals[key], totals[f"{key}_per_rank"] = sum(per_rank), per_rank
        return totals

    def _evaluate(
        self, round_index: int, participants: list[int], params: dict[str, torch.Tensor] | None = None
    ) -> dict[str, float] | None:
        """The round's evaluation of the global model ``params`` (None: the model's own weights), shared among
        its participants (``evaluation.evaluate_round``): the whole of it on the lowest-rank one, else None.

        In a replica of several ranks every forward pass runs on all of them (FSDP gathers each layer from
        every rank), so the lead tells the others each share it scores, and they score it with it."""

        def score(part: int, parts: int) -> evaluation.EvalPart:
            holding = contextlib.nullcontext() if params is None else swapped_in(self.model, params)
            with holding, self._compute():
                try:
                    return self.objective.evaluate_part(self.model, part, parts)
                finally:
                    if self.node.size > 1:
                        reshard(self.model)  # before the global parameters are swapped out again

        node = self.node
        if not node.lead:
            while (task := node.broadcast_ints([-1, 0]))[0] >= 0:
                score(*task)
            return None

        def led(part: int, parts: int) -> evaluation.EvalPart:
            node.broadcast_ints([part, parts])
            return score(part, parts)

        try:
            return evaluation.evaluate_round(
                self.run_store, round_index, participants, self.rank, led, self.log
            )
        finally:
            node.broadcast_ints([-1, 0])

    def _upload_final(self, params: dict[str, torch.Tensor]) -> None:
        """The global model in Hugging Face format: the whole model, or with LoRA the adapters (``export``
        merges them into the base model). A sharded model is gathered whole onto the lead first."""
        saved = self.adapters or self.model
        with swapped_in(self.model, params), tempfile.TemporaryDirectory() as out:
            whole = full_state_dict(saved) if self.node.size > 1 else None
            if not self.node.lead:
                return
            saved.save_pretrained(out, state_dict=whole)
            self.tokenizer.save_pretrained(out)
            self.run_store.upload_dir(Path(out), layout.FINAL)

    # --- keeping up with the store -----------------------------------------------------------------

    def _align(self, *, late: bool) -> bool:
        """Catch up with the store if this replica is behind it; True if it loaded a published state.

        A replica a whole round (or more) behind LATEST loads it; one whose state predates a rollback of the
        run (``recovery.py``) restores from where the run now stands. At a round boundary, a replica that
        arrived after the quorum of its last sync (``late``), whose next round already has a quorum without
        it, or that finds the run rounds ahead of it (restarted from an older checkpoint), is behind by more
        than the straggler grace and would stay so: it asks for the round in progress to be published, waits
        for it, and starts the next one with everyone else; if no live replica holds that round, the run
        rolls back. The lead looks and waits; its ranks follow its answers.

        The rollback epoch is read last, after everything else the replica decides on: a rollback claims its
        epoch before it changes anything and moves the epoch after, so an unchanged epoch without a claim
        means nothing read before it came from a rollback in progress. A claimed one is waited for.
        """
        dl = self.config.diloco
        node = self.node
        step = self.manager.current_step()
        boundary = step % dl.fragments == 0 and self.completed_rounds < dl.rounds
        upcoming = self.completed_rounds + 1
        looked = [0, -1, 0, 0]
        if node.lead:
            latest = latest_round(self.run_store)
            ahead = catchup.behind(self.run_store, upcoming) if boundary else upcoming
            falling_behind = boundary and (
                late
                or ahead > upcoming
                or catchup.left_out_of(self.run_store, upcoming, self.rank, dl.replicas)
            )
            epoch = recovery.epoch(self.run_store)
            claimed = epoch == self.epoch and recovery.claimed(self.run_store, epoch)
            looked = [latest, ahead if falling_behind else -1, epoch, claimed]
        latest, target, epoch, claimed = node.broadcast_ints(looked)
        if epoch != self.epoch:
            self._rolled_back()
            return True
        if claimed:
            if node.lead:
                self.log.warning("the run is being rolled back: waiting for it before training on")
                self._join_roll_back(upcoming)
            self._rolled_back()
            return True
        if latest * dl.fragments > step:
            self._jump(latest)
            return True
        if target < 0:
            return False
        waited = catchup.Waited()
        if node.lead:
            waited = self._wait_for(target)
        published, stranded, rolled_back = node.broadcast_ints(
            [-1 if waited.published is None else waited.published, waited.stranded, waited.rolled_back]
        )
        if stranded:
            if node.lead:
                self._roll_back(target)
            self._rolled_back()
            return True
        if rolled_back:
            self._rolled_back()
            return True
        if published < 0:
            return False
        self._jump(published)
        return True

    def _wait_for(self, target: int) -> catchup.Waited:
        """The lead's wait for round ``target`` to be published (``catchup.wait_for_round``), in the log and
        the heartbeat."""
        dl = self.config.diloco
        self.log.info("behind the run: waiting for round %d to be published", target)

        def waiting() -> None:
            self.reporter.beat(
                state=recovery.WAITING, round=target, rounds=dl.rounds, step=0, steps=dl.sync_every
            )

        waited = catchup.wait_for_round(
            self.run_store, target, self.rank, dl.replicas, self.epoch, dl.sync_timeout_s, waiting
        )
        if waited.timed_out:
            self.log.warning(
                "round %d was not published within diloco.sync_timeout_s (%.0f s) though replicas %s may hold "
                "it; training on and asking again at the next round",
                target,
                dl.sync_timeout_s,
                waited.holders,
            )
        return waited

    def _roll_back(self, target: int) -> None:
        """Roll the run back (the lead, for its replica): no live replica holds round ``target``."""
        self.log.warning(
            "no live replica holds round %d, which every replica waits for: rolling the run back to its newest "
            "intact checkpoint",
            target,
        )
        self._join_roll_back(target)

    def _join_roll_back(self, target: int) -> None:
        """Take part in the rollback of this replica's epoch (``recovery.roll_back``): wait for the one claimed,
        or make it (taking over a claimant that died)."""
        done = recovery.roll_back(
            self.run_store, self.epoch, target, self.rank, self.config.ranks_per_replica
        )
        if done is not None:
            self.log.warning(
                "rolled the run back to round %d; rounds %d-%d are redone%s",
                done.to,
                done.to + 1,
                target,
                f" (passed over: {'; '.join(done.skipped)})" if done.skipped else "",
            )

    def _rolled_back(self) -> None:
        """Continue from where the run stands after a rollback, as a restarted replica does."""
        was = self.completed_rounds
        restored = self._restore()
        if self.node.lead:
            self.log.warning(
                "the run was rolled back (epoch %d): continuing from round %d (was at round %d)",
                self.epoch,
                restored,
                was,
            )

    def _jump(self, round_index: int) -> None:
        """Continue from the published global state of ``round_index``, keeping this replica's own state."""
        was = self.completed_rounds
        published = state.load_global(self.run_store, round_index, self.node, key=self.key)
        state.apply_global(self.manager, self.names, self.model, published)
        if self.touches is not None:  # the steps they counted are discarded with the local weights
            self.touches.clear()
        if self.manager.feedback is not None:  # a residual of rounds this replica did not finish with the run
            self.manager.feedback.clear()
        dl = self.config.diloco
        self.schedule = self._schedule_at(self.completed_rounds)
        # The inner steps run since the last row are discarded by the jump; counted, so goodput can be.
        row: dict[str, Any] = {"caught_up_from": was, "steps": self.meter.steps, "time": time.time()}
        if dl.verify_global:
            row["global_sha256"] = digest(global_parameters(self.manager, self.names), self.node)
        self.reporter.round(self.completed_rounds, row)
        if self.node.lead:
            self.log.warning(
                "loaded the global state of round %d from the store (was at round %d)",
                self.completed_rounds,
                was,
            )

    # --- state -------------------------------------------------------------------------------------

    def _schedule_at(self, round_index: int) -> torch.optim.lr_scheduler.LambdaLR:
        """The learning-rate schedule placed at the start of the round after ``round_index``."""
        done = round_index * self.config.diloco.sync_every
        return make_schedule(self.inner, self.config.train, self.total_steps, done)

    def _own_state(self, global_params: dict[str, torch.Tensor]) -> dict[str, Any]:
        own = state.own_state(
            self.model, self.inner, self.schedule, self.objective, global_params, self.device
        )
        if self.touches is not None:
            own["touched"] = self.touches.state_dict()
        if self.manager.feedback is not None:
            own["residual"] = self.manager.feedback.state_dict()
        return own

    def _restore(self) -> int:
        """Continue from the store's latest state and this replica's own; returns the round (0 if fresh).

        The rollback epoch is read first: a rollback that lands while this replica restores (it moves LATEST,
        then the epoch) is seen at the next sync, and the replica restores again."""
        node = self.node
        looked = [recovery.epoch(self.run_store), latest_round(self.run_store)] if node.lead else [0, 0]
        self.epoch, latest = node.broadcast_ints(looked)
        if self.touches is not None:  # counted by steps this restore discards; the own state may hold some
            self.touches.clear()
        if self.manager.feedback is not None:  # as are residuals; the own state of this round holds the run's
            self.manager.feedback.clear()
        if latest == 0:
            return 0
        published = state.load_global(self.run_store, latest, node, fall_back=True, key=self.key)
        state.apply_global(self.manager, self.names, self.model, published)
        latest = self.completed_rounds
        own = checkpoint.load_replica(
            self.run_store, self.rank, latest, node.local_rank, node.all_true, key=self.key
        )
        if own is None:
            self.schedule = self._schedule_at(latest)
            self.log.warning(
                "resuming from round %d with a fresh inner optimizer (no state of its own)", latest
            )
            return latest
        own_round, saved = own
        current = own_round == latest
        state.restore_own(
            saved,
            inner=self.inner,
            objective=self.objective,
            model=self.model,
            schedule=self.schedule if current else None,
            device=self.device,
        )
        if not current:  # an older state of its own: its schedule is placed at the round resumed
            self.schedule = self._schedule_at(latest)
        else:
            if self.touches is not None:
                self.touches.load_state_dict(saved.get("touched"))
            if self.manager.feedback is not None:
                # With error reset the local weights, global minus the residual, are among the local
                # parameters restored above.
                self.manager.feedback.load_state_dict(saved.get("residual"))
        self.log.info("resumed from round %d (own state of round %d)", latest, own_round)
        return latest
