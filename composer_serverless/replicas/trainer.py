"""The replica: an inner loop wrapped in torchft's ``DiLoCo``, synchronised through the object store.

torchft's ``DiLoCo`` hooks the inner optimizer's ``step``: every ``sync_every / fragments`` steps it computes
the pseudo-gradient of one fragment (global - local), has the manager average it, restores the global
parameters and applies the outer optimizer. We supply the manager (``ObjectStoreManager``), the fragments
(strided decoder layers, as in Streaming DiLoCo) and one outer Nesterov SGD per fragment; the algorithm is
torchft's, unmodified.

After each round (every fragment synced once) the replica records a digest of the global parameters, and
the lowest rank evaluates the global model, so the launcher can show that replicas agree bit for bit and
that the model improves.
"""

from __future__ import annotations

import hashlib
import logging
import math
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
from composer_serverless.rendezvous.manager import ObjectStoreManager
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.objective import make_objective
from composer_serverless.telemetry import Reporter, mean_metrics

logger = logging.getLogger(__name__)

MODEL_PREFIX = "model"
FINAL_PREFIX = "final"


class SyncError(RuntimeError):
    """A round did not commit on this replica."""


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
        raise ValueError(f"cannot split the model into {count} fragments: it has {len(layers or [])} decoder layers")
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


def make_schedule(optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant or cosine decay to ``min_lr_ratio`` over the run's inner steps."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_outer_optimizers(fragments: list[nn.Module], config: DiLoCoConfig) -> list[torch.optim.Optimizer]:
    """One outer SGD per fragment, so each fragment's momentum is saved and restored with that fragment."""
    return [
        torch.optim.SGD(f.parameters(), lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.nesterov)
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
        raise ValueError(f"all parameters must share one dtype for the flat exchange, got {sorted(map(str, dtypes))}")
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


def load_run_model(run: ObjectStore, config: RunConfig, cache: Path) -> tuple[Any, Any]:
    """Load the run's model: the tiny model stored in the run, or the configured hub id / path."""
    if config.model.path is not None:
        return load_pretrained(config.model.path, config.model.dtype)
    local = run.local_dir(MODEL_PREFIX) or run.download_dir(MODEL_PREFIX, cache / MODEL_PREFIX)
    return load_pretrained(local, config.model.dtype)


def run_replica(run: ObjectStore, rank: int) -> None:
    """Train replica ``rank`` of the run at ``run`` to the end, reporting through the store."""
    config = RunConfig.model_validate_json(run.get("run.json"))
    if not 0 <= rank < config.diloco.replicas:
        raise ValueError(f"rank {rank} is outside [0, {config.diloco.replicas})")
    reporter = Reporter(run, rank)
    reporter.beat(force=True, state="starting")
    try:
        _train(run, config, rank, reporter)
    except BaseException as e:
        reporter.beat(force=True, state="failed", error=f"{type(e).__name__}: {e}")
        raise


def _train(run: ObjectStore, config: RunConfig, rank: int, reporter: Reporter) -> None:
    torch.manual_seed(config.seed + rank)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # The download cache lives as long as training: weights may stay memory-mapped from its files.
    with tempfile.TemporaryDirectory(prefix="composer-serverless-") as cache:
        model, tokenizer = load_run_model(run, config, Path(cache))
        _loop(run, config, rank, reporter, model.to(device).train(), tokenizer)


def _loop(run: ObjectStore, config: RunConfig, rank: int, reporter: Reporter, model: nn.Module, tokenizer: Any) -> None:
    dl = config.diloco
    objective = make_objective(config, tokenizer, rank, model=model)
    total_steps = dl.rounds * dl.sync_every
    inner = make_inner_optimizer(model, config.train)
    schedule = make_schedule(inner, config.train, total_steps)
    fragments = split_fragments(model, dl.fragments)
    names = model_names(model, fragments)
    manager = ObjectStoreManager(
        run, run_id=config.run_id or "", rank=rank, replicas=dl.replicas, fragments=dl.fragments, timeout_s=dl.sync_timeout_s
    )
    evaluator = rank == 0

    with make_diloco(manager, fragments, inner, make_outer_optimizers(fragments, dl), dl):
        if evaluator:
            reporter.round(0, {"eval": objective.evaluate(model), "time": time.time()})
        for round_index in range(1, dl.rounds + 1):
            started, blocked_before = time.monotonic(), manager.blocked_s
            losses: list[torch.Tensor] = []
            step_metrics: list[dict[str, float]] = []
            for step in range(dl.sync_every):
                loss, metrics = objective.loss(model)
                step_metrics.append({name: float(value) for name, value in metrics.items()})
                loss.backward()
                if config.train.grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip)
                inner.step()  # DiLoCo's hooks run the fragment syncs inside this call
                schedule.step()
                inner.zero_grad(set_to_none=True)
                losses.append(loss.detach())
                reporter.beat(
                    state="training", round=round_index, rounds=dl.rounds, step=step + 1, steps=dl.sync_every,
                    loss=float(loss),
                )
            if manager.current_step() != round_index * dl.fragments:
                raise SyncError(f"round {round_index} did not commit: {manager.last_error}")
            row: dict[str, Any] = {
                "train_loss": float(torch.stack(losses).float().mean()),
                "train": mean_metrics(step_metrics),
                "lr": schedule.get_last_lr()[0],
                "bytes_up": manager.bytes_up,
                "bytes_down": manager.bytes_down,
                "round_s": time.monotonic() - started,
                "blocked_s": manager.blocked_s - blocked_before,
                "time": time.time(),
            }
            if dl.verify_global or evaluator:
                params = global_parameters(manager, names)
                if dl.verify_global:
                    row["global_sha256"] = digest(params)
                if evaluator and (round_index % config.eval.every_rounds == 0 or round_index == dl.rounds):
                    with swapped_in(model, params):
                        row["eval"] = objective.evaluate(model)
            reporter.round(round_index, row)
            logger.info("[replica %d] round %d/%d: train loss %.4f", rank, round_index, dl.rounds, row["train_loss"])

        if evaluator:
            with swapped_in(model, global_parameters(manager, names)), tempfile.TemporaryDirectory() as out:
                model.save_pretrained(out)
                tokenizer.save_pretrained(out)
                run.upload_dir(Path(out), FINAL_PREFIX)
    reporter.beat(
        force=True, state="done", round=dl.rounds, rounds=dl.rounds, step=dl.sync_every, steps=dl.sync_every,
        loss=row["train_loss"],
    )
