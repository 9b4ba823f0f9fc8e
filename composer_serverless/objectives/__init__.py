"""What an inner step optimises: the ``Objective`` protocol the replica loop calls (``objective.py``), the
causal-LM objective (``lm.py``), and the three-channel composer objective (``composer.py``) with its
rollouts, rewards, code sandbox, SDPO hints, preference pairs and live-harvest schedule. A run's inputs are
checked here before launch (``inputs.py``).

Nothing here imports a cloud SDK or the replica loop: an objective sees the replica's ranks only through
the ``Ranks`` protocol.
"""
