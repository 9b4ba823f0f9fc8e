"""benchmarks/replica_memory.py: the census at a tiny shape and at twice its depth (each mode's replica in
processes of its own, on the accelerator: the simulated one here), the activations' split by depth, and the
arithmetic of its fits table over the Qwen2.5 shapes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_scripts import load_script

bench = load_script("replica_memory")
PASSES = bench.PASSES  # forward, backward

PER_PARAM = (
    "device_bytes_per_param_between_steps",
    "device_bytes_per_param_inner",
    "device_bytes_per_param_sync",
    "device_state_bytes_per_param",
    "device_optimizer_step_bytes_per_param",
    "host_bytes_per_param",
)
POSITIVE = ("params", "trainable_params", "tokens_per_step", "activation_bytes_per_token", *PER_PARAM)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("replica-memory") / "replica_memory.json"
    argv = ["--out", str(out), "--model", str(tiny_model_dir), "--checkpointing", "off"]
    # Short sequences: the tiny model's gradients are small enough that its activations make the backward's
    # peak at a few hundred tokens already.
    assert bench.main([*argv, "--seq-len", "128", "--batch-sizes", "1,4"]) == 0
    return json.loads(out.read_text())


def slopes(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each pass's bytes per token: through two points a fit is the line through them."""
    small, large = runs
    tokens = large["tokens"] - small["tokens"]
    return {p: (large[f"device_peak_{p}_bytes"] - small[f"device_peak_{p}_bytes"]) / tokens for p in PASSES}


def per_token(runs: list[dict[str, Any]]) -> float:
    """The steeper of the forward's and the backward's."""
    return max(slopes(runs).values())


def llama(shape: dict[str, Any], layers: int) -> dict[str, Any]:
    """The measured Llama's config in the fits table's terms: no attention biases, as many key/value heads as
    heads, a head tied to the embedding."""
    return {**shape, "layers": layers, "kv_heads": shape["heads"], "tied": True, "attention_bias": False}


@pytest.mark.slow  # three processes, four replicas each (two depths, two batch sizes): under a minute
def test_the_census_of_each_mode(report: dict[str, Any]) -> None:
    assert report["device"] == (
        f"cuda: {torch.cuda.get_device_name(0)}"
        if torch.cuda.is_available()
        else "simulated accelerator on CPU"
    )
    assert report["command"].startswith("python benchmarks/replica_memory.py --out ")
    assert report["machine"]["cpus"] > 0 and report["wall_s"] > 0
    shape = report["shape"]
    assert report["setup"]["activation_layers"] == [2, 4] == [shape["layers"], 2 * shape["layers"]]
    assert [(r["mode"], r["gradient_checkpointing"]) for r in report["results"]] == [
        (mode, False) for mode in bench.MODES
    ]
    for row in report["results"]:
        assert all(row[field] > 0 for field in POSITIVE), row
        params, trainable = row["params"], row["trainable_params"]
        small, large = row["runs"]
        assert (small["tokens"], large["tokens"]) == (128, 512)
        assert (small["batch_size"], large["batch_size"]) == (1, 4)
        assert row["activation_bytes_per_token"] == pytest.approx(per_token(row["runs"]), abs=0.1)
        # The state: the least that bounds every phase's peak with the activations of its tokens.
        slope = per_token(row["runs"])
        state = max(
            *(r["device_peak_optimizer_bytes"] for r in (small, large)),
            *(r[f"device_peak_{p}_bytes"] - slope * r["tokens"] for r in (small, large) for p in PASSES),
        )
        assert row["device_state_bytes_per_param"] == pytest.approx(state / params, abs=1e-3)
        inner = max(large[f"device_peak_{p}_bytes"] for p in (*PASSES, "optimizer"))
        assert row["device_bytes_per_param_inner"] == pytest.approx(inner / params, abs=1e-3)
        # What the device holds between steps is in every phase; the inner peak holds the state.
        assert row["device_bytes_per_param_inner"] >= row["device_state_bytes_per_param"]
        assert row["device_state_bytes_per_param"] >= row["device_bytes_per_param_between_steps"]
        assert row["device_bytes_per_param_sync"] >= row["device_bytes_per_param_between_steps"] - 1e-3
        # The host figure is the second replica's in the process (the first pays the libraries' one-time
        # costs); what the sync's window adds on the host is positive either way.
        assert (small["warm"], large["warm"]) == (False, True)
        assert row["host_bytes_per_param"] == pytest.approx(large["host_bytes_sync"] / params, abs=1e-3)
        assert small["host_bytes_sync"] > 0
        # The fits table's parameter arithmetic counts the measured models too, adapters included.
        deeper = row["deeper"]
        assert deeper["layers"] == 4 and len(deeper["runs"]) == 2
        base = bench.shape_params(llama(shape, 2))
        deeper_base = bench.shape_params(llama(shape, 4))
        if "LoRA" in row["mode"]:
            assert trainable == bench.lora_params(llama(shape, 2), 8)
            assert deeper["trainable_params"] == bench.lora_params(llama(shape, 4), 8)
            assert (params, deeper["params"]) == (base + trainable, deeper_base + deeper["trainable_params"])
            # Between steps and at the sync the device holds at least the bf16 base and the float32 adapters
            # with their AdamW moments (the gradients are freed after each optimizer step).
            held = 2 * (params - trainable) + (4 + 8) * trainable
        else:
            assert trainable == params == base and deeper["params"] == deeper_base
            # float32 masters: weights 4 + gradients 4 + AdamW's two moments 8 are all on the device when the
            # inner optimizer steps; between steps and at the sync, all but the gradients.
            assert row["device_bytes_per_param_inner"] >= 16
            assert row["device_optimizer_step_bytes_per_param"] >= 16
            held = (4 + 8) * params
        assert row["device_bytes_per_param_between_steps"] * params >= held - 1
        assert row["device_bytes_per_param_sync"] * params >= held - 1


