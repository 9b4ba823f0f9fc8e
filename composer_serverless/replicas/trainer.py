"""The replica: an inner loop wrapped in torchft's ``DiLoCo``, synchronised and checkpointed through the store.

torchft's ``DiLoCo`` hooks the inner optimizer's ``step``: every ``sync_every / fragments`` steps it computes
the pseudo-gradient of one fragment (global - local), has the manager average it, restores the global
parameters and applies the outer optimizer. We supply the manager (``ObjectStoreManager``), the fragments
(strided decoder layers, as in Streaming DiLoCo) and one outer Nesterov SGD per fragment; the algorithm is
torchft's, unmodified.

Around it the replica keeps the run going through failures:

* After each round (every fragment synced once) it records a digest of the global parameters; every
  participant scores its share of the held-out set, and the round's lowest-rank participant adds the shares
  up and publishes ``state/{k}`` then LATEST.
* Every replica saves its own state (``replicas/{rank}/{k}``), so a run whose replicas all died resumes
  bit-identically from the store.
* Right after every sync, the one moment DiLoCo holds no exchange in flight, it compares itself with the
  store: a replica that is a whole round behind (restarted, or failing) loads LATEST; one that arrived
  after the quorum was fixed waits for the round in progress to be published and joins the next one in
  step with the others. A lag does not shrink by itself (every replica trains at the same pace), so
  without this it would heal every sync without contributing again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchft.local_sgd import DiLoCo

from composer_serverless.config import DiLoCoConfig, RunConfig, TrainConfig
from composer_serverless.models import load_pretrained
from composer_serverless.rendezvous import checkpoint, layout
from composer_serverless.rendezvous.allreduce import ExchangeSettings, StaleRoundError, backoff_sleep
from composer_serverless.rendezvous.checkpoint import CheckpointError
from composer_serverless.rendezvous.deadline import GraceSettings
from composer_serverless.rendezvous.latest import latest_round
from composer_serverless.rendezvous.manager import ObjectStoreManager, SyncOutcome
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import Reporter, mean_metrics
from composer_serverless.replicas import evaluation
from composer_serverless.replicas.objective import Objective, make_objective

logger = logging.getLogger(__name__)

# The shortest wait for the other replicas' evaluation shares, beyond twice this replica's own share's time.
EVAL_WAIT_MIN_S = 1.0
# Longest pause between polls of the store while waiting for a round or for evaluation shares.
WAIT_POLL_CAP_S = 0.25


class InitialWeightsError(RuntimeError):
    """This replica loaded weights that differ from another replica's, so the run cannot be DiLoCo."""


class SyncError(RuntimeError):
    """A replica's syncs failed ``max_failed_syncs`` times in a row; its restart resumes from the store."""


# --- DiLoCo wiring ------------------------------------------------------------------------------------


def split_fragments(model: nn.Module, count: int) -> list[nn.Module]:
    """Partition ``model``'s parameters into ``count`` modules, one per Streaming DiLoCo fragment.

    Decoder layers are dealt out strided (layer i to fragment i % count), the pattern Streaming DiLoCo found
    best; parameters outside the layers (embeddings, final norm, a tied head) join fragment 0. The fragments
    hold the model's own Parameter objects, so updates through a fragment are updates of the model.
    """
    if count == 1:
        return [model]
    layers = max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len, default=None)
    if layers is None or len(layers) < count:
        raise ValueError(
            f"cannot split the model into {count} fragments: it has {len(layers or [])} decoder layers"
        )
    fragments = [nn.Module() for _ in range(count)]
    in_layers: set[int] = set()
    for i, layer in enumerate(layers):
        fragments[i % count].add_module(f"layer{i}", layer)
        in_layers.update(id(p) for p in layer.parameters())
    for name, param in model.named_parameters():
        if id(param) not in in_layers:
            fragments[0].register_parameter(name.replace(".", "__"), param)
    return fragments


