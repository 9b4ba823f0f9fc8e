"""Does a slow tool stall the batch? Episode wall time with a tool that sleeps, against generation time alone.

    python benchmarks/tool_latency.py --out docs/results/tool_latency/results.json [--device cuda]

One batch of ``--episodes`` episodes, each making ``--calls`` tool calls (one per turn) and then answering,
through the rollout's own path (``objectives.episode_rollout.run_step_episodes``: resets, the prompt rendered
with the tools' schemas, the episode loop running every episode's tool call of a turn concurrently, tool turns
rendered with the chat template). Twice per repeat, alternating: with the tool sleeping ``--sleep-s`` seconds,
and with an instant tool. The issue's bar: ``ratio = slow wall / (generation + calls x sleep) <= 1.3``, where
generation is the time the engine spends generating in the instant-tool batch (medians over the repeats);
``paired_ratio`` holds each slow batch to its own generation time instead. A loop that answered the calls
one episode at a time (TRL's blocking loop) would take about generation + episodes x calls x sleep.

What is real: the model (a tiny Llama with random weights, from ``models.loading.build_tiny``, loaded with
``from_pretrained``), the engine (``make_engine``, the one a rollout picks on the device: reference on a CPU,
paged on a GPU), which generates up to ``--turn-tokens`` tokens (to a sampled EOS) for every live episode
each turn from its whole trajectory so far, the episode loop, the threads and the sleeping tool. What is scripted: the tokens each turn
*keeps*. A random model writes no tool call, so the engine's wrapper (``ForcedToolCalls``) times the real
generation and then hands the loop fixed turns instead (a ``<tool_call>`` for the first ``--calls`` turns, then
an answer), which the next turn's prefill then reads. The tokenizer is the package's character tokenizer (``char_tokenizer``)
with a ChatML template that renders tools and tool turns.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from composer_serverless.config.model import TinyModelConfig
from composer_serverless.data.records import PromptRecord
from composer_serverless.environments.episodes import Limits
from composer_serverless.environments.tools import EnvironmentFactory
from composer_serverless.models.loading import build_tiny
from composer_serverless.objectives.engines import Request, RolloutEngine, make_engine
from composer_serverless.objectives.episode_rollout import EpisodeSettings, run_step_episodes

# ChatML that lists the tools' schemas in a system turn and renders tool turns, as Hermes-style templates do.
TOOL_CHATML = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def sleeping_tool(sleep_s: float) -> Callable[[int], str]:
    """The tool: looks a step up after ``sleep_s`` seconds (a search, a build, a test run)."""

    def lookup(step: int) -> str:
        """Look up the value of a step.

        Args:
            step: the step to look up
        """
        if sleep_s:
            time.sleep(sleep_s)
        return f"value {step}"

    return lookup


class ForcedToolCalls:
    """A rollout engine that generates with the real one, timed, and keeps scripted turns instead of what it
    sampled: turn k of every episode calls the tool for k < ``calls``, then answers. Every episode of the batch
    is at the same turn at every call (they all make the same calls), so the turn is the call's count."""

    name = "forced"

    def __init__(self, engine: RolloutEngine, tokenizer, calls: int, device: torch.device) -> None:
        self.engine, self.device = engine, device
        texts = [
            "<tool_call>" + json.dumps({"name": "lookup", "arguments": {"step": k}}) + "</tool_call>"
            for k in range(calls)
        ] + ["The values are looked up."]
        self.turns = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        self.reset()

    def reset(self) -> None:
        self.calls, self.generation_s, self.generated_tokens = 0, 0.0, 0

    def complete(self, model: torch.nn.Module, request: Request) -> list[list[int]]:
        start = time.perf_counter()
        rows = self.engine.complete(model, request)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.generation_s += time.perf_counter() - start
        self.generated_tokens += sum(len(r) for r in rows)
        turn = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        if len(turn) + 1 > request.max_new_tokens:
            raise ValueError(
                f"a scripted turn is {len(turn) + 1} tokens: raise --turn-tokens to at least that"
            )
        return [turn + [request.eos_ids[0]] for _ in rows]


