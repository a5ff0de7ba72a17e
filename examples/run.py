"""The main job on the shipped example data: ``make run``.

Starts the example endpoint verifier (examples/service.py) on 127.0.0.1:8765, runs
``engine score`` over examples/rollouts.jsonl into out/rewards.jsonl, and stops the service.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PORT = 8765
STARTUP_SECONDS = 10.0


def wait_for_port(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"the example verifier service exited with code {process.returncode} (is port {port} taken?)")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"the example verifier service did not listen on 127.0.0.1:{port} within {STARTUP_SECONDS:g} s")


def main() -> int:
    service = subprocess.Popen([sys.executable, str(ROOT / "examples" / "service.py"), "--port", str(PORT)])
    try:
        wait_for_port(PORT, service)
        command = [
            sys.executable, "-m", "engine", "score", str(ROOT / "examples" / "rollouts.jsonl"),
            "-o", str(ROOT / "out" / "rewards.jsonl"), "--config", str(ROOT / "examples" / "engine.toml"),
        ]
        print("$ engine " + " ".join(command[3:]), flush=True)
        return subprocess.call(command)
    finally:
        service.terminate()
        service.wait(10)


if __name__ == "__main__":
    sys.exit(main())
