"""A harvest from a real OpenAI-compatible server nobody here wrote, `transformers serve`, whose pairs then
feed the replay channel of a short composer run.

    python benchmarks/harvest_serve.py --out bench-out/harvest-serve              # 28 states, 3 teachers
    python benchmarks/harvest_serve.py --out bench-out/harvest-serve --states 21

Offline and on loopback: two tiny Llamas with random weights (the task suite's character tokenizer, a chat
template that renders the messages' text, a wide initialisation so that their answers vary) are built and
saved with ``save_pretrained``; ``transformers serve``
(``transformers[serving]``, the dev extra) serves them from their directories with ``HF_HUB_OFFLINE=1``, each
request naming its model by path. The teachers are the first model, a copy of it in another directory (two
endpoints' worth of the same network, so they agree) and the second model. ``composer-serverless harvest``
(the real CLI, in a subprocess) asks all three about ``--states`` states of the task suite's traces, spread
over its tasks; a second harvest must be answered by the cache for $0. Then a composer run (2 local replicas,
2 rounds, DPO) trains with ``composer.data.pairs`` = the harvested file, and its metrics rows must show the
replay channel on those pairs.

Random weights answer nonsense: the pairs prove the path from a real server to the loss, not teaching.
Writes ``results.json``: the harvest's report (per teacher requests, failures, latency, tokens), the pairs,
the re-run's spend, the run's replay metrics, versions and wall times.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console

from composer_serverless.config import TinyModelConfig, validate_config
from composer_serverless.launch.launcher import launch
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_metrics

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "deploy" / "data" / "composer-tasks"
ALPHABET = " -.0123456789:=ATabcdefghilmnoprstvwx"
TINY = TinyModelConfig(
    tokenizer="chars", alphabet=ALPHABET, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4
)
# The messages' text, one after another: what a chat template without roles renders.
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
START_TIMEOUT_S = 180


def spread(traces: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """``count`` traces taking one task after another in turn (file order within a task)."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for trace in traces:
        by_task.setdefault(trace["task"], []).append(trace)
    out: list[dict[str, Any]] = []
    depth = 0
    while len(out) < count:
        out += [rows[depth] for rows in by_task.values() if depth < len(rows)][: count - len(out)]
        depth += 1
    return out


def build_teachers(out: Path) -> list[Path]:
    """The three teachers' directories. The weights are drawn with a wide initialisation (std 0.5, not 0.02),
    so that greedy answers differ from prompt to prompt and from one model to the other instead of all
    collapsing onto one string."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    from composer_serverless.models.loading import build_tiny

    dirs = [out / "teacher-a", out / "teacher-a-copy", out / "teacher-b"]
    for path, seed in ((dirs[0], 0), (dirs[2], 1)):
        build_tiny(TINY, [], path, seed=seed)
        config = AutoConfig.from_pretrained(path)
        config.initializer_range = 0.5
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.chat_template = TEMPLATE
        tokenizer.save_pretrained(path)
    shutil.copytree(dirs[0], dirs[1], dirs_exist_ok=True)
    return dirs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(out: Path, port: int) -> subprocess.Popen[bytes]:
    """``transformers serve`` on 127.0.0.1:port, offline, on the CPU, its log in ``out``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(out / "hf-home"), "OMP_NUM_THREADS": "1"}
    with open(out / "serve.log", "wb") as log:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "transformers"), "serve", "--host", "127.0.0.1"]
            + ["--port", str(port), "--device", "cpu"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"transformers serve exited with {server.returncode}; see {out / 'serve.log'}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit(
        f"transformers serve did not answer /health in {START_TIMEOUT_S} s; see {out / 'serve.log'}"
    )


