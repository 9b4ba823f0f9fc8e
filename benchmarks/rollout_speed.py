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

Random weights rarely sample the EOS, so nearly every row runs to ``max_new_tokens``: the paged engine's gain
from rows that end early does not show here, only its shared prefill and its scheduling.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from process_memory import hwm_bytes, reset_hwm, rss_bytes
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
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        reset_hwm()  # first, so the mark cannot fall below the baseline read next
        baseline = rss_bytes()
    seconds, tokens = 0.0, 0
    for _ in range(spec["calls"]):
        s, t = timed(request)
        seconds, tokens = seconds + s, tokens + t
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else hwm_bytes()
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "first_token_s": first_token_s,
        "peak_bytes": peak - baseline,
        "params": sum(p.numel() for p in model.parameters()),
    }


def _measure(spec: dict) -> dict:
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)},
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"worker {spec} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


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
        results[name] = _measure({**spec, "engine": name})
        print(f"{name}: {results[name]['tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["speedup_vs_reference"], indent=2))


if __name__ == "__main__":
    main()
