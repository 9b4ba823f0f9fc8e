"""The torch build cloud replicas run: the version the project is tested with, built for a stated NVIDIA driver.

PyPI's Linux wheel of torch 2.13.0 is the CUDA 13.0 build, which needs an NVIDIA driver >= 580. PyTorch's own
wheel index has the same release built for CUDA 12.8 (``cu128``): it runs on drivers from 570.26 (the driver
CUDA 12.8 ships with) and on every GPU Modal and HF Jobs offer, Blackwell (B200) included, which needs CUDA
12.8 or newer. Both backends' images install exactly this build (``modal_app.py``; the HF Jobs command, and
``deploy/hf_jobs/Dockerfile``), the ``--dry-run`` plan shows it, and every replica logs the torch it runs.

The same version is what ``make test`` installs (``Makefile``) and what CI tests; a test holds the three equal.
"""

from __future__ import annotations

import shlex

TORCH_VERSION = "2.13.0"
CUDA_BUILD = "cu128"
CUDA_VERSION = "12.8"
DRIVER_FLOOR = "570.26"
TORCH_INDEX_URL = f"https://download.pytorch.org/whl/{CUDA_BUILD}"
TORCH_REQUIREMENT = f"torch=={TORCH_VERSION}"


def torch_build() -> dict[str, str]:
    """What a plan shows of the torch replicas run."""
    return {
        "torch": f"{TORCH_VERSION}+{CUDA_BUILD}",
        "cuda": CUDA_VERSION,
        "nvidia_driver": f">= {DRIVER_FLOOR}",
        "index_url": TORCH_INDEX_URL,
    }


def install_torch() -> str:
    """The shell command that installs this torch build (over whatever torch an image had)."""
    return (
        f"pip install --quiet --no-cache-dir {shlex.quote(TORCH_REQUIREMENT)} "
        f"--index-url {shlex.quote(TORCH_INDEX_URL)}"
    )