@pytest.mark.slow
def test_the_activations_split_by_depth(report: dict[str, Any]) -> None:
    shape = report["shape"]
    for row in report["results"]:
        # By hand from the raw peaks: the bytes per token at 2 and 4 layers, a(L) = fixed + L * per_layer, the
        # per-layer part the larger of the forward's and the backward's growth, the fixed part through a(2).
        at_2, at_4 = per_token(row["runs"]), per_token(row["deeper"]["runs"])
        assert row["deeper"]["activation_bytes_per_token"] == pytest.approx(at_4, abs=0.1)
        assert row["activation_bytes_per_token_by_layers"] == {
            "2": pytest.approx(at_2, abs=0.1),
            "4": pytest.approx(at_4, abs=0.1),
        }
        two, four = slopes(row["runs"]), slopes(row["deeper"]["runs"])
        per_layer = max((four[p] - two[p]) / 2 for p in PASSES)
        fixed = at_2 - 2 * per_layer
        assert per_layer > 0, row["mode"]  # a deeper model keeps more
        assert fixed + 4 * per_layer >= at_4 - 1e-6  # the line bounds the deeper model's bytes
        assert row["activation_bytes_per_token_per_layer"] == pytest.approx(per_layer, abs=0.1)
        assert row["activation_bytes_per_token_fixed"] == pytest.approx(fixed, abs=0.1)
        assert row["activation_bytes_per_token_per_layer_per_hidden"] == pytest.approx(
            per_layer / shape["hidden"], abs=1e-4
        )
        assert row["activation_bytes_per_token_fixed_per_vocab"] == pytest.approx(
            fixed / shape["vocab"], abs=1e-4
        )


@pytest.mark.slow
def test_the_fits_table_follows_from_the_bytes(report: dict[str, Any]) -> None:
    fits = report["fits"]
    assumptions = fits["assumptions"]
    assert assumptions["gpu_bytes"] == 80e9 and assumptions["fsdp_ranks"] == 8
    assert assumptions["tokens_per_rank"] == [8 * 2048, 2048]
    assert [s["name"] for s in fits["shapes"]] == list(bench.QWEN25)
    assert len(fits["rows"]) == 2 * 2 * len(report["results"]) * len(bench.QWEN25)
    rows = {(r["tokens_per_rank"], r["setup"], r["mode"], r["shape"]): r for r in fits["rows"]}
    results = {r["mode"]: r for r in report["results"]}
    measured = report["shape"]

    # By hand: full fp32, Qwen2.5-7B (3584 wide, MLP 18944, 28 layers, vocabulary 152064, untied), 8 ranks with
    # FSDP, 8 x 2048 tokens a rank. A rank holds an eighth of the state and all of its micro-batch's
    # activations; the fixed part grows with the vocabulary, a layer's with its width times the MLP ratio's
    # growth over the measured model's.
    full = results["full fp32"]
    n = 7_615_616_512
    activation = full["activation_bytes_per_token_fixed_per_vocab"] * 152064 + 28 * full[
        "activation_bytes_per_token_per_layer_per_hidden"
    ] * 3584 * max(1, (18944 / 3584) / (measured["intermediate"] / measured["hidden"]))
    inner = full["device_state_bytes_per_param"] * n / 8 + activation * 16384
    sync = full["device_bytes_per_param_sync"] * n / 8
    row = rows[(16384, "8 x 80 GB, FSDP", "full fp32", "Qwen2.5-7B")]
    assert row["params"] == n
    assert row["activation_bytes_per_token"] == pytest.approx(activation, abs=1)
    assert row["inner_bytes"] == pytest.approx(inner, abs=1)
    assert row["sync_bytes"] == pytest.approx(sync, abs=1)
    assert row["fits"] == (inner <= 80e9 and sync <= 80e9)

    # LoRA: the measured figures are over the base and its adapters, so N is the 7B's base plus its r=8
    # adapters (20,185,088); one GPU, one 2048-token sequence.
    lora = results["LoRA r=8, bf16 base"]
    row = rows[(2048, "1 x 80 GB", "LoRA r=8, bf16 base", "Qwen2.5-7B")]
    assert row["params"] == n + 20_185_088
    assert row["sync_bytes"] == pytest.approx(lora["device_bytes_per_param_sync"] * row["params"], abs=1)

    # Without checkpointing the activation model runs through the shallower depth and bounds the deeper.
    assert len(fits["activation_check"]) == 2 * len(report["results"])
    for check in fits["activation_check"]:
        assert check["bounds"] and check["modelled"] >= check["measured"] - 0.5, check
        if check["layers"] == 2:
            assert check["modelled"] == pytest.approx(check["measured"], abs=0.5), check

    # The largest shape of each (budget, setup, mode) is the largest that fits.
    for best in fits["largest"]:
        fitting = [
            r
            for r in fits["rows"]
            if (r["tokens_per_rank"], r["setup"], r["mode"], r["gradient_checkpointing"])
            == (best["tokens_per_rank"], best["setup"], best["mode"], best["gradient_checkpointing"])
            and r["fits"]
        ]
        top = max(fitting, key=lambda r: r["params"], default=None)
        assert best["shape"] == (top["shape"] if top else None)
        assert best["params"] == (top["params"] if top else 0)


