"""List prices behind the plan's cost estimate, in USD per hour, and the hardware names each backend knows.

The tables double as the lists the config validates against: a GPU type or flavor missing here is rejected
before anything is launched, so a typo costs a second instead of a failed job. Prices change; a run can
override them (``executor.price_per_gpu_hour`` on Modal, ``executor.price_per_hour`` on HF Jobs).

Sources:

* Modal bills GPUs per second; the figures are those rates times 3600, GPU only (Modal also bills the
  container's CPU cores and memory, a few percent on top). T4, L4, L40S, A100-80GB and H100 were checked
  against a May 2026 price listing; A10, A100-40GB, H200 and B200 are Modal's last published per-second
  rates. ``A100`` is Modal's 40 GB A100 (Modal may place it on an 80 GB card at the same price); ``H100!``
  pins an H100 where plain ``H100`` may be upgraded to an H200 at H100 prices.
* Hugging Face Jobs bill per minute by flavor, only while a job is starting or running (not while it is
  scheduling): the Hub's jobs pricing page. The flavor names are ``huggingface_hub.JobHardware`` (a test keeps
  the two in sync).
"""

from __future__ import annotations

MODAL_GPU_PRICES: dict[str, float] = {
    "T4": 0.59,
    "L4": 0.80,
    "A10": 1.10,
    "A10G": 1.10,
    "L40S": 1.95,
    "A100": 2.10,
    "A100-40GB": 2.10,
    "A100-80GB": 2.50,
    "H100": 3.95,
    "H100!": 3.95,
    "H200": 4.54,
    "B200": 6.25,
}
"""USD per GPU-hour on Modal, by the GPU type string Modal's ``gpu=`` accepts."""

MODAL_CPU_CORE_PRICE = 0.0472
"""USD per physical CPU core-hour on Modal (its per-second rate, $0.0000131, times 3600): what a CPU-only
function, the decoupled syncer, is billed for its cores (Modal's ``cpu=`` counts physical cores)."""
MODAL_MEMORY_GIB_PRICE = 0.0080
"""USD per GiB-hour of memory on Modal (its per-second rate, $0.00000222, times 3600)."""

HF_FLAVOR_PRICES: dict[str, float] = {
    "cpu-basic": 0.01,
    "cpu-upgrade": 0.03,
    "cpu-performance": 1.90,
    "cpu-xl": 1.00,
    "t4-small": 0.40,
    "t4-medium": 0.60,
    "l4x1": 0.80,
    "l4x4": 3.80,
    "l40sx1": 1.80,
    "l40sx4": 8.30,
    "l40sx8": 23.50,
    "a10g-small": 1.00,
    "a10g-large": 1.50,
    "a10g-largex2": 3.00,
    "a10g-largex4": 5.00,
    "a100-large": 2.50,
    "a100x4": 10.00,
    "a100x8": 20.00,
    "h200": 5.00,
    "h200x2": 10.00,
    "h200x4": 20.00,
    "h200x8": 40.00,
    "rtx-pro-6000": 2.75,
    "rtx-pro-6000x2": 5.50,
    "rtx-pro-6000x4": 11.00,
    "rtx-pro-6000x8": 22.00,
}
"""USD per job-hour on Hugging Face Jobs, by flavor (the whole machine, all its GPUs)."""


def flavor_gpus(flavor: str) -> int:
    """GPUs of an HF Jobs flavor, from its name: ``cpu-*`` none, ``...x4`` four, any other one."""
    if flavor.startswith("cpu-"):
        return 0
    count = flavor.rsplit("x", 1)[-1]
    return int(count) if count.isdigit() else 1


GPU_MEMORY_GB: dict[str, int] = {
    "T4": 16,
    "L4": 24,
    "A10": 24,
    "A10G": 24,
    "L40S": 48,
    "A100": 40,
    "A100-40GB": 40,
    "A100-80GB": 80,
    "H100": 80,
    "H100!": 80,
    "H200": 141,
    "B200": 180,
    "RTX-PRO-6000": 96,
}
"""GB of memory of one GPU, by Modal GPU type (and the HF Jobs flavors' GPUs): the cards' published sizes.
Modal's ``A100`` may land on an 80 GB card; the 40 GB it promises is what counts."""

_HF_FLAVOR_FAMILIES = {
    "t4-": "T4",
    "l4x": "L4",
    "l40sx": "L40S",
    "a10g-": "A10G",
    "a100": "A100-80GB",  # the Hub's a100 flavors are 80 GB cards
    "h200": "H200",
    "rtx-pro-6000": "RTX-PRO-6000",
}


def flavor_gpu(flavor: str) -> str | None:
    """The GPU of an HF Jobs flavor (a ``GPU_MEMORY_GB`` key), None for a ``cpu-*`` flavor."""
    return next((gpu for prefix, gpu in _HF_FLAVOR_FAMILIES.items() if flavor.startswith(prefix)), None)