def model_names(model: nn.Module, fragments: list[nn.Module]) -> list[dict[str, str]]:
    """For each fragment, its parameter names mapped to the model's parameter names."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    return [{local: by_id[id(p)] for local, p in fragment.named_parameters()} for fragment in fragments]


def make_inner_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (decay on matrices only, as is standard for transformers) or plain SGD."""
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)


def make_schedule(
    optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int, done_steps: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant or cosine decay to ``min_lr_ratio`` over the run's inner steps.

    ``done_steps`` starts the schedule part-way, for a replica that joins from a published state.
    """

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    if done_steps:
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=done_steps - 1)


def make_outer_optimizers(fragments: list[nn.Module], config: DiLoCoConfig) -> list[torch.optim.Optimizer]:
    """One outer SGD per fragment, so each fragment's momentum is saved and restored with that fragment."""
    return [
        torch.optim.SGD(
            f.parameters(), lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.nesterov
        )
        for f in fragments
    ]


def make_diloco(
    manager: ObjectStoreManager,
    fragments: list[nn.Module],
    inner: torch.optim.Optimizer,
    outer: list[torch.optim.Optimizer],
    config: DiLoCoConfig,
) -> DiLoCo:
    """torchft's DiLoCo with one bucket per fragment, so the store exchanges one object per replica and sync."""
    dtypes = {p.dtype for f in fragments for p in f.parameters()}
    if len(dtypes) != 1:
        raise ValueError(
            f"all parameters must share one dtype for the flat exchange, got {sorted(map(str, dtypes))}"
        )
    largest = max(sum(p.numel() * p.element_size() for p in f.parameters()) for f in fragments)
    return DiLoCo(
        manager,
        fragments,
        inner,
        outer,
        sync_every=config.sync_every,
        use_bucketization=True,
        bucket_cap_mb=math.ceil(largest / 2**20),
        fragment_sync_delay=config.fragment_sync_delay,
        fragment_update_alpha=config.fragment_update_alpha,
    )


def global_parameters(manager: ObjectStoreManager, names: list[dict[str, str]]) -> dict[str, torch.Tensor]:
    """The global (outer) parameters by model name, from the state DiLoCo registered with the manager."""
    state = manager.user_state_dict()
    params = {}
    for i, mapping in enumerate(names):
        originals = state[f"StreamingDiLoCoFragment_{i}"]["original_parameters"]
        params.update({mapping[local]: tensor for local, tensor in originals.items()})
    return params


def digest(params: dict[str, torch.Tensor]) -> str:
    """sha256 over the raw bytes of every tensor in name order: equal iff bit-identical."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_initial_weights(run: ObjectStore, model: nn.Module, rank: int) -> None:
    """Refuse to train from weights that differ from the other replicas'.

    DiLoCo averages pseudo-gradients, not parameters: replicas that start apart stay apart for the whole
    run. The first fresh replica records the digest of its weights (create-if-absent); every other one must
    match it.

    Raises:
        InitialWeightsError: this replica's weights are not the recorded ones.
    """
    mine = digest(dict(model.named_parameters()))
    if checkpoint.agree_on_initial_weights(run, mine):
        return
    raise InitialWeightsError(
        f"replica {rank}: the model's initial weights differ from those another replica loaded "
        f"(sha256 {mine[:12]} vs {checkpoint.initial_weights(run)[:12]}); DiLoCo needs every replica to start "
        "from the same weights. Load them deterministically: a model whose code initialises weights at load "
        "time with its own randomness, or a checkpoint that changed while replicas downloaded it, does this"
    )


@contextmanager
def swapped_in(model: nn.Module, params: dict[str, torch.Tensor]) -> Iterator[nn.Module]:
    """Temporarily load ``params`` into ``model`` (to evaluate or save the global model), then restore."""
    current = dict(model.named_parameters())
    saved = {name: current[name].detach().clone() for name in params}
    with torch.no_grad():
        for name, value in params.items():
            current[name].copy_(value)
    try:
        yield model
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                current[name].copy_(value)


# --- the replica --------------------------------------------------------------------------------------


def exchange_settings(config: DiLoCoConfig) -> ExchangeSettings:
    return ExchangeSettings(
        replicas=config.replicas,
        min_replicas=config.min_replicas,
        codec=config.codec,
        timeout_s=config.sync_timeout_s,
    )


def grace_settings(config: DiLoCoConfig) -> GraceSettings:
    return GraceSettings(
        min_s=config.quorum_grace_min_s, max_s=config.quorum_grace_max_s, mads=config.quorum_grace_mads
    )


def load_run_model(run: ObjectStore, config: RunConfig, cache: Path) -> tuple[Any, Any]:
    """Load the run's model: the tiny model stored in the run, or the configured hub id / path."""
    if config.model.path is not None:
        return load_pretrained(config.model.path, config.model.dtype)
    local = run.local_dir(layout.MODEL) or run.download_dir(layout.MODEL, cache / layout.MODEL)
    return load_pretrained(local, config.model.dtype)


def run_replica(run: ObjectStore, rank: int) -> None:
    """Train replica ``rank`` of the run at ``run`` to the end, reporting through the store.

    The same call starts a fresh replica, restarts one that died, and resumes a run whose replicas all
    died: the replica continues from the store's latest published state and its own saved state.
    """
    config = RunConfig.model_validate_json(run.get(layout.RUN_CONFIG))
    if not 0 <= rank < config.diloco.replicas:
        raise ValueError(f"rank {rank} is outside [0, {config.diloco.replicas})")
    reporter = Reporter(run, rank)
    reporter.beat(state="starting")
    try:
        run.ensure_root()
        _train(run, config, rank, reporter)
    except BaseException as e:
        reporter.beat(state="failed", error=f"{type(e).__name__}: {e}")
        raise


def _train(run: ObjectStore, config: RunConfig, rank: int, reporter: Reporter) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # The download cache lives as long as training: weights may stay memory-mapped from its files.
    with tempfile.TemporaryDirectory(prefix="composer-serverless-") as cache:
        # One seed for loading, so weights a checkpoint lacks are initialised alike on every replica;
        # a seed per rank for training, so replicas sample differently.
        torch.manual_seed(config.seed)
        model, tokenizer = load_run_model(run, config, Path(cache))
        torch.manual_seed(config.seed + rank)
        Replica(run, config, rank, reporter, model.to(device).train(), tokenizer).run()


class _RoundMeter:
    """Train loss and metrics, time, blocking and traffic accumulated since the last round ended."""

    def __init__(self, manager: ObjectStoreManager) -> None:
        self._manager = manager
        self.reset()

    def reset(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.metrics: list[dict[str, float]] = []
        self.steps = 0
        self._started = time.monotonic()
        self._blocked = self._manager.blocked_s
        self._up = self._manager.bytes_up
        self._down = self._manager.bytes_down

    def row(self, lr: float) -> dict[str, Any]:
        return {
            "train_loss": float(torch.stack(self.losses).float().mean()) if self.losses else None,
            "train": mean_metrics(self.metrics),
            "steps": self.steps,
            "lr": lr,
            "bytes_up": self._manager.bytes_up - self._up,
            "bytes_down": self._manager.bytes_down - self._down,
            "round_s": time.monotonic() - self._started,
            "blocked_s": self._manager.blocked_s - self._blocked,
            "time": time.time(),
        }


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
    ) -> None:
        dl = config.diloco
        self.run_store = run
        self.config = config
        self.rank = rank
        self.reporter = reporter
        self.model = model
        self.tokenizer = tokenizer
        self.fragments_count = dl.fragments
        self.total_steps = dl.rounds * dl.sync_every
        self.objective: Objective = make_objective(config, tokenizer, rank, model=model)
        self.inner = make_inner_optimizer(model, config.train)
        self.schedule = make_schedule(self.inner, config.train, self.total_steps)
        self.fragments = split_fragments(model, dl.fragments)
        self.names = model_names(model, self.fragments)
        self.outer = make_outer_optimizers(self.fragments, dl)
        self.manager = ObjectStoreManager(
            run,
            run_id=config.run_id or "",
            rank=rank,
            fragments=dl.fragments,
            settings=exchange_settings(dl),
            grace=grace_settings(dl),
        )
        self.meter = _RoundMeter(self.manager)

    @property
    def completed_rounds(self) -> int:
        return self.manager.current_step() // self.fragments_count

    def run(self) -> None:
        dl = self.config.diloco
        with make_diloco(self.manager, self.fragments, self.inner, self.outer, dl):
            if self._restore() == 0:
                check_initial_weights(self.run_store, self.model, self.rank)
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
            self.meter.losses.append(self._inner_step())
            if self.manager.syncs_attempted == seen:
                continue
            # DiLoCo just finished a sync: nothing is in flight, so this is where the replica may change state.
            seen = self.manager.syncs_attempted
            outcome = self.manager.last_sync
            assert outcome is not None
            if outcome.committed or isinstance(outcome.error, StaleRoundError):
                failures = 0
            else:
                failures += 1
                if failures >= dl.max_failed_syncs:
                    raise SyncError(f"{failures} syncs failed in a row; the last: {outcome.error}")
            if outcome.committed and self.manager.current_step() % dl.fragments == 0:
                self._finish_round(outcome)
            if self._align(late=outcome.late):
                self.meter.reset()

    def _inner_step(self) -> torch.Tensor:
        loss, metrics = self.objective.loss(self.model)
        self.meter.metrics.append({name: float(value) for name, value in metrics.items()})
        loss.backward()
        if self.config.train.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.train.grad_clip)
        self.inner.step()  # DiLoCo's hooks run the fragment syncs inside this call
        self.schedule.step()
        self.inner.zero_grad(set_to_none=True)
        self.meter.steps += 1
        dl = self.config.diloco
        self.reporter.beat(
            state="training",
            round=self.completed_rounds + 1,
            rounds=dl.rounds,
            step=min(self.meter.steps, dl.sync_every),
            steps=dl.sync_every,
            loss=loss.item(),
        )
        return loss.detach()

    def _finish_round(self, outcome: SyncOutcome) -> None:
        """Record the round; its participants evaluate it together and the lowest-rank one publishes it."""
        round_index = self.completed_rounds
        row = {**self.meter.row(self.schedule.get_last_lr()[0]), "participants": outcome.participants}
        self.meter.reset()
        params = global_parameters(self.manager, self.names)
        if self.config.diloco.verify_global:
            row["global_sha256"] = digest(params)
        last = round_index == self.config.diloco.rounds
        if last or round_index % self.config.eval.every_rounds == 0:
            scored = self._evaluate(round_index, outcome.participants, params)
            if scored is not None:
                row["eval"] = scored
        if outcome.participants[0] == self.rank:
            checkpoint.write_global(self.run_store, round_index, self._global_state())
            if last:
                self._upload_final(params)
            checkpoint.advance_latest(self.run_store, round_index)
        checkpoint.save_replica(self.run_store, self.rank, round_index, self._own_state(params))
        self.reporter.round(round_index, row)
        logger.info(
            "[replica %d] round %d/%d: train loss %s, participants %s",
            self.rank,
            round_index,
            self.config.diloco.rounds,
            row["train_loss"],
            outcome.participants,
        )

    def _evaluate(
        self, round_index: int, participants: list[int], params: dict[str, torch.Tensor] | None = None
    ) -> dict[str, float] | None:
        """Score the global model ``params`` (None: the model's own weights) on this replica's share of the
        held-out set (see ``evaluation.py``). The lowest-rank participant returns the whole evaluation: it
        gathers the other shares from the store and scores itself any that is malformed or has not come within
        twice its own share's time (its replica died, or lags). The others publish their share and return
        None, and so does a replica that took the round's result without taking part in it (it has no share)."""
        if self.rank not in participants:
            return None
        parts, part = len(participants), participants.index(self.rank)
        started = time.monotonic()
        with self._holding(params):
            shares = {part: self.objective.evaluate_part(self.model, part, parts)}
        if part != 0:
            self.run_store.put(layout.eval_share(round_index, part, parts), evaluation.dumps(shares[part]))
            return None
        deadline = time.monotonic() + EVAL_WAIT_MIN_S + 2 * (time.monotonic() - started)
        delay = 0.01
        while len(shares) < parts:
            for p in range(1, parts):
                if (
                    p not in shares
                    and (got := self._collect_share(round_index, p, parts, params)) is not None
                ):
                    shares[p] = got
            if len(shares) == parts:
                break
            if time.monotonic() >= deadline:
                missing = [participants[p] for p in range(parts) if p not in shares]
                logger.warning(
                    "[replica %d] round %d: scoring the evaluation shares of replicas %s here",
                    self.rank,
                    round_index,
                    missing,
                )
                with self._holding(params):
                    for p in range(parts):
                        shares.setdefault(p, self.objective.evaluate_part(self.model, p, parts))
                break
            delay = backoff_sleep(delay, WAIT_POLL_CAP_S)
        return evaluation.combine([shares[p] for p in range(parts)])

    def _holding(self, params: dict[str, torch.Tensor] | None) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if params is None else swapped_in(self.model, params)

    def _collect_share(
        self, round_index: int, part: int, parts: int, params: dict[str, torch.Tensor] | None
    ) -> evaluation.EvalPart | None:
        """Share ``part`` as published, None while it has not come. A share is written once, so a malformed
        one will never become valid: it is scored here at once, not polled for until the deadline."""
        try:
            return evaluation.loads(self.run_store.get(layout.eval_share(round_index, part, parts)))
        except FileNotFoundError:
            return None
        except ValueError as e:
            logger.warning(
                "[replica %d] round %d: evaluation share %d is malformed (%s); scoring it here",
                self.rank,
                round_index,
                part,
                e,
            )
            with self._holding(params):
                return self.objective.evaluate_part(self.model, part, parts)

    def _upload_final(self, params: dict[str, torch.Tensor]) -> None:
        with swapped_in(self.model, params), tempfile.TemporaryDirectory() as out:
            self.model.save_pretrained(out)
            self.tokenizer.save_pretrained(out)
            self.run_store.upload_dir(Path(out), layout.FINAL)

    # --- keeping up with the store -----------------------------------------------------------------

    def _align(self, *, late: bool) -> bool:
        """Catch up with the store if this replica is behind it; True if it loaded a published state.

        A replica a whole round (or more) behind loads LATEST. At a round boundary, a replica that arrived
        after the quorum of its last sync (``late``), or whose next round already has a quorum without it,
        is behind by more than the straggler grace and would stay so, healing every sync without
        contributing: it waits for the round in progress to be published and starts the next one with
        everyone else.
        """
        dl = self.config.diloco
        step = self.manager.current_step()
        latest = latest_round(self.run_store)
        if latest * dl.fragments > step:
            self._jump(latest)
            return True
        if step % dl.fragments or self.completed_rounds >= dl.rounds:
            return False
        upcoming = self.completed_rounds + 1
        if late or self._quorum_without_me(upcoming):
            reached = self._wait_for_round(upcoming)
            if reached is not None:
                self._jump(reached)
                return True
        return False

    def _quorum_without_me(self, round_index: int) -> bool:
        try:
            quorum = json.loads(self.run_store.get(layout.quorum(round_index, 0)))
        except FileNotFoundError:
            return False
        return self.rank not in quorum.get("participants", [])

    def _wait_for_round(self, round_index: int) -> int | None:
        """Wait (at most ``sync_timeout_s``) until ``round_index`` is published; the latest round, or None."""
        dl = self.config.diloco
        logger.info("[replica %d] late for round %d: waiting for it to be published", self.rank, round_index)
        deadline = time.monotonic() + dl.sync_timeout_s
        delay = 0.01
        while time.monotonic() < deadline:
            latest = latest_round(self.run_store)
            if latest >= round_index:
                return latest
            self.reporter.beat(
                state="waiting", round=round_index, rounds=dl.rounds, step=0, steps=dl.sync_every
            )
            delay = backoff_sleep(delay, WAIT_POLL_CAP_S)
        logger.warning(
            "[replica %d] round %d was not published in time; training it and healing", self.rank, round_index
        )
        return None

    def _jump(self, round_index: int) -> None:
        """Continue from the published global state of ``round_index``, keeping this replica's own state."""
        was = self.completed_rounds
        self._apply_global(self._load_global(round_index))
        dl = self.config.diloco
        self.schedule = make_schedule(
            self.inner, self.config.train, self.total_steps, self.completed_rounds * dl.sync_every
        )
        params = global_parameters(self.manager, self.names)
        # The inner steps run since the last row are discarded by the jump; counted, so goodput can be.
        row: dict[str, Any] = {"caught_up_from": was, "steps": self.meter.steps, "time": time.time()}
        if dl.verify_global:
            row["global_sha256"] = digest(params)
        checkpoint.save_replica(self.run_store, self.rank, self.completed_rounds, self._own_state(params))
        self.reporter.round(self.completed_rounds, row)
        logger.warning(
            "[replica %d] loaded the global state of round %d from the store (was at round %d)",
            self.rank,
            self.completed_rounds,
            was,
        )

    def _load_global(self, round_index: int) -> dict[str, Any]:
        """The published state of ``round_index``, or of a newer round if that one was pruned meanwhile."""
        for _ in range(3):
            try:
                return checkpoint.load_global(self.run_store, round_index)
            except FileNotFoundError:
                round_index = latest_round(self.run_store)
        raise CheckpointError(
            f"cannot read the global state of round {round_index} from {self.run_store.url}"
        )

    # --- state -------------------------------------------------------------------------------------

    def _global_state(self) -> dict[str, Any]:
        return {"step": self.manager.current_step(), "user": self.manager.user_state_dict()}

    def _own_state(self, global_params: dict[str, torch.Tensor]) -> dict[str, Any]:
        rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "inner_optimizer": self.inner.state_dict(),
            "schedule": self.schedule.state_dict(),
            "objective": self.objective.state_dict(),
            "rng": rng,
            # Between syncs a fragment's local parameters run ahead of its global ones (fragments other than
            # the last synced, or alpha > 0); only those differ and need saving.
            "local_parameters": {
                name: p
                for name, p in self.model.named_parameters()
                if not torch.equal(p.detach(), global_params[name])
            },
        }

    def _apply_global(self, state: dict[str, Any]) -> None:
        user = state["user"]
        for i, mapping in enumerate(self.names):
            saved = set(user.get(f"StreamingDiLoCoFragment_{i}", {}).get("original_parameters", {}))
            if saved != set(mapping):
                raise CheckpointError(
                    f"fragment {i} of the published state does not match this model's parameters"
                )
        self.manager.load_user_state_dict(user)
        self.manager.set_step(int(state["step"]))
        params = global_parameters(self.manager, self.names)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(params[name])

    def _restore(self) -> int:
        """Continue from the store's latest state and this replica's own; returns the round (0 if fresh)."""
        latest = latest_round(self.run_store)
        if latest == 0:
            return 0
        self._apply_global(self._load_global(latest))
        latest = self.completed_rounds
        dl = self.config.diloco
        own = checkpoint.load_replica(self.run_store, self.rank, latest)
        if own is None:
            self.schedule = make_schedule(
                self.inner, self.config.train, self.total_steps, latest * dl.sync_every
            )
            logger.warning(
                "[replica %d] resuming from round %d with a fresh inner optimizer (no state of its own)",
                self.rank,
                latest,
            )
            return latest
        own_round, state = own
        self.inner.load_state_dict(state["inner_optimizer"])
        self.objective.load_state_dict(state["objective"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        if own_round == latest:
            self.schedule.load_state_dict(state["schedule"])
            current = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, value in state["local_parameters"].items():
                    current[name].copy_(value)
        else:
            self.schedule = make_schedule(
                self.inner, self.config.train, self.total_steps, latest * dl.sync_every
            )
        logger.info(
            "[replica %d] resumed from round %d (own state of round %d)", self.rank, latest, own_round
        )
        return latest
