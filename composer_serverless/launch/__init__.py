"""The control plane of one run: validate the config, create the run in the store, plan, launch, watch and
report (``launcher.py``, ``watch.py``, ``report.py``); supervise its replicas (``supervisor.py``); operate on a
run by its URL (``runs.py``: status, logs, cancel); and grids of runs (``sweep.py``). Nothing here imports the
training stack: what needs it runs in a child process or in the replicas."""
