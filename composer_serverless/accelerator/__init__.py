"""Where a replica computes: the accelerator it was given (``device.py``), and a simulated one
(``simulated.py``) that lets the CPU test suite run the CUDA code path with CUDA's placement rules.

This module imports nothing heavy: the launcher side reads the environment variable names from here.
"""

ACCELERATOR_ENV = "COMPOSER_SERVERLESS_ACCELERATOR"
"""Set by an executor that gave the replica GPUs (to ``cuda``): a replica that then finds none stops with the
reason instead of training on the CPU of a GPU container that is billed as a GPU."""

SIMULATED_ENV = "COMPOSER_SERVERLESS_SIMULATED_ACCELERATOR"
"""Set (to ``1``) in a replica's environment, the replica runs on the simulated accelerator: for the tests."""
