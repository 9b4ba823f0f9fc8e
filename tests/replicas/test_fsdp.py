"""Replicas of several ranks: FSDP2 inside a replica (CPU processes over gloo), DiLoCo across replicas.

Run through the real launcher and worker: each replica is a process that starts its ranks.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from composer_serverless.config import validate_config
from composer_serverless.launch.launcher import launch
from composer_serverless.outputs.export import export
from composer_serverless.rendezvous.checkpoint import read_snapshot
from composer_serverless.rendezvous.codec import read_header
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_metrics
from tests.conftest import TINY, ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator


def _config(
    store: Path,
    run_id: str,
    model_dir: Path,
    ranks: int,
    micro: int | None = None,
    codec: str = "fp32",
    **model: Any,
) -> Any:
    return validate_config(
        {
            "run_id": run_id,
            "store": str(store),
            "model": {"path": str(model_dir), **model},
            "data": {"seq_len": 16, "batch_size": 4},
            "train": {"lr": 1e-2, "warmup_steps": 2, "schedule": "cosine", "micro_batch_size": micro},
            "diloco": {
                "replicas": 2,
                "sync_every": 4,
                "rounds": 3,
                "fragments": 2,
                "fragment_sync_delay": 1,
                "fragment_update_alpha": 0.5,
                "codec": codec,
                "checkpoint_every": 1,
                "min_replicas": 2,
            },
            "eval": {"sequences": 4},
            "executor": {"threads_per_replica": 1, "ranks_per_replica": ranks},
        }
    )


def _row_bits(store: Path, run_id: str, local: int) -> int:
    """The row bits (``rendezvous/rows.py``) replica 0's inputs of local rank ``local`` carried in round 3's
    fragment 0 (the embedding's): over its shards, a bit per step bucket of each of the rank's rows of the
    embedding, one shared row counted twice where a shard boundary cuts it."""
    inputs = sorted((store / run_id / "rounds" / "3" / "0" / str(local) / "in").glob("0-*"))
    assert inputs
    return sum(int(read_header(p.read_bytes())[0]["__metadata__"].get("rows", 0)) for p in inputs)


def _final(store: Path, run_id: str, lora: bool) -> dict[str, torch.Tensor]:
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    return load_file(store / run_id / "final" / name)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_ranks_per_replica_end_where_one_rank_does(
    tmp_path: Path, tiny_model_dir: Path, lora: bool
) -> None:
    """2 replicas x 2 FSDP ranks and 2 replicas x 1 rank, on the same global batch, in fp32, after 3 rounds
    (two fragments, overlap, alpha): the same global parameters to 1e-5, and the same held-out loss. With LoRA,
    the same adapters (the frozen base sharded with them), which export merges. A full fine-tune also in
    micro-batches of one row per rank (two per step, accumulated), to the same parameters."""
    model = {"lora": {"r": 4}} if lora else {}
    runs = {"g1": (1, None), "g2": (2, None), **({} if lora else {"g2m1": (2, 1)})}
    for run_id, (ranks, micro) in runs.items():
        summary = launch(
            _config(tmp_path, run_id, tiny_model_dir, ranks, micro, **model),
            "fsdp",
            Console(file=io.StringIO()),
        )
        assert summary["rounds_committed"] == 3 and summary["replicas_bit_identical"], summary
    one = _final(tmp_path, "g1", lora)
    for run_id in runs.keys() - {"g1"}:
        other = _final(tmp_path, run_id, lora)
        assert one.keys() == other.keys()
        worst = max(float((one[k] - other[k]).abs().max()) for k in one)
        assert worst <= 1e-5, (run_id, worst)
    if not lora:  # the runs trained: agreeing to 1e-5 is not agreeing on the initial weights
        start = load_file(tiny_model_dir / "model.safetensors")
        assert max(float((one[k] - start[k]).abs().max()) for k in one) > 1e-2
        # The last round rebuilt from the 2-rank replica's checkpoint (each rank's shards joined) is final/.
        export(str(tmp_path / "g2"), tmp_path / "g2-round-3", round_index=3)
        rebuilt, final = (
            load_file(tmp_path / "g2-round-3" / "model.safetensors"),
            _final(tmp_path, "g2", lora),
        )
        assert rebuilt.keys() == final.keys() and all(torch.equal(rebuilt[k], final[k]) for k in final)
    # The embedding's rows were averaged over the replicas that trained them, each rank sending the bits of
    # the rows it holds (the tied embedding of 400 tokens, split by rows over two ranks); LoRA's embedding is
    # frozen and not exchanged.
    # A bit per row and step bucket: sync_every = 4 buckets.
    vocab, buckets = TINY.vocab_size, 4
    if lora:
        assert _row_bits(tmp_path, "g1", 0) == _row_bits(tmp_path, "g2", 1) == 0
    else:
        assert _row_bits(tmp_path, "g1", 0) in (vocab * buckets, (vocab + 1) * buckets)
        assert all(
            _row_bits(tmp_path, "g2", local) in (vocab // 2 * buckets, (vocab // 2 + 1) * buckets)
            for local in (0, 1)
        )
    rows = {
        g: {row["round"]: row for row in read_metrics(ObjectStore(str(tmp_path / f"g{g}")))[0]}
        for g in (1, 2)
    }
    for round_index in range(1, 4):
        losses = [rows[g][round_index]["eval"]["eval/loss"] for g in (1, 2)]
        assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    assert rows[2][3]["eval"]["eval/loss"] < rows[2][0]["eval"]["eval/loss"]
    # Each rank moves its own shards: half the replica's bytes each.
    for row in (rows[2][k] for k in range(1, 4)):
        for key in ("bytes_up", "bytes_down"):
            per_rank = row[f"{key}_per_rank"]
            assert sum(per_rank) == row[key]
            assert all(abs(b / row[key] - 1 / 2) <= 0.05 for b in per_rank), (key, per_rank)
    if lora:
        out = tmp_path / "merged"
        export(str(tmp_path / "g2"), out)
        merged = AutoModelForCausalLM.from_pretrained(out)
        assert not any("lora" in name for name, _ in merged.named_parameters())


@pytest.mark.slow
def test_bf16_over_float32_masters_on_two_ranks(tmp_path: Path, tiny_model_dir: Path) -> None:
    """bf16 compute over float32 masters, sharded, on the accelerator's path (each rank on a device, FSDP2
    casting each gathered layer), with the sparse codec: replicas stay bit-identical, the held-out loss falls,
    and each rank keeps the error-feedback residual of its own part of each fragment, in its own state."""
    with replicas_on_the_simulated_accelerator():
        summary = launch(
            _config(tmp_path, "bf16", tiny_model_dir, 2, codec="sparse", dtype="bfloat16"),
            "fsdp",
            Console(file=io.StringIO()),
        )
    assert ran_on_the_simulated_accelerator(tmp_path / "bf16" / "logs")
    assert summary["rounds_committed"] == 3 and summary["replicas_bit_identical"], summary
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    final = load_file(tmp_path / "bf16" / "final" / "model.safetensors")
    assert {t.dtype for t in final.values()} == {torch.float32}  # the masters are what is exported
    parameters = sum(t.numel() for t in final.values())
    run = ObjectStore(str(tmp_path / "bf16"))
    residuals = [read_snapshot(run, "replicas/0/3/" + str(local))["residual"] for local in (0, 1)]
    # Two fragments per rank, each the rank's part of its bucket: together, every trained value once; and
    # each rank's part of each fragment's shard it owns.
    assert all(sorted(r) == ["0/inputs", "0/owned", "1/inputs", "1/owned"] for r in residuals), residuals
    assert sum(r[f"{f}/inputs"].numel() for r in residuals for f in (0, 1)) == parameters
    assert all(t.dtype == torch.float32 and bool(t.abs().sum() > 0) for r in residuals for t in r.values())
    header = read_header((tmp_path / "bf16" / "rounds" / "3" / "0" / "1" / "in" / "0-1").read_bytes())[0]
    assert header["__metadata__"]["codec"] == "sparse"


def _bf16_weights_alive_after_forward(local_rank: int, rendezvous: str, with_policy: bool, out: str) -> None:
    """One of 2 gloo ranks: shard a tiny Llama as the replica does (bf16 over float32 masters), run a
    forward in the replica's compute context, and count the decoder layers' weights of which a whole
    (unsharded) bf16 copy is still in memory when the forward ends, before the backward. Autocast, as the
    replica computed before FSDP2's mixed-precision policy, when ``with_policy`` is false."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from composer_serverless.config import ModelConfig
    from composer_serverless.replicas import precision
    from composer_serverless.replicas.shards import decoder_layers, shard_model

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=local_rank, world_size=2)
    torch.manual_seed(0)
    # A vocabulary unlike any layer weight's shape: the root's embedding and head stay gathered after the
    # forward by FSDP's design (the backward needs them first) and are not what is counted here.
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    model = LlamaForCausalLM(config).train()
    shapes = {tuple(p.shape) for layer in decoder_layers(model) for p in layer.parameters() if p.dim() == 2}
    weights = sum(p.dim() == 2 for layer in decoder_layers(model) for p in layer.parameters())
    spec = ModelConfig(tiny={}, dtype="bfloat16")
    shard_model(model, 2, torch.device("cpu"), precision.compute_dtype(spec) if with_policy else None)
    saved: list[torch.UntypedStorage] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes:
            saved.append(t.untyped_storage())
        return t

    ids = torch.randint(0, 96, (2, 8))
    with precision.compute(spec, torch.device("cpu"), sharded=with_policy):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        # FSDP frees a gathered layer by emptying its storage; a cast autocast made keeps its own.
        alive = len({s.data_ptr() for s in saved if s.nbytes() > 0})
    loss.backward()
    if local_rank == 0:
        Path(out).write_text(json.dumps({"alive": alive, "weights": weights}))
    # Neither rank tears gloo down while the other may still be in a collective (under load, a rank that
    # destroyed its group first aborted the other with "terminate called without an active exception"), and
    # neither runs gloo's destructors at all: a full suite under load still saw that abort once, after the
    # barrier. Everything this rank had to do is done; its exit status is all the parent reads.
    dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("with_policy", [False, True], ids=["autocast", "fsdp-policy"])
