"""LoRA through peft: only the adapters train, travel and are checkpointed; export merges them into the base
model, which then loads with AutoModelForCausalLM alone and computes what the adapted model computes."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.config import LoraConfig, ModelConfig, validate_config
from composer_serverless.models.loading import load_model
from composer_serverless.outputs.export import export
from composer_serverless.rendezvous.checkpoint import read_snapshot
from composer_serverless.rendezvous.codec import read_header
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_metrics
from tests.conftest import ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator
from tests.lora_export import assert_merged_export


def test_at_rank_8_a_100m_model_exchanges_at_least_50_times_fewer_values() -> None:
    """A Llama of about 100M parameters (GPT-2 small's shape) on the meta device: no weights are made."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = get_peft_model(LlamaForCausalLM(config), PeftLoraConfig(r=8, target_modules="all-linear"))
    total = sum(p.numel() for p in model.parameters())
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 90e6 < total < 130e6
    assert total / adapters >= 50, (total, adapters)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir):
    store = tmp_path_factory.mktemp("lora")
    config = validate_config(
        {
            "run_id": "lora",
            "store": str(store),
            "model": {"path": str(tiny_model_dir), "lora": {"r": 4}},
            "data": {"seq_len": 32, "batch_size": 4},
            "train": {"lr": 1e-2},
            # The sparse codec: its error-feedback residual is the adapters' too.
            "diloco": {"replicas": 2, "sync_every": 3, "rounds": 2, "checkpoint_every": 1, "codec": "sparse"},
            "eval": {"sequences": 8},
            "executor": {"threads_per_replica": 1},
        }
    )
    from composer_serverless.launch.launcher import launch

    with replicas_on_the_simulated_accelerator():  # LoRA's CUDA path: adapters on the device, base frozen
        summary = launch(config, "lora", Console(file=io.StringIO()))
    run = ObjectStore(str(store)).child("lora")
    assert ran_on_the_simulated_accelerator(run.local_dir("logs"))
    return run, config, summary


@pytest.mark.slow
def test_only_the_adapters_travel_and_are_checkpointed(lora_run, tiny_model_dir) -> None:
    run, config, summary = lora_run
    assert summary["rounds_committed"] == 2 and summary["replicas_bit_identical"]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    loaded = load_model(config.model, tiny_model_dir)
    adapters = sum(p.numel() for p in loaded.model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in loaded.model.parameters() if not p.requires_grad)
    assert 0 < adapters < frozen
    # A replica's inputs of a round are its N shards of the adapters, and nothing else; sparse, each carries a
    # small part of them: per replica and round, its N shards plus the reduced shard it owns move far fewer
    # bytes than the adapters' fp32 values.
    inputs = sorted(run.local_dir("rounds/2/0/0/in").glob("0-*"))
    assert len(inputs) == 2
    headers = [read_header(p.read_bytes())[0]["__metadata__"] for p in inputs]
    assert {h["codec"] for h in headers} == {"sparse"}
    assert sum(int(h["numel"]) for h in headers) == adapters
    per_replica_round = summary["bytes_uploaded"] / (2 * 2)
    assert per_replica_round < (1 + 1 / 2) * 4 * adapters / 5
    global_state = load_file(run.local_dir("state/2/0") / "tensors.safetensors")
    assert sum(t.numel() for t in global_state.values()) == 2 * adapters  # parameters and outer momentum
    own = load_file(run.local_dir("replicas/0/2/0") / "tensors.safetensors")
    # AdamW's two moments and its step counts; the residual of the adapters and of the half of them replica 0
    # owns (with the default error feedback the local adapters are the global ones at the round's end, and
    # not saved). The RNG states are the uint8 tensors.
    floats = sum(t.numel() for t in own.values() if t.is_floating_point())
    expected = 2 * adapters + adapters + adapters // 2
    assert expected <= floats <= expected + len(own)
    assert read_snapshot(run, "replicas/0/2/0")["residual"]["0/inputs"].numel() == adapters
    # Every round's row says how much of its update the sparse inputs carried.
    trained = [row for rows in read_metrics(run).values() for row in rows if row["round"] > 0]
    assert len(trained) == 4 and all(0 < row["codec_carried"] <= 1 for row in trained)
    assert (run.local_dir("final") / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_export_merges_the_adapters_into_a_plain_model_with_the_same_logits(
    lora_run, tiny_model_dir, tmp_path
) -> None:
    run, config, _ = lora_run
    out = tmp_path / "merged"
    with simulated():  # on a machine with a GPU
        export(run.url, out)
    merged = assert_merged_export(out, tiny_model_dir, 24)
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        merged_logits = merged(input_ids=ids).logits
    # In bfloat16: merged in the run's float32 first, then cast; the logits within torch.testing's bf16
    # tolerance (1.6e-2) of their scale.
    export(run.url, tmp_path / "merged-bf16", dtype="bfloat16")
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "merged-bf16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        half_logits = half.float()(input_ids=ids).logits
    assert float((half_logits - merged_logits).abs().max()) <= 1.6e-2 * float(merged_logits.abs().max())
    # Any kept round, its adapters rebuilt from the round's checkpoint and merged the same way: the last round
    # is the final model bit for bit, the first another model.
    final = load_file(out / "model.safetensors")
    rounds = {}
    for round_index in (2, 1):
        export(run.url, tmp_path / f"round-{round_index}", round_index=round_index)
        rounds[round_index] = load_file(tmp_path / f"round-{round_index}" / "model.safetensors")
    assert rounds[2].keys() == final.keys() and all(torch.equal(rounds[2][k], final[k]) for k in final)
    assert not all(torch.equal(rounds[1][k], final[k]) for k in final)
    assert (tmp_path / "round-1" / "adapter" / "adapter_model.safetensors").exists()


def test_lora_adapters_are_the_only_trainable_weights_and_start_alike(tiny_model_dir) -> None:
    spec = ModelConfig(path=str(tiny_model_dir), lora=LoraConfig(r=4))
    torch.manual_seed(0)
    first = load_model(spec, tiny_model_dir)
    torch.manual_seed(0)
    second = load_model(spec, tiny_model_dir)
    trainable = {n: p for n, p in first.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    again = dict(second.model.named_parameters())
    assert all(torch.equal(p, again[n]) for n, p in trainable.items())
    assert first.adapters is not None and first.adapters.get_base_model() is first.model