def write_config(out: Path, port: int, teachers: list[Path], states: int) -> Path:
    traces = [json.loads(line) for line in (TASKS / "traces.jsonl").read_text().splitlines()]
    chosen = spread(traces, states)
    (out / "traces.jsonl").write_text("".join(json.dumps(t) + "\n" for t in chosen))
    blocks = "".join(
        f"""
[[harvest.teachers]]
name = "{name}"
base_url = "http://127.0.0.1:{port}/v1"
model = "{path}"
usd_per_m_input = 0.5
usd_per_m_output = 1.5
concurrency = 4
max_tokens = 4
"""
        for name, path in zip(("a", "a-copy", "b"), teachers, strict=True)
    )
    config = out / "harvest.toml"
    config.write_text(
        f"""[harvest]
traces = "{out / "traces.jsonl"}"
output = "{out / "pairs.jsonl"}"
cache = "{out / "cache"}"
threshold = 2
max_usd = 0.5
timeout_s = 120
"""
        + blocks
    )
    return config


def harvest(config: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "composer_serverless.cli", "harvest", str(config)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200"},
    )
    if result.returncode != 0:
        raise SystemExit(f"the harvest failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result, time.perf_counter() - started


def composer_run(out: Path, pairs: Path) -> dict[str, Any]:
    config = validate_config(
        {
            "run_id": "replay-served-pairs",
            "store": str(out / "runs"),
            "model": {"tiny": TINY.model_dump()},
            "train": {"objective": "composer", "lr": 1e-3},
            "diloco": {"replicas": 2, "sync_every": 2, "rounds": 2},
            "eval": {"sequences": 7},
            "composer": {
                "alpha": 0.0,
                "beta": 1.0,
                "data": {
                    "prompts": str(TASKS / "train.jsonl"),
                    "heldout": str(TASKS / "heldout.jsonl"),
                    "pairs": str(pairs),
                },
                "rewards": [{"fn": "exact_match"}],
                "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 4},
                "replay": {"kind": "dpo", "pairs_per_step": 4},
            },
            "executor": {"type": "local", "threads_per_replica": 1},
        }
    )
    started = time.perf_counter()
    summary = launch(config, "harvest-serve", Console(file=io.StringIO()))
    assert summary is not None
    rows = [
        r
        for rank_rows in read_metrics(ObjectStore(str(out / "runs" / "replay-served-pairs"))).values()
        for r in rank_rows
    ]
    trained = [r for r in rows if r["round"] > 0 and "train" in r]
    return {
        "rounds_committed": summary["rounds_committed"],
        "replicas_bit_identical": summary["replicas_bit_identical"],
        "wall_s": time.perf_counter() - started,
        "replay_per_round": [
            {
                "rank": r["rank"],
                "round": r["round"],
                "replay_files": r.get("replay_files"),
                "replay/pairs": r["train"].get("replay/pairs"),
                "replay/loss": r["train"].get("replay/loss"),
            }
            for r in trained
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--states", type=int, default=28)
    args = parser.parse_args(argv)
    out: Path = args.out.absolute()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    teachers = build_teachers(out)
    port = free_port()
    server = serve(out, port)
    try:
        config = write_config(out, port, teachers, args.states)
        first, first_s = harvest(config)
        pairs = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
        again, again_s = harvest(config)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    run = composer_run(out, out / "pairs.jsonl")
    import transformers

    results = {
        "server": f"transformers serve (transformers {transformers.__version__}), offline, CPU",
        "states": args.states,
        "pairs": len(pairs),
        "distinct_chosen": len({p["chosen"] for p in pairs}),
        "outvoted_b": sum(p["provenance"]["agreement"]["votes"] == 2 for p in pairs),
        "pair_examples": pairs[:3],
        "harvest_wall_s": first_s,
        "harvest_table": first.stdout,
        "rerun_wall_s": again_s,
        "rerun_spent": next(line for line in again.stdout.splitlines() if line.startswith("spent")),
        "composer_run": run,
        "checks": {
            "at_least_20_states": args.states >= 20,
            "pairs_produced": len(pairs) > 0,
            "rerun_costs_nothing": "spent $0.00 " in again.stdout,
            "replay_trained_on_them": all(
                row["replay/pairs"] and row["replay_files"] == [str(out / "pairs.jsonl")]
                for row in run["replay_per_round"]
            ),
        },
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(first.stdout)
    print(
        json.dumps(
            {k: v for k, v in results.items() if k not in ("harvest_table", "pair_examples")}, indent=2
        )
    )
    return 0 if all(results["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
