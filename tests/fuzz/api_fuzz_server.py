"""A ``kvserve serve`` process on a tiny random model, for the API fuzzer's long runs.

A separate process, started the way users start the server (the same flags,
uvicorn's connection limits, ``gc.freeze``), so that a crash of the server is
told apart from one of the fuzzer, and a dead server can be started again.
The model is model_fixtures' tiny Llama with a chat template, and the
context is capped (``--max-model-len``), so that no generated request,
however large its ``max_tokens`` or ``n``, takes more than a moment.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from model_fixtures import TINY_CHAT_TEMPLATE, save_tiny_model, train_tiny_tokenizer

MODEL_NAME = "tiny"
# Short generations, and a KV pool small enough that n=8 over a few prompts preempts.
ENGINE_FLAGS = (
    "--dtype", "float32",
    "--block-size", "4",
    "--num-blocks", "256",
    "--max-model-len", "64",
)  # fmt: skip
_START_TIMEOUT_S = 180.0


def write_tiny_model(folder: Path) -> Path:
    """The tiny model, with its chat template saved beside the tokenizer."""
    tokenizer = train_tiny_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return save_tiny_model(folder, "llama", tokenizer)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class ServerProcess:
    """``kvserve serve`` on ``model_dir``, with ``api_keys`` (none: no key); its log in ``log_path``."""

    def __init__(self, model_dir: Path, api_keys: Sequence[str], log_path: Path) -> None:
        self.model_dir = model_dir
        self.api_keys = tuple(api_keys)
        self.log_path = log_path
        self.url = ""
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> ServerProcess:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "kvserve.entrypoints.openai"]
        argv += ["--model", str(self.model_dir), "--served-model-name", MODEL_NAME]
        argv += ["--port", str(port), "--log-level", "warning", *ENGINE_FLAGS]
        for key in self.api_keys:
            argv += ["--api-key", key]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self.is_healthy():
            if not self.is_running():
                raise RuntimeError(f"the server exited at start-up; see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start; see {self.log_path}")
            time.sleep(0.2)
        return self

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def is_healthy(self) -> bool:
        """The process runs and answers 200 on /health."""
        if not self.is_running():
            return False
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL); its exit code."""
        if self._process is None:
            return None
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        return self._process.returncode

    def log_tail(self, num_chars: int = 3000) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return text[-num_chars:]