def batch(
    model, tokenizer, records: Sequence[PromptRecord], engine: ForcedToolCalls, sleep_s: float, args
) -> dict:
    """One batch of episodes with the tool sleeping ``sleep_s``: its wall time and generation time."""
    settings = EpisodeSettings(
        factory=EnvironmentFactory((sleeping_tool(sleep_s),), None),
        limits=Limits(
            max_turns=args.calls + 1,
            max_tokens=(args.calls + 1) * (args.turn_tokens + 64),
            turn_tokens=args.turn_tokens,
            tool_timeout_s=max(30.0, 10 * sleep_s),
        ),
        hint=" Hint: {hint}",
        environment_reward_weight=1.0,
    )
    engine.reset()
    start = time.perf_counter()
    episodes = run_step_episodes(
        model, tokenizer, records, settings, engine, args.temperature, [tokenizer.eos_token_id]
    )
    wall_s = time.perf_counter() - start
    calls = [e.tool_calls for e in episodes]
    if calls != [args.calls] * len(episodes) or any(e.failed or e.truncated for e in episodes):
        raise RuntimeError(f"the episodes did not run as scripted: {calls}")
    return {
        "wall_s": wall_s,
        "generation_s": engine.generation_s,
        "generated_tokens": engine.generated_tokens,
        "trajectory_tokens": sum(len(e.ids) for e in episodes),
    }


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = TinyModelConfig(
            tokenizer="chars",
            hidden_size=args.hidden,
            intermediate_size=3 * args.hidden,
            num_layers=args.layers,
            num_heads=4,
        )
        path = build_tiny(tiny, [], Path(tmp), seed=0)
        model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TOOL_CHATML
    engine = make_engine(args.engine, device, memory_share=0.5)
    forced = ForcedToolCalls(engine, tokenizer, args.calls, device)
    records = [
        PromptRecord(f"Look up steps 0 to {args.calls - 1} for task {i}.") for i in range(args.episodes)
    ]
    batch(model, tokenizer, records, forced, 0.0, args)  # warm-up
    instant, slow = [], []
    for _ in range(args.repeats):
        instant.append(batch(model, tokenizer, records, forced, 0.0, args))
        slow.append(batch(model, tokenizer, records, forced, args.sleep_s, args))
    generation_s = statistics.median(r["generation_s"] for r in instant)
    slow_wall_s = statistics.median(r["wall_s"] for r in slow)
    bound_s = generation_s + args.calls * args.sleep_s
    return {
        "episodes": args.episodes,
        "tool_calls_per_episode": args.calls,
        "tool_sleep_s": args.sleep_s,
        "turn_tokens": args.turn_tokens,
        "engine": engine.name,
        "device": args.device,
        "params": sum(p.numel() for p in model.parameters()),
        "repeats": args.repeats,
        "generation_s": generation_s,
        "instant_wall_s": statistics.median(r["wall_s"] for r in instant),
        "slow_wall_s": slow_wall_s,
        "slow_generation_s": statistics.median(r["generation_s"] for r in slow),
        "bound_s": bound_s,
        "ratio": slow_wall_s / bound_s,
        # Each slow batch against its own generation: free of the drift between batches.
        "paired_ratio": statistics.median(
            r["wall_s"] / (r["generation_s"] + args.calls * args.sleep_s) for r in slow
        ),
        "bar": 1.3,
        "serial_estimate_s": generation_s + args.episodes * args.calls * args.sleep_s,
        "instant_runs": instant,
        "slow_runs": slow,
        "real": "model (tiny random Llama via build_tiny + from_pretrained), engine (make_engine), "
        "generation of turn_tokens tokens per live episode per turn from its whole trajectory, "
        "run_step_episodes and its episode loop, threads, the sleeping tool",
        "scripted": "the tokens each turn keeps: the first tool_calls_per_episode turns call the tool, "
        "the last answers (a random model writes no tool call); generated tokens are discarded",
        "tokenizer": "character tokenizer with a ChatML template that renders tools and tool turns",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--episodes", type=int, default=32, help="episodes in the batch")
    parser.add_argument("--calls", type=int, default=3, help="tool calls per episode, one per turn")
    parser.add_argument("--sleep-s", type=float, default=0.2, help="how long the slow tool sleeps")
    parser.add_argument("--turn-tokens", type=int, default=80, help="tokens generated per episode per turn")
    parser.add_argument("--repeats", type=int, default=3, help="measured batches of each kind (median)")
    parser.add_argument("--hidden", type=int, default=128, help="the tiny model's width")
    parser.add_argument("--layers", type=int, default=2, help="the tiny model's layers")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--engine", default="auto", help="rollout engine: auto, reference, static, paged")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {
        k: result[k]
        for k in ("generation_s", "instant_wall_s", "slow_wall_s", "bound_s", "ratio", "paired_ratio")
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
