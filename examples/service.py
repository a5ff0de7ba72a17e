"""The example endpoint verifier: keyword coverage, served over HTTP on 127.0.0.1.

POST {"task": {"keywords": [...], ...}, "trajectory": ...} -> {"reward": <share of keywords mentioned>}.
Run it with ``python examples/service.py [--port 8765]``; it serves until interrupted.
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def text_of(trajectory: Any) -> str:
    if isinstance(trajectory, str):
        return trajectory
    if isinstance(trajectory, dict):
        return text_of(trajectory.get("content") or "")
    if isinstance(trajectory, list):
        return "\n".join(text_of(part) for part in trajectory)
    return ""


def coverage(task: dict[str, Any], trajectory: Any) -> float:
    keywords = [k.lower() for k in task["keywords"]]
    text = text_of(trajectory).lower()
    return sum(k in text for k in keywords) / len(keywords)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the engine's connection pool expects
    # TCP_NODELAY: the headers and the body go out in two writes, and with Nagle's algorithm on the
    # body waits for the client's delayed ACK of the headers, ~40 ms per request on a kept-alive connection
    disable_nagle_algorithm = True

    def do_POST(self) -> None:
        try:
            item = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
            status, body = 200, {"reward": coverage(item["task"], item["trajectory"])}
        except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
            status, body = 400, {"error": f"{type(exc).__name__}: {exc}"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the engine reports what matters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    ThreadingHTTPServer.request_queue_size = 1024  # the default backlog of 5 drops connections under load
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"keyword-coverage verifier listening on http://127.0.0.1:{args.port}/score", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
