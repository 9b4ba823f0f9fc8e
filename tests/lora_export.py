"""What an exported LoRA run must be, whichever mode trained it (``composer-serverless export``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


def assert_merged_export(out: Path, base_dir: Path, length: int) -> PreTrainedModel:
    """``out`` holds a plain model (no LoRA weights) whose logits are the base's with the run's adapters
    (kept in ``out/adapter``, rank 4), and differ from the base's (the adapters trained): on random ids of
    ``length`` tokens. Returns the merged model."""
    from peft import PeftModel

    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 4
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(out / "adapter"))
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    ids = torch.randint(0, 300, (2, length))
    with torch.no_grad():
        logits = merged(input_ids=ids).logits
        torch.testing.assert_close(logits, adapted(input_ids=ids).logits, rtol=0, atol=1e-5)
        assert not torch.allclose(logits, base(input_ids=ids).logits, atol=1e-4)  # the adapters trained
    return merged
