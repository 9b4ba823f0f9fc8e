"""An OpenEnv environment server on loopback, built from openenv-core's own classes: an ``MCPEnvironment``
(its tools FastMCP tools, as OpenEnv's tool-calling environments are written) served by
``create_fastapi_app`` under uvicorn in a thread. The vault opens with the row's secret: ``open`` with the
right code ends the episode with reward 1; a wrong code raises (OpenEnv answers it as a tool error)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastmcp import FastMCP
from openenv.core.env_server import (
    CallToolAction,
    CallToolObservation,
    MCPEnvironment,
    Observation,
    State,
    create_fastapi_app,
)


class Vault(MCPEnvironment):
    """One vault per WebSocket session."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    events: Counter[str] = Counter()  # over all sessions of this process: sessions, resets, calls, closed

    def __init__(self) -> None:
        Vault.events["sessions"] += 1
        mcp = FastMCP("vault")
        self.secret = ""
        self.opened = False
        self.steps = 0

        @mcp.tool()
        def lookup(key: str) -> str:
            """Look a key up in the directory.

            Args:
                key: the key to look up
            """
            return {"vault": f"the code is {self.secret}"}.get(key, "unknown")

        @mcp.tool()
        def open(code: str) -> str:  # noqa: A001 (the tool's name, as the model calls it)
            """Try a code on the vault.

            Args:
                code: the code to try
            """
            if code != self.secret:
                raise ValueError("wrong code")
            self.opened = True
            return "open"

        super().__init__(mcp)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **row: Any) -> Observation:
        Vault.events["resets"] += 1
        self.secret, self.opened, self.steps = str(row.get("secret", "")), False, 0
        return Observation()

    async def step_async(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        observation = await super().step_async(action, timeout_s, **kwargs)
        if isinstance(action, CallToolAction):
            Vault.events["calls"] += 1
            self.steps += 1
            observation.done, observation.reward = self.opened, 1.0 if self.opened else 0.0
        return observation

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        raise ValueError(f"the vault takes tool calls only, not {type(action).__name__}")

    def close(self) -> None:
        Vault.events["closed"] += 1
        super().close()

    @property
    def state(self) -> State:
        return State(step_count=self.steps, opened=self.opened)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(port: int | None = None) -> Iterator[str]:
    """The vault served on loopback for the block; its URL."""
    port = port or free_port()
    app = create_fastapi_app(Vault, CallToolAction, CallToolObservation, max_concurrent_envs=64)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the OpenEnv test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()
