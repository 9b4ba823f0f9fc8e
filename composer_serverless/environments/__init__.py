"""Agentic episodes: environments and tools the model acts on over many turns, and the episode loop.

Objectives call it (``objectives/rollout.py``); it imports no training loop. See ``protocol`` for the contract,
``tools`` for TRL's conventions (stateless tool functions, an environment class per episode),
``openenv`` for OpenEnv servers (one session per episode through OpenEnv's client), ``template`` for the
check that a chat template renders tools, ``parsing`` for
how a turn's tool calls are read, ``episodes`` for the loop and ``tensors`` for the loss's view of an episode.
"""
