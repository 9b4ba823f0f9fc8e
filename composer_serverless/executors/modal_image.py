"""What a Modal replica container is built from: the app's name, Python, torch, the pip requirements, retries.

Shared by the executor (which puts them in the plan, without the modal SDK) and the Modal app (which builds
the image from them in every container), so neither imports the other for them.
"""

from __future__ import annotations

APP_NAME = "composer-serverless"
PYTHON_VERSION = "3.11"
# The project's runtime dependencies plus its s3, hf and parquet extras. torch is installed before them, from PyTorch's
# index, as the build ``runtime.py`` names; pip then keeps it.
IMAGE_REQUIREMENTS = (
    "transformers>=5.0,<6",
    "tokenizers>=0.21",
    "torchft==0.2.0",
    "fsspec>=2025.1",
    "safetensors>=0.5",
    "pydantic>=2.6,<3",
    "typer>=0.15",
    "rich>=13",
    "numpy>=1.26",
    "matplotlib>=3.8",
    "psutil>=5.9",
    "peft>=0.17",
    "xxhash>=3.4",
    "httpx>=0.28",
    "blake3>=1.0",
    "s3fs>=2025.1",
    "boto3>=1.35.21",
    "huggingface_hub>=1.24",
    "datasets>=3",
    "pyarrow>=15",
)
RETRY_DELAY_S = 10.0
# How the launcher hands a run's shipment to ``modal_app`` as it imports it, and where the code lands.
SHIPMENT_ENV = "COMPOSER_SERVERLESS_MODAL_SHIPMENT"
REMOTE_CODE = "/root/composer-serverless-code"