def test_the_shape_arithmetic() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def meta_model(shape: dict[str, Any]) -> torch.nn.Module:
        config = Qwen2Config(
            hidden_size=shape["hidden"],
            intermediate_size=shape["intermediate"],
            num_hidden_layers=shape["layers"],
            num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv_heads"],
            vocab_size=shape["vocab"],
            tie_word_embeddings=shape["tied"],
        )
        with torch.device("meta"):
            return Qwen2ForCausalLM(config)

    # Every target's count from its config equals transformers' model's (tied weights counted once).
    for name, shape in bench.QWEN25.items():
        model = meta_model(shape)
        assert bench.shape_params(shape) == sum(p.numel() for p in model.parameters()), name
    small = bench.QWEN25["Qwen2.5-0.5B"]
    assert bench.shape_params(small) == 494_032_768
    # LoRA r=8 on every linear layer but the head: peft's own count on the meta model.
    adapters = get_peft_model(meta_model(small), LoraConfig(r=8, target_modules="all-linear"))
    assert bench.lora_params(small, 8) == sum(p.numel() for p in adapters.parameters() if p.requires_grad)

    # The split through two depths, and a shape's activations from it.
    # The larger growth per layer is the forward's (1000 a layer), a(2) the backward's (3000).
    slopes_at = {4: {"forward": 4800.0, "backward": 4600.0}, 2: {"forward": 2800.0, "backward": 3000.0}}
    split = bench.split_activations(slopes_at, hidden=100, vocab=400)
    assert split == {
        "activation_bytes_per_token_per_layer": 1000.0,
        "activation_bytes_per_token_fixed": 1000.0,
        "activation_bytes_per_token_per_layer_per_hidden": 10.0,
        "activation_bytes_per_token_fixed_per_vocab": 2.5,
    }
    measured = {"hidden": 100, "intermediate": 400}  # MLP ratio 4
    wide = {"hidden": 200, "intermediate": 1600, "layers": 3, "vocab": 1000}  # MLP ratio 8: twice
    assert bench.mlp_factor(wide, measured) == 2.0
    assert bench.mlp_factor({**wide, "intermediate": 400}, measured) == 1.0  # narrower MLP: the width bounds
    assert bench.shape_activation(split, wide, measured) == 2.5 * 1000 + 3 * 10.0 * 200 * 2
    # With checkpointing: the head's part from the row without it, each layer's input and the recomputed
    # layer's copy of its own, and the recomputed layer as the row without keeps it.
    checkpointed = {**split, "activation_bytes_per_token_per_layer_per_hidden": 0.5}
    assert (
        bench.shape_activation(checkpointed, wide, measured, split) == 2.5 * 1000 + (4 * 0.5 + 10.0) * 200 * 2
    )


def test_fit_line() -> None:
    assert bench.fit_line([(128, 1000.0), (512, 1768.0), (256, 1256.0)]) == pytest.approx((744.0, 2.0))
    with pytest.raises(ValueError, match="two different"):
        bench.fit_line([(128, 1.0), (128, 2.0)])


def test_arguments(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--layers", "2"])  # --out is required
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path / "x.json"), "--batch-sizes", "4"])  # no fit from one point
