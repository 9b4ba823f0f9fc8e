"""Rollout engines side by side: tokens per second, time to first token and peak memory of each.

    python benchmarks/rollout_speed.py --out bench-out/rollout_speed.json [--device cuda] [--shape qwen2.5-0.5b]

One workload for every engine (``composer_serverless.objectives.engines``): ``--prompts`` prompts of
``--prompt-len`` random tokens, each completed ``--group`` times with up to ``--max-new-tokens`` tokens at
``--temperature``, by the model of ``--shape`` built from its config with random weights (bf16 on CUDA,
float32 on a CPU). Each engine runs in a fresh subprocess: it builds the model, completes the workload once to
warm up (a static cache compiles its decoder on CUDA here), then ``--calls`` times measured.

- ``tokens_per_s``: the completions' tokens (each up to its EOS) over the measured calls' wall time.
- ``first_token_s``: one call with ``max_new_tokens = 1``: prefill and one sampled token for every row.
- ``peak_bytes``: on CUDA ``max_memory_allocated`` during the measured calls minus the allocation before them;
  on a CPU the resident set's high-water mark minus the resident size before them.

With ``--ranks G``, a replica of G FSDP ranks (gloo on a CPU) also completes G times the workload, each rank its
own share, twice: from the whole weights gathered once (what the composer objective does) and from the shards
(``generate(synced_gpus=True)``: each layer gathered from every rank for every token, the ranks in lockstep).

Random weights rarely sample the EOS, so nearly every row runs to ``max_new_tokens``: the paged engine's gain
from rows that end early does not show here, only its shared prefill and its scheduling.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers
from process_memory import peak, run_worker, start_peak
from transformers import Qwen2Config, Qwen2ForCausalLM

from composer_serverless.objectives.engines import ENGINES, Request, make_engine

SHAPES = {
    "tiny": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    # A Qwen2-style 8 x 512 model with a 32k vocabulary (25M parameters): large enough on a CPU for the
    # gathering of weights across ranks to cost something, small enough to run there in minutes.
    "small": {
        "vocab_size": 32000,
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    # Qwen2.5-0.5B's shape (494M parameters), the anchor.
    "qwen2.5-0.5b": {
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
}
EOS = 1


def _model(shape: str, device: torch.device) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        **SHAPES[shape], max_position_embeddings=4096, eos_token_id=EOS, pad_token_id=0, bos_token_id=2
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()


def _worker(spec: dict) -> dict:
    """Build, warm up, measure one engine; in its own process so peaks are not shared."""
    device = torch.device(spec["device"])
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    model = _model(spec["shape"], device)
    engine = make_engine(spec["engine"], device, memory_share=0.5)
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (spec["prompts"], spec["prompt_len"]), generator=generator).tolist()
    request = Request(prompts, spec["group"], spec["max_new_tokens"], spec["temperature"], [EOS], 0)

    def timed(req: Request) -> tuple[float, int]:
        start = time.perf_counter()
        rows = engine.complete(model, req)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, sum(len(r) for r in rows)

    torch.manual_seed(2)
    timed(request)  # warm-up: compilation, the allocator's first blocks
    first_token_s, _ = timed(Request(prompts, spec["group"], 1, spec["temperature"], [EOS], 0))
    gc.collect()
    baseline = start_peak(device)
    seconds, tokens = 0.0, 0
    for _ in range(spec["calls"]):
        s, t = timed(request)
        seconds, tokens = seconds + s, tokens + t
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "first_token_s": first_token_s,
        "peak_bytes": peak(device, baseline),
        "params": sum(p.numel() for p in model.parameters()),
    }


def _sharded_worker(local_rank: int, spec: dict, rendezvous: str, out: str) -> None:
    """One of ``spec["ranks"]`` ranks of a replica sharded with FSDP2 (gloo on a CPU, NCCL on CUDA), each
    completing its own prompts: with the whole weights gathered once (``rollout.whole_weights``, what the
    composer objective does) and from the shards (``generate(synced_gpus=True)``: every layer gathered for
    every token, the ranks in lockstep)."""
    import torch.distributed as dist

    from composer_serverless.objectives.rollout import whole_weights
    from composer_serverless.replicas.shards import shard_model

    ranks = spec["ranks"]
    device = torch.device("cuda", local_rank) if spec["device"] == "cuda" else torch.device("cpu")
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=local_rank, world_size=ranks)
    model = _model(spec["shape"], device)
    shard_model(model, ranks, device)
    engine = make_engine(spec["engine"], device, memory_share=0.5)
    generator = torch.Generator().manual_seed(1 + local_rank)  # each rank its own prompts
    prompts = torch.randint(
        3, model.config.vocab_size, (spec["prompts"], spec["prompt_len"]), generator=generator
    )
    request = Request(prompts.tolist(), spec["group"], spec["max_new_tokens"], spec["temperature"], [EOS], 0)

    def gathered() -> int:
        with whole_weights(model):
            return sum(len(r) for r in engine.complete(model, request))

    def sharded() -> int:
        ids = prompts.to(device).repeat_interleave(spec["group"], dim=0)
        with torch.no_grad():
            generated = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=spec["max_new_tokens"],
                do_sample=True,
                temperature=spec["temperature"],
                top_k=0,
                top_p=1.0,
                eos_token_id=[EOS],
                pad_token_id=0,
                synced_gpus=True,
                cache_implementation="dynamic",
                disable_compile=True,
            )
        rows = generated[:, ids.size(1) :].tolist()
        return sum(len(r[: r.index(EOS) + 1] if EOS in r else r) for r in rows)

    results = {}
    for mode, run in (("gathered", gathered), ("sharded", sharded)):
        run()  # warm-up
        dist.barrier()
        baseline = start_peak(device)
        start = time.perf_counter()
        tokens = run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()  # the replica's rollouts are done when its slowest rank is
        seconds = time.perf_counter() - start
        total = torch.tensor([float(tokens), float(peak(device, baseline))])
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        results[mode] = {
            "tokens": int(total[0]),
            "seconds": seconds,
            "tokens_per_s": float(total[0]) / seconds,
            "peak_bytes_per_rank": float(total[1]) / ranks,
        }
    if local_rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _measure_sharded(spec: dict) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sharded.json"
        mp.start_processes(
            _sharded_worker,
            args=(spec, str(Path(tmp) / "rendezvous"), str(out)),
            nprocs=spec["ranks"],
            join=True,
            start_method="spawn",
        )
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where to write the JSON")
    parser.add_argument("--device", default="cpu", help="cpu (float32) or cuda (bfloat16)")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {ENGINES}")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--calls", type=int, default=2, help="measured calls after one warm-up call")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--ranks",
        type=int,
        default=0,
        help="also measure a replica of this many FSDP ranks generating from gathered weights and from the "
        "shards, each rank its own --prompts (0: not)",
    )
    parser.add_argument(
        "--sharded-engine", default="reference", help="the engine the gathered mode runs with --ranks"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    if args.out is None:
        parser.error("--out is required")
    engines = args.engines.split(",")
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}: choose from {ENGINES}")
    spec = {
        "device": args.device,
        "shape": args.shape,
        "prompts": args.prompts,
        "group": args.group,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "calls": args.calls,
        "threads": args.threads,
    }
    results = {}
    for name in engines:
        print(f"{name} ...", file=sys.stderr, flush=True)
        results[name] = run_worker(__file__, {**spec, "engine": name})
        print(f"{name}: {results[name]['tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
    sharded = None
    if args.ranks > 1:
        print(f"{args.ranks} FSDP ranks, gathered and sharded ...", file=sys.stderr, flush=True)
        sharded = _measure_sharded({**spec, "ranks": args.ranks, "engine": args.sharded_engine})
    reference = results.get("reference")
    report = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "workload": spec,
        "engines": results,
        "speedup_vs_reference": {
            name: r["tokens_per_s"] / reference["tokens_per_s"] for name, r in results.items()
        }
        if reference
        else {},
    }
    if sharded is not None:
        report["fsdp_generation"] = {
            "ranks": args.ranks,
            "engine": args.sharded_engine,
            **sharded,
            "gathered_vs_sharded": sharded["gathered"]["tokens_per_s"] / sharded["sharded"]["tokens_per_s"],
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["speedup_vs_reference"], indent=2))


if __name__ == "__main__":
    main()
