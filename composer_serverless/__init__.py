"""composer-serverless: DiLoCo training of Hugging Face causal LMs across serverless replicas.

Replicas never talk to each other: every H inner steps they exchange pseudo-gradients through an
object store (any fsspec URL) and apply a Nesterov outer step with torchft's ``DiLoCo``. See
``docs/architecture.md`` for the map of the package.
"""

__version__ = "0.1.0"
