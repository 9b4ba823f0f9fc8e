"""Bytes one decoupled merge moves through the syncer, against lock-step's exchange, and when one syncer's link
is the bottleneck (issue 49).

    python benchmarks/syncer_bytes.py --learners 2 4 8 --mb 16 --codec fp32 --out docs/results/syncer-bytes
    python benchmarks/syncer_bytes.py --learners 8 --shards 1 2 4 8 --out docs/results/syncer-bytes

For each N: N learners' contributions of a ``--mb`` MiB fp32 model are published through the product's
``rendezvous/decoupled.publish`` into a local store, the product's ``Syncer`` merges them (one version), and
the bytes are the sizes of the objects each side reads or writes whole: a learner uploads its contribution
and downloads the new version's parameters (manifest, state, tensors); the syncer downloads every
contribution and uploads the version (parameters and its outer momentum) and its record. Lock-step's replica
per round is the object-store all-reduce's traffic for the same encoded size S: (1 + 1/N) S up (its input
and its reduced shard) and 2 (N - 1) / N S down, which ``benchmarks/allreduce.py`` measured within 0.0004 %
(docs/results/allreduce/n4-64mb-file-fp32.json, ``ratio_to_bound``).

The JSON's ``per_param`` gives each figure in bytes per model parameter, and ``at_scale`` extrapolates them
to ``--scale-params`` parameters (default 8e9) and each ``--link-gbps``: the seconds one merge keeps the
syncer's link busy, against the seconds a learner's (and a lock-step replica's) own round of transfers
takes. The syncer is the bottleneck when its seconds per merge exceed the learners' round time divided by
the merges per round (one with a quorum of every learner).

With ``--shards`` (``diloco.decoupled.syncer_shards``), each F measures one merge by F syncer shards (in this
process, one after another: shard 0's plan, the others' parts, shard 0's record), each shard's bytes counted
apart; the syncer's figures are then its busiest shard's, the link that sets a merge's time, and
``per_shard`` lists every shard's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from composer_serverless.config import validate_config
from composer_serverless.rendezvous import decoupled as versions
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.decoupled import Contribution, Version
from composer_serverless.rendezvous.fragments import fragment_groups
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import Reporter
from composer_serverless.syncer.syncer import Syncer

TENSORS = 16  # the model's parameters are cut into this many named tensors (at most this many shards)


def prefix_bytes(store: ObjectStore, prefix: str) -> int:
    return sum(store.size(f"{prefix}/{key}") for key in store.list_tree(prefix))


def measure(root: Path, learners: int, mb: float, codec: str, seed: int, shards: int = 1) -> dict[str, Any]:
    """One merge of ``learners`` contributions of an ``mb`` MiB model by ``shards`` syncer shards: the bytes
    each side moves."""
    numel = int(mb * 2**20) // 4 // TENSORS * TENSORS
    raw = {
        "run_id": f"n{learners}-f{shards}",
        "store": str(root),
        "model": {"path": "."},
        "diloco": {
            "replicas": learners,
            "rounds": 1,
            "sync_every": 4,
            "mode": "decoupled",
            "embedding_average": "all",
            "codec": codec,
            "outlier_norm_factor": None,
            "decoupled": {"syncer_shards": shards},
        },
    }
    config = validate_config(raw)
    run = ObjectStore(str(root)).child(config.run_id or "")
    run.put(layout.RUN_CONFIG, config.resolved_json().encode())
    gen = torch.Generator().manual_seed(seed)
    initial = {f"t{i}": torch.randn(numel // TENSORS, generator=gen) for i in range(TENSORS)}
    sizes = [(name, t.numel()) for name, t in initial.items()]
    groups = fragment_groups(sizes, shards) if shards > 1 else []
    assert versions.commit(run, Version(0, "initial", fragments=groups), initial, None, None)
    learner_up = []
    for learner in range(learners):
        values = torch.randn(numel, generator=gen) * 1e-3
        contribution = Contribution(learner, 0, 0, tokens=1000, steps=10)
        if shards == 1:
            learner_up.append(versions.publish(run, config.run_id or "", contribution, values, codec, None))
        else:
            parts = [(piece, None) for piece in values.split([len(g) * (numel // TENSORS) for g in groups])]
            learner_up.append(
                versions.publish_parts(run, config.run_id or "", contribution, parts, codec, None)
            )
    syncers = [Syncer(run, config, None, Reporter(run, learners + k), shard=k) for k in range(shards)]
    for syncer in syncers:
        syncer._load(0)
    start = time.perf_counter()
    if shards == 1:
        syncers[0]._merge(syncers[0]._gather())
    else:
        plan = syncers[0]._plan()
        for syncer in syncers[1:]:
            syncer._merge_part(plan)
        syncers[0]._merge_plan(plan)
    merge_s = time.perf_counter() - start
    record = versions.read_version(run, 1)
    record_bytes = run.size(layout.version(1))
    per_shard = []
    for k, writer in enumerate(record.writers):
        params = prefix_bytes(run, layout.global_params(1, writer))
        outer = prefix_bytes(run, layout.syncer_state(1, writer))
        down = sum(run.size(layout.contribution(learner, 0)) for learner in range(learners))  # the headers
        if shards > 1:  # and its fragment of each
            attempts = {
                learner: next(n for n in run.list(layout.contributions(learner)) if n.endswith(f"-{k}"))
                for learner in range(learners)
            }
            down += sum(run.size(f"{layout.contributions(ln)}/{name}") for ln, name in attempts.items())
        # shard 0 also writes the plan and the record (k > 0: its part's record, and reads the plan)
        small = run.size(layout.version_plan(1)) + record_bytes if shards > 1 else record_bytes
        if k > 0:
            small = run.size(layout.version_part(1, k)) + run.size(layout.version_plan(1))
        per_shard.append({"shard": k, "down_bytes": down, "up_bytes": params + outer + small})
    busiest = max(per_shard, key=lambda b: max(b["down_bytes"], b["up_bytes"]))
    version_params = sum(prefix_bytes(run, layout.global_params(1, w)) for w in record.writers)
    wire = max(learner_up)  # S: one learner's encoded model
    return {
        "learners": learners,
        "shards": shards,
        "params": numel,
        "codec": codec,
        "learner_up_bytes": wire,
        "learner_down_bytes": version_params + record_bytes,
        "syncer_down_bytes": busiest["down_bytes"],
        "syncer_up_bytes": busiest["up_bytes"],
        "per_shard": per_shard,
        "lockstep_up_bytes": wire * (1 + 1 / learners),
        "lockstep_down_bytes": wire * 2 * (learners - 1) / learners,
        "merge_cpu_s": merge_s,
    }


def at_scale(m: dict[str, Any], scale_params: float, link_gbps: list[float]) -> dict[str, Any]:
    """``m``'s figures per parameter, times ``scale_params``; link seconds per merge (syncer) and per round
    (a learner, a lock-step replica) at each speed, a link carrying both directions at once (full duplex):
    the busier direction sets the time."""
    per = {k.removesuffix("_bytes"): v / m["params"] for k, v in m.items() if k.endswith("_bytes")}
    gb = {k: v * scale_params / 1e9 for k, v in per.items()}
    links = {}
    for gbps in link_gbps:
        rate = gbps / 8  # GB/s
        links[f"{gbps:g}Gbps"] = {
            "syncer_s_per_merge": max(gb["syncer_down"], gb["syncer_up"]) / rate,
            "learner_s_per_round": max(gb["learner_down"], gb["learner_up"]) / rate,
            "lockstep_replica_s_per_round": max(gb["lockstep_down"], gb["lockstep_up"]) / rate,
        }
    return {"bytes_per_param": per, "GB": gb, "links": links}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--learners", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--mb", type=float, default=16.0, help="the model's size in fp32, MiB")
    parser.add_argument("--codec", default="fp32", choices=["fp32", "bf16", "int8"])
    parser.add_argument("--scale-params", type=float, default=8e9)
    parser.add_argument("--link-gbps", type=float, nargs="+", default=[10.0, 25.0, 100.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shards", type=int, nargs="+", default=[1], help="syncer shards (diloco.decoupled.syncer_shards)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n, shards in [(n, f) for n in args.learners for f in args.shards]:
        m = measure(args.out / "runs" / args.codec, n, args.mb, args.codec, args.seed, shards)
        m["ratio_syncer_to_learner"] = (m["syncer_down_bytes"] + m["syncer_up_bytes"]) / (
            m["learner_down_bytes"] + m["learner_up_bytes"]
        )
        m["ratio_syncer_to_lockstep_replica"] = (m["syncer_down_bytes"] + m["syncer_up_bytes"]) / (
            m["lockstep_down_bytes"] + m["lockstep_up_bytes"]
        )
        m["at_scale"] = at_scale(m, args.scale_params, args.link_gbps)
        rows.append(m)
    result = {"mb": args.mb, "codec": args.codec, "scale_params": args.scale_params, "merges": rows}
    name = args.codec if args.shards == [1] else f"{args.codec}-shards"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    for m in rows:
        links = m["at_scale"]["links"]
        print(
            f"N={m['learners']} F={m['shards']} {args.codec}: (busiest) syncer/learner bytes {m['ratio_syncer_to_learner']:.2f}x, "
            f"syncer/lock-step replica {m['ratio_syncer_to_lockstep_replica']:.2f}x; at "
            f"{args.scale_params:.0e} params: "
            + ", ".join(
                f"{k}: syncer {v['syncer_s_per_merge']:.0f} s/merge, learner {v['learner_s_per_round']:.0f} s, "
                f"lock-step {v['lockstep_replica_s_per_round']:.0f} s"
                for k, v in links.items()
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
