"""Pure loss functions for the three channels: GRPO/DAPO, SDPO self-distillation, trace-replay DPO."""