def test_no_whole_bf16_weight_is_alive_after_a_sharded_forward(tmp_path: Path, with_policy: bool) -> None:
    """With 2 FSDP ranks over gloo and bf16 over float32 masters: FSDP2's mixed-precision policy leaves no
    whole bf16 copy of a layer's weight after the forward, where autocast's weight cache kept one of every
    weight (the count below is of distinct storages, so the autocast case shows the check can fail)."""
    import torch.multiprocessing as mp

    out = tmp_path / "count.json"
    mp.start_processes(
        _bf16_weights_alive_after_forward,
        args=(str(tmp_path / "rendezvous"), with_policy, str(out)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    counted = json.loads(out.read_text())
    assert counted["alive"] == (0 if with_policy else counted["weights"]), counted


def _samples_on_rank(local_rank: int, rendezvous: str, out: str) -> None:
    """One of replica 1's 2 gloo ranks: seeded as the trainer seeds it, each engine that draws from the
    process's RNG samples the same request; the rows go to ``out``-``local_rank``."""
    import torch.distributed as dist

    from composer_serverless.objectives.engines import GenerateEngine, Request
    from composer_serverless.replicas.node import Node, training_seed
    from tests.replicas.test_engines import EOS, PROMPT, _small_model

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=local_rank, world_size=2)
    node = Node(local_rank, 2, dist.group.WORLD)
    model = _small_model()  # the same weights on both ranks, as loading gives them
    request = Request([PROMPT], 16, 2, 1.0, [EOS], 0)
    rows = {}
    for engine in (GenerateEngine(static=False), GenerateEngine(static=True)):
        torch.manual_seed(training_seed(0, 1, node))
        rows[engine.name] = engine.complete(model, request)
    Path(f"{out}-{local_rank}").write_text(json.dumps({"seed": training_seed(0, 1, node), "rows": rows}))
    dist.barrier()  # as in _bf16_weights_alive_after_forward: no teardown, the exit status is what counts
    os._exit(0)


def test_the_ranks_of_one_replica_draw_different_samples(tmp_path: Path) -> None:
    """Replica 1 of a run with seed 0 and 2 ranks per replica: its ranks are seeded 0 + 1 * 2 + local rank,
    so the reference and static engines sample the same request differently on each rank, and each rank's
    rows are those of a process seeded with its seed alone (deterministic)."""
    import torch.multiprocessing as mp

    from composer_serverless.objectives.engines import GenerateEngine, Request
    from tests.replicas.test_engines import EOS, PROMPT, _small_model

    out = tmp_path / "rows"
    mp.start_processes(
        _samples_on_rank,
        args=(str(tmp_path / "rendezvous"), str(out)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    ranks = [json.loads(Path(f"{out}-{r}").read_text()) for r in (0, 1)]
    assert [r["seed"] for r in ranks] == [2, 3]
    model = _small_model()
    request = Request([PROMPT], 16, 2, 1.0, [EOS], 0)
    for name, static in (("reference", False), ("static", True)):
        assert ranks[0]["rows"][name] != ranks[1]["rows"][name], name
        for rank in ranks:
            torch.manual_seed(rank["seed"])
            assert GenerateEngine(static=static).complete(model, request) == rank["rows"][name]
