"""The main job on the shipped example data: ``make run``.

Starts the example endpoint verifier (examples/service.py) on 127.0.0.1:8765, runs
``engine score`` over examples/rollouts.jsonl into out/rewards.jsonl, and stops the service.
The command is printed as it is run (the venv's ``engine``, which is not on the PATH until the
venv is activated), so it can be copied and run again.
"""

from __future__ import annotations

import shlex
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


def score_command() -> list[str]:
    """``engine score`` on the example data, as run from the repository's root: the ``engine`` script beside
    this interpreter (the venv's), or ``python -m engine`` when there is none (the package not installed)."""
    script = Path(sys.executable).parent / "engine"
    program = [str(script)] if script.is_file() else [sys.executable, "-m", "engine"]
    return [*program, "score", "examples/rollouts.jsonl", "-o", "out/rewards.jsonl", "--config", "examples/engine.toml"]


def shown(command: list[str]) -> str:
    """``command`` as a shell line, its program relative to the repository's root when it is inside it."""
    program = Path(command[0])
    if program.is_relative_to(ROOT):
        program = program.relative_to(ROOT)
    return shlex.join([str(program), *command[1:]])


def main() -> int:
    service = subprocess.Popen([sys.executable, str(ROOT / "examples" / "service.py"), "--port", str(PORT)])
    try:
        wait_for_port(PORT, service)
        command = score_command()
        print(f"$ {shown(command)}", flush=True)
        code = subprocess.call(command, cwd=ROOT)
        if Path(command[0]).name == "engine":
            where = Path(shown([str(Path(command[0]).parent)]))
            print(f"`engine` is {where / 'engine'}; `. {where / 'activate'}` puts it on your PATH", flush=True)
        return code
    finally:
        service.terminate()
        service.wait(10)


if __name__ == "__main__":
    sys.exit(main())
