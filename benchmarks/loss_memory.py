"""Peak memory and time of one training step: plain causal-LM cross-entropy vs the three-channel loss.

    python benchmarks/loss_memory.py --out bench-out/loss_memory.json [--device cuda] [--threads 1]

Both steps train the same number of sequences of the same length (`--batch` x `--seq-len` tokens with gradient):

- ce: `model(input_ids, labels=input_ids).loss`, the full-logits cross-entropy transformers computes;
- composer: `three_channel_loss` with every channel active: batch/2 GRPO rollouts (groups of 2; a quarter of each
  sequence is prompt) with a k3 KL term, their batch/2 hinted teacher sequences (no gradient), and batch/4 DPO
  pairs (chosen and rejected: batch/2 sequences).

A step is zero_grad, forward, backward and a plain SGD update. Each (model size, loss) runs in a fresh
subprocess: build the model, run one warm-up step, drop the gradients, then measure the next `--steps` steps.
Memory on CPU is the peak resident set size during the measured steps (VmHWM, reset just before them through
/proc/self/clear_refs) minus the resident size right before them; glibc is told to serve every allocation above
64 KiB with mmap so that freed tensors leave the resident set at once instead of lingering in malloc's heap. On
CUDA it is `torch.cuda.max_memory_allocated()` minus the allocated memory right before the measured steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import transformers
from process_memory import MMAP_THRESHOLD, peak, run_worker, start_peak
from transformers import LlamaConfig, LlamaForCausalLM

from composer_serverless.losses.batches import HintBatch, LossBatch, ReplayBatch, RLBatch
from composer_serverless.losses.compose import LossSettings, three_channel_loss
from composer_serverless.losses.grpo import GRPOSettings, group_advantages
from composer_serverless.losses.sdpo import SDPOSettings

SIZES = {
    "tiny": {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    # GPT-2-small-like Llama: 12 x 768, tied embeddings, 32k vocabulary: 110M parameters.
    "100m": {
        "vocab_size": 32000,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "tie_word_embeddings": True,
    },
}
HINT_TOKENS = 32


def _model(size: str, seq_len: int, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], max_position_embeddings=seq_len + HINT_TOKENS)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).train()


def _composer_batch(batch: int, seq_len: int, vocab: int, device: torch.device) -> LossBatch:
    g = torch.Generator().manual_seed(1)

    def ids(rows: int, length: int) -> torch.Tensor:
        return torch.randint(0, vocab, (rows, length), generator=g).to(device)

    def ones(rows: int, length: int) -> torch.Tensor:
        return torch.ones(rows, length, dtype=torch.long, device=device)

    # A random model puts about log(vocab) nats on every token; references near that keep the KL and DPO terms
    # at the size they have early in training.
    uniform = -math.log(vocab)
    prompt_len = seq_len // 4
    completion_len = seq_len - prompt_len
    rollouts, pairs = batch // 2, batch // 4
    rewards = torch.tensor([1.0, 0.0] * (rollouts // 2))
    rl = RLBatch(
        prompt_ids=ids(rollouts, prompt_len),
        prompt_mask=ones(rollouts, prompt_len),
        completion_ids=ids(rollouts, completion_len),
        completion_mask=ones(rollouts, completion_len),
        advantages=group_advantages(rewards, 2).to(device),
        ref_logps=(uniform + 0.1 * torch.randn(rollouts, completion_len, generator=g)).to(device),
    )
    hinted = ids(rollouts, prompt_len + HINT_TOKENS)
    hint = HintBatch.from_hinted_prompts(hinted, torch.ones_like(hinted), rl)
    replay = ReplayBatch(
        prompt_ids=ids(pairs, prompt_len),
        prompt_mask=ones(pairs, prompt_len),
        chosen_ids=ids(pairs, completion_len),
        chosen_mask=ones(pairs, completion_len),
        rejected_ids=ids(pairs, completion_len),
        rejected_mask=ones(pairs, completion_len),
        ref_chosen_logps=torch.full((pairs,), uniform * completion_len, device=device),
        ref_rejected_logps=torch.full((pairs,), uniform * completion_len, device=device),
    )
    return LossBatch(rl=rl, hint=hint, replay=replay)


def _worker(spec: dict) -> dict:
    """Build, warm up, measure; runs in its own process so peaks are not shared."""
    device = torch.device(spec["device"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    model = _model(spec["size"], spec["seq_len"], device, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    if spec["loss"] == "ce":
        tokens = torch.randint(
            0, vocab, (spec["batch"], spec["seq_len"]), generator=torch.Generator().manual_seed(1)
        )
        tokens = tokens.to(device)

        def loss_fn() -> torch.Tensor:
            return model(input_ids=tokens, labels=tokens).loss
    else:
        batch = _composer_batch(spec["batch"], spec["seq_len"], vocab, device)
        settings = LossSettings(
            alpha=0.5,
            beta=0.5,
            grpo=GRPOSettings(loss_type="dapo", eps_high=0.28, kl_beta=0.04),
            sdpo=SDPOSettings(beta=0.5, top_k=spec["top_k"]),
            chunk_tokens=spec["chunk_tokens"],
        )

        def loss_fn() -> torch.Tensor:
            return three_channel_loss(model, batch, settings)[0]

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        return loss.item()

    step()
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    baseline = start_peak(device)
    start = time.perf_counter()
    losses = [step() for _ in range(spec["steps"])]
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / spec["steps"]
    return {
        "peak_bytes": peak(device, baseline),
        "step_s": seconds,
        "loss": losses[-1],
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": vocab,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where to write the JSON")
    parser.add_argument("--device", default="cpu", help="cpu (float32) or cuda (bfloat16)")
    parser.add_argument("--sizes", default="tiny,100m", help=f"comma-separated, from {sorted(SIZES)}")
    parser.add_argument(
        "--batch", type=int, default=4, help="sequences with gradient per step (multiple of 4)"
    )
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1, help="measured steps after one warm-up step")
    parser.add_argument("--chunk-tokens", type=int, default=LossSettings().chunk_tokens)
    parser.add_argument(
        "--top-k", type=int, default=None, help="SDPO teacher top-k (default: full vocabulary)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    if args.out is None:
        parser.error("--out is required")
    if args.batch % 4:
        parser.error("--batch must be a multiple of 4 (GRPO groups of 2 and DPO pairs)")

    results = {}
    for size in args.sizes.split(","):
        spec = {
            "size": size,
            "device": args.device,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "steps": args.steps,
            "chunk_tokens": args.chunk_tokens,
            "top_k": args.top_k,
            "threads": args.threads,
        }
        ce, composer = (
            run_worker(__file__, {**spec, "loss": "ce"}),
            run_worker(__file__, {**spec, "loss": "composer"}),
        )
        results[size] = {
            "params": ce["params"],
            "vocab": ce["vocab"],
            "full_logits_bytes_fp32": args.batch * args.seq_len * ce["vocab"] * 4,
            "ce_peak_bytes": ce["peak_bytes"],
            "composer_peak_bytes": composer["peak_bytes"],
            "peak_ratio": composer["peak_bytes"] / ce["peak_bytes"],
            "ce_step_s": ce["step_s"],
            "composer_step_s": composer["step_s"],
            "ce_loss": ce["loss"],
            "composer_loss": composer["loss"],
        }
        print(f"{size}: {json.dumps(results[size])}", file=sys.stderr)

    report = {
        "device": args.device,
        "dtype": "bfloat16" if args.device.startswith("cuda") else "float32",
        "memory_method": (
            "torch.cuda.max_memory_allocated() - memory_allocated() before the measured steps"
            if args.device.startswith("cuda")
            else "peak RSS (VmHWM reset via /proc/self/clear_refs) - RSS before the measured steps; fresh "
            f"subprocess per measurement; MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}"
        ),
        "step": "zero_grad + forward + backward + SGD update; one warm-up step, then the mean of the measured steps",
        "batch": {
            "sequences_with_grad": args.batch,
            "seq_len": args.seq_len,
            "ce": f"{args.batch} x {args.seq_len} tokens",
            "composer": (
                f"{args.batch // 2} GRPO rollouts ({args.seq_len // 4} prompt + {args.seq_len - args.seq_len // 4} "
                f"completion tokens, k3 KL), {args.batch // 2} hinted teacher sequences (+{HINT_TOKENS} tokens, "
                f"no grad), {args.batch // 4} DPO pair(s); alpha = beta = 0.5; chunk_tokens = {args.chunk_tokens}; "
                f"SDPO top_k = {args.top_k}"
            ),
        },
        "threads": args.threads or torch.get_num_threads(),
        "steps_measured": args.steps,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
