"""``make gpu-check``: the project's GPU lines, end to end, on this machine's accelerator.

    python benchmarks/gpu_check.py [--out docs/results/gpu] [--only demo,lm-chat,...]

Each line is a real launch through the CLI, in a process of its own, on the local executor (replicas share
GPU 0 when there is one GPU):

  demo            deploy/configs/local-demo.toml, 4 replicas
  lm-chat         lm on chat records at the Qwen2.5-0.5B shape (random weights from its config, saved and
                  loaded as a checkpoint), bf16 over float32 masters, 2 replicas
  composer-bf16   the composer objective at that shape in bf16 over masters, 8 prompts x 8 completions x
                  256 new tokens, 1 replica
  composer-bf16-reference
                  composer-bf16 with the reference rollout engine (plain generate): the generation share of a
                  step before the fast engines, beside composer-bf16's with the default (auto)
  rollout-speed   benchmarks/rollout_speed.py at the Qwen2.5-0.5B shape, 8 prompts x 8 completions x 256 new
                  tokens: every engine's tokens per second, time to first token and peak memory
  composer-1.5b   the same at the Qwen2.5-1.5B shape without gradient checkpointing, trained in micro-batches
                  of 16 completions (it ran out of an 80 GB card in one batch of 64)
  lora-1.5b       LoRA (r = 16) at the Qwen2.5-1.5B shape, bf16 base, lm on chat records, 2 replicas
  kill-resume     the demo model, every replica and the launcher SIGKILLed once round 2 is published, then
                  ``launch --resume``; its final global digest against an uninterrupted run's
  export          ``composer-serverless export`` of the lm-chat run, loaded back with AutoModelForCausalLM
  allreduce-link  benchmarks/allreduce.py --replicas 8 --mb 256 --store s3 --latency-ms 20 --link-mbps 50
                  --repeats 3 (the exchange at cloud-store speed; needs 16 cores)

Per line: rounds committed, replicas bit-identical, the step time split (seconds per inner step: generation,
forward and backward, optimizer, sync; on the device's clock), the device's peak bytes per parameter (the
most over the run's rounds and replicas), rollout tokens per second, and the step's workload (the settings
``executors/measured.py`` matches a plan by: a dry run's expected cost uses a GPU's file, with its date and
commit, for a run of the same workload and model size).

Without CUDA the same lines run at a tiny stand-in shape on the simulated accelerator (the GPU code path,
CUDA's placement rules, not its speed); the Qwen shapes and the all-reduce line (under 16 cores) are skipped,
each row says so. Writes ``<out>/<device>.json`` and ``<device>.md`` (the table).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LINES = (
    "demo",
    "lm-chat",
    "composer-bf16",
    "composer-bf16-reference",
    "rollout-speed",
    "composer-1.5b",
    "lora-1.5b",
    "kill-resume",
    "export",
    "allreduce-link",
)
# Qwen2.5's published shapes (config.json of Qwen/Qwen2.5-0.5B-Instruct and -1.5B-Instruct).
QWEN_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14}
QWEN_15B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
}
QWEN_COMMON = {"num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1e6}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 2048,  # the demo tokenizer's
}
TASKS = REPO / "deploy" / "data" / "composer-tasks"
GSM8K = REPO / "deploy" / "data" / "gsm8k-sample"
SIMULATED_ENV = "COMPOSER_SERVERLESS_SIMULATED_ACCELERATOR"
ALLREDUCE_CORES = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "gpu")
    parser.add_argument("--only", help=f"comma-separated lines to run, of: {', '.join(LINES)}")
    args = parser.parse_args()
    only = LINES if args.only is None else tuple(args.only.split(","))
    unknown = sorted(set(only) - set(LINES))
    if unknown:
        parser.error(f"unknown lines {unknown}; known: {', '.join(LINES)}")
    result = run_check(only)
    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", result["device"].lower()).strip("-")
    (args.out / f"{slug}.json").write_text(json.dumps(result, indent=2))
    (args.out / f"{slug}.md").write_text(table(result))
    print(table(result))
    print(f"wrote {args.out / slug}.json and .md")


def run_check(lines: tuple[str, ...]) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"{platform.machine()} CPU, simulated accelerator"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if not cuda:
        env[SIMULATED_ENV] = "1"
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    check = Check(work, env, cuda)
    rows = []
    for line in lines:
        started = time.monotonic()
        row = getattr(check, re.sub(r"[-.]", "_", line))()
        rows.append({"line": line, **row, "wall_s": round(time.monotonic() - started, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return {
        "device": device,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": _commit(),
        "cuda": cuda,
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "work_dir": str(work),
        "lines": rows,
    }


class Check:
    """The lines, each launched in ``work`` with ``env``; at the Qwen shapes only with ``cuda``."""

    def __init__(self, work: Path, env: dict[str, str], cuda: bool) -> None:
        self.work, self.env, self.cuda = work, env, cuda
        self.store = work / "runs"
        self._models: dict[str, Path] = {}

    # --- the lines ----------------------------------------------------------------------------------

    def demo(self) -> dict[str, Any]:
        return self._launch("demo", REPO / "deploy" / "configs" / "local-demo.toml", self._rounds(6, 2))

    def lm_chat(self) -> dict[str, Any]:
        return self._chat_run("lm-chat", "qwen2.5-0.5b", QWEN_05B)

    def composer_bf16(self) -> dict[str, Any]:
        return self._composer("composer-bf16", "qwen2.5-0.5b", QWEN_05B)

    def composer_bf16_reference(self) -> dict[str, Any]:
        return self._composer(
            "composer-bf16-reference", "qwen2.5-0.5b", QWEN_05B, "composer.rollout.engine=reference"
        )

    def rollout_speed(self) -> dict[str, Any]:
        shape, tokens = ("qwen2.5-0.5b", "256") if self.cuda else ("tiny", "8")
        measured = self._benchmark(
            "rollout_speed",
            *("--device", "cuda" if self.cuda else "cpu", "--shape", shape),
            *("--prompts", "8", "--group", "8", "--max-new-tokens", tokens, "--calls", "2"),
        )
        if "error" in measured:
            return measured
        engines = measured["engines"]
        return {
            "shape": shape,
            "speedup_vs_reference": measured["speedup_vs_reference"],
            "tokens_per_s": {name: round(e["tokens_per_s"]) for name, e in engines.items()},
            "first_token_s": {name: round(e["first_token_s"], 3) for name, e in engines.items()},
            "peak_gb": {name: round(e["peak_bytes"] / 1e9, 2) for name, e in engines.items()},
        }

    def composer_1_5b(self) -> dict[str, Any]:  # the line "composer-1.5b"
        sets = ["model.gradient_checkpointing=false", "train.micro_batch_size=16"]
        return self._composer("composer-1-5b", "qwen2.5-1.5b", QWEN_15B, *sets)

    def _composer(self, line: str, name: str, shape: dict[str, int], *extra: str) -> dict[str, Any]:
        """One replica of ``name`` in bf16 over masters on the composer objective, 8 x 8 rollouts a step."""
        model, shown = self._model(name, shape)
        tokens = 256 if self.cuda else 8
        sets = [
            f"model.path={model}",
            "model.dtype=bfloat16",
            "train.objective=composer",
            "train.lr=1e-6",
            "diloco.replicas=1",
            "diloco.sync_every=4",
            f"composer.data.prompts={TASKS / 'train.jsonl'}",
            f"composer.data.heldout={TASKS / 'heldout.jsonl'}",
            "composer.rollout.group_size=8",
            "composer.rollout.prompts_per_step=8",
            f"composer.rollout.max_new_tokens={tokens}",
            "eval.sequences=16",
            *extra,
        ]
        config = self.work / "composer.toml"
        config.write_text(
            self._base().read_text()
            + '\n[[composer.rewards]]\nfn = "exact_match"\n\n[[composer.rewards]]\nfn = "format"\n'
            + 'pattern = ".*[0-9].*"\nweight = 0.5\n'
        )
        return {"shape": shown, **self._launch(line, config, [*sets, *self._rounds(2, 2)])}

    def lora_1_5b(self) -> dict[str, Any]:  # the line "lora-1.5b"
        return self._chat_run("lora-1-5b", "qwen2.5-1.5b", QWEN_15B, "model.lora.r=16")

    def kill_resume(self) -> dict[str, Any]:
        config = REPO / "deploy" / "configs" / "local-demo.toml"
        sets = ["diloco.replicas=2", "diloco.rounds=4", "diloco.checkpoint_every=1", "eval.sequences=16"]
        whole = self._launch("uninterrupted", config, sets)
        run = self.store / "killed"
        launcher = subprocess.Popen(
            self._cli("launch", str(config), *self._sets([*sets, f"store={self.store}", "run_id=killed"])),
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        killed = _kill_when_published(run, 2, launcher)
        resumed = subprocess.run(
            self._cli("launch", "--resume", str(run)), env=self.env, capture_output=True, text=True
        )
        row = self._outcome(run, resumed.returncode, resumed.stderr)
        row["killed_after_round"] = killed
        row["final_digest_equals_uninterrupted"] = (
            _final_digest(run) == _final_digest(self.store / "uninterrupted")
            and whole["rounds_committed"] == 4
        )
        return row

    def export(self) -> dict[str, Any]:
        run = self.store / "lm-chat"
        if not (run / "final").exists():
            return {"skipped": "the lm-chat line did not leave a final model to export"}
        out = self.work / "exported"
        done = subprocess.run(
            self._cli("export", str(run), str(out)), env=self.env, capture_output=True, text=True
        )
        if done.returncode:
            return {"ok": False, "error": done.stderr[-2000:]}
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out)
        return {
            "ok": True,
            "params": sum(p.numel() for p in model.parameters()),
            "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}),
            "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        }

    def allreduce_link(self) -> dict[str, Any]:
        cores = os.cpu_count() or 1
        if cores < ALLREDUCE_CORES:
            return {
                "skipped": f"needs {ALLREDUCE_CORES} cores for proxy, moto and 8 replicas; this machine has {cores}"
            }
        measured = self._benchmark(
            "allreduce",
            *("--replicas", "8", "--mb", "256", "--store", "s3", "--latency-ms", "20", "--link-mbps", "50"),
            *("--repeats", "3"),
        )
        return {k: v for k, v in measured.items() if not isinstance(v, (dict, list))}

    # --- helpers ------------------------------------------------------------------------------------

    def _benchmark(self, script: str, *argv: str) -> dict[str, Any]:
        """``benchmarks/<script>.py *argv --out FILE``: the JSON it wrote, or ``ok`` false and its stderr."""
        out = self.work / f"{script}.json"
        command = [sys.executable, str(REPO / "benchmarks" / f"{script}.py"), *argv, "--out", str(out)]
        done = subprocess.run(command, env=self.env, capture_output=True, text=True)
        if done.returncode:
            return {"ok": False, "error": done.stderr[-2000:]}
        return json.loads(out.read_text())

    def _rounds(self, on_gpu: int, on_cpu: int) -> list[str]:
        return [f"diloco.rounds={on_gpu if self.cuda else on_cpu}"]

    def _base(self) -> Path:
        path = self.work / "base.toml"
        if not path.exists():
            path.write_text('store = "runs"\nseed = 0\n\n[executor]\ntype = "local"\n')
        return path

    def _chat_run(self, line: str, name: str, shape: dict[str, int], *extra: str) -> dict[str, Any]:
        """Two replicas of ``name`` (bf16, plus ``extra`` settings) training on chat data for two rounds."""
        model, shown = self._model(name, shape)
        sets = [f"model.path={model}", "model.dtype=bfloat16", *extra, *self._chat()]
        sets += ["diloco.replicas=2", "diloco.sync_every=5", *self._rounds(2, 2)]
        return {"shape": shown, **self._launch(line, self._base(), sets)}

    def _chat(self) -> list[str]:
        train, heldout = self.work / "chat-train.jsonl", self.work / "chat-heldout.jsonl"
        if not train.exists():
            train.write_text("".join(json.dumps(c) + "\n" for c in _chats("train")))
            heldout.write_text("".join(json.dumps(c) + "\n" for c in _chats("test")))
        seq = 512 if self.cuda else 64
        return [
            f"data.corpus={train}",
            f"data.heldout={heldout}",
            "data.format=chat",
            f"data.seq_len={seq}",
            "eval.sequences=16",
        ]

    def _model(self, name: str, shape: dict[str, int]) -> tuple[Path, str]:
        """A checkpoint with ``shape`` (or, without CUDA, the tiny stand-in) and random weights; the demo's
        BPE tokenizer with a ChatML template (ids below its size: the embedding keeps Qwen's rows)."""
        if name in self._models:
            return self._models[name], self._shape_note(name)
        import torch
        from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

        from composer_serverless.config import TinyModelConfig
        from composer_serverless.data.corpus import stdlib_corpus, training_text
        from composer_serverless.models.loading import build_tiny

        tokenizer_dir = self.work / "tokenizer"
        if not tokenizer_dir.exists():
            build_tiny(
                TinyModelConfig(num_layers=1),
                training_text(stdlib_corpus(5.0), 300_000, seed=0),
                tokenizer_dir,
                seed=0,
            )
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        tokenizer.chat_template = (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
        dims = {**QWEN_COMMON, **(shape if self.cuda else TINY)}
        config = Qwen2Config(
            **dims,
            max_position_embeddings=4096,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(0)
        out = self.work / name
        Qwen2ForCausalLM(config).save_pretrained(out)
        tokenizer.save_pretrained(out)
        self._models[name] = out
        return out, self._shape_note(name)

    def _shape_note(self, name: str) -> str:
        return name if self.cuda else f"tiny stand-in ({name} skipped: no CUDA)"

    def _cli(self, *argv: str) -> list[str]:
        return [sys.executable, "-m", "composer_serverless.cli", *argv]

    @staticmethod
    def _sets(sets: list[str]) -> list[str]:
        return [arg for s in sets for arg in ("--set", s)]

    def _launch(self, name: str, config: Path, sets: list[str]) -> dict[str, Any]:
        argv = self._cli("launch", str(config), *self._sets([*sets, f"store={self.store}", f"run_id={name}"]))
        done = subprocess.run(argv, env=self.env, cwd=self.work, capture_output=True, text=True)
        return self._outcome(self.store / name, done.returncode, done.stderr)

    def _outcome(self, run: Path, code: int, stderr: str) -> dict[str, Any]:
        row: dict[str, Any] = {"exit_code": code}
        if code:
            row["error"] = stderr[-2000:]
        summary = run / "summary.json"
        if summary.exists():
            figures = json.loads(summary.read_text())
            row |= {
                "rounds_committed": figures["rounds_committed"],
                "rounds": json.loads((run / "run.json").read_text())["diloco"]["rounds"],
                "bit_identical": figures["replicas_bit_identical"],
                "initial_eval": figures.get("initial_eval_loss") or figures.get("initial_eval_reward"),
                "final_eval": figures.get("final_eval_loss") or figures.get("final_eval_reward"),
            }
        row |= _per_step(run)
        return row


def _chats(split: str) -> list[dict[str, Any]]:
    """The GSM8K-shaped sample (deploy/data/gsm8k-sample) as chat records: the question, the worked answer."""
    rows = [json.loads(line) for line in (GSM8K / f"{split}.jsonl").read_text().splitlines()]
    return [
        {
            "messages": [
                {"role": "user", "content": r["question"]},
                {"role": "assistant", "content": r["answer"]},
            ]
        }
        for r in rows
    ]


def _per_step(run: Path) -> dict[str, Any]:
    """From the run's metrics rows: seconds per inner step by phase (rounds after the first when there are
    several: the first pays for warm-up), the device's peak bytes per parameter, rollout tokens per second."""
    from composer_serverless.rendezvous.store import ObjectStore
    from composer_serverless.rendezvous.telemetry import read_metrics

    if not (run / "run.json").exists():
        return {}
    rows = [r for rows in read_metrics(ObjectStore(str(run))).values() for r in rows if "time_s" in r]
    if not rows:
        return {}
    later = [r for r in rows if r["round"] > 1] or rows
    steps = sum(r["steps"] for r in later)
    split = {phase: round(sum(r["time_s"][phase] for r in later) / steps, 4) for phase in later[0]["time_s"]}
    out: dict[str, Any] = {"step_s": split, "params": _params(run), "workload": _workload(run)}
    peaks = [r["device_peak_bytes"] for r in rows if r.get("device_peak_bytes")]
    if peaks and out["params"]:
        out["device_peak_bytes_per_param"] = round(max(peaks) / out["params"]["total"], 2)
    tokens = sum(r["train"].get("rollout/tokens", 0.0) * r["steps"] for r in later)
    seconds = sum(r["train"].get("rollout/generate_s", 0.0) * r["steps"] for r in later)
    if seconds:
        out["rollout_tokens_per_s"] = round(tokens / seconds, 1)
    return out


def _workload(run: Path) -> dict[str, Any]:
    """The settings that decide the run's step's work, as a plan's are matched against them."""
    from composer_serverless.config import RunConfig
    from composer_serverless.executors.measured import workload

    return workload(RunConfig.model_validate_json((run / "run.json").read_text()))


def _commit() -> str:
    """The checkout's commit (with ``+dirty`` when it has changes), or ``unknown`` outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _params(run: Path) -> dict[str, int] | None:
    """The run's parameters, counted on the meta device (total, and trainable with LoRA)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((run / "run.json").read_text())
    source = config["model"]["path"] or str(run / "model")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    total = sum(p.numel() for p in model.parameters())
    lora = config["model"].get("lora")
    if lora is None:
        return {"total": total}
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        adapted = get_peft_model(model, LoraConfig(r=lora["r"], target_modules="all-linear"))
    return {"total": total, "trainable": sum(p.numel() for p in adapted.parameters() if p.requires_grad)}


def _kill_when_published(run: Path, round_index: int, launcher: subprocess.Popen) -> int:
    """SIGKILL the launcher and every replica of ``run`` once ``round_index`` is published; the round reached."""
    import psutil

    from composer_serverless.rendezvous.latest import latest_round
    from composer_serverless.rendezvous.store import ObjectStore

    while (
        reached := latest_round(ObjectStore(str(run))) if (run / "run.json").exists() else 0
    ) < round_index:
        if launcher.poll() is not None:
            return reached
        time.sleep(0.2)
    replicas = [p for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
    for process in [launcher, *replicas]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
    launcher.wait()
    return reached


def _final_digest(run: Path) -> str | None:
    from composer_serverless.rendezvous.store import ObjectStore
    from composer_serverless.rendezvous.telemetry import read_metrics

    if not (run / "run.json").exists():
        return None
    last = json.loads((run / "run.json").read_text())["diloco"]["rounds"]
    digests = {
        r.get("global_sha256")
        for rows in read_metrics(ObjectStore(str(run))).values()
        for r in rows
        if r["round"] == last and "caught_up_from" not in r
    }
    return digests.pop() if len(digests) == 1 else None


def table(result: dict[str, Any]) -> str:
    """The lines as a Markdown table."""
    head = (
        f"# gpu-check on {result['device']}\n\ntorch {result['torch']} (CUDA {result['cuda_runtime']}), "
        f"{result['cpus']} CPUs, Python {result['python']}\n\n"
        "| line | shape | rounds | bit-identical | s/step gen / fwd+bwd / opt / sync | device B/param | rollout tok/s | wall s | note |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    body = []
    for row in result["lines"]:
        split = row.get("step_s")
        phases = (
            " / ".join(f"{split[p]:.3f}" for p in ("generate", "forward_backward", "optimizer", "sync"))
            if split
            else "-"
        )
        rounds = f"{row['rounds_committed']}/{row['rounds']}" if "rounds" in row else "-"
        note = row.get("skipped") or row.get("error", "")[-120:].replace("\n", " ") or _extra(row)
        body.append(
            f"| {row['line']} | {row.get('shape', '-')} | {rounds} | {row.get('bit_identical', '-')} | {phases} | "
            f"{row.get('device_peak_bytes_per_param', '-')} | {row.get('rollout_tokens_per_s', '-')} | "
            f"{row['wall_s']} | {note} |"
        )
    return head + "\n".join(body) + "\n"


def _extra(row: dict[str, Any]) -> str:
    if "final_digest_equals_uninterrupted" in row:
        return f"killed after round {row['killed_after_round']}; final digest = uninterrupted run's: {row['final_digest_equals_uninterrupted']}"
    if "speedup_vs_sequential" in row:
        return f"speedup vs sequential {row['speedup_vs_sequential']:.2f}, time / probe bound {row.get('time_ratio_to_probe_bound', '-')}"
    if "speedup_vs_reference" in row:
        ratios = ", ".join(f"{name} {x:.2f}x" for name, x in row["speedup_vs_reference"].items())
        return f"tokens/s vs reference: {ratios}; tokens/s {row['tokens_per_s']}"
    if row.get("line") == "export":
        return f"loaded {row.get('params')} params, {row.get('dtypes')}, finite {row.get('finite')}"
    return ""


if __name__ == "__main__":
    main()
