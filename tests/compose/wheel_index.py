"""A PEP 503 simple index over a folder of wheels, served on loopback: the ``TORCH_INDEX`` the
image is built with here, where the PyTorch CPU index is out of reach but its CPU wheel (and what
it depends on) is on disk. The build runs on the host network, so it reaches this server."""

from __future__ import annotations

import functools
import html
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# A fixed port when free: the URL is a build argument, and a new one would rebuild torch's layer.
PORT = 29823


def torch_wheelhouse(cache: Path, requirement: str) -> Path:
    """The wheels of ``requirement`` and its dependencies, as pip here resolves them (the CPU
    build from local disk), downloaded once into ``cache``."""
    key = re.sub(r"[^A-Za-z0-9.]+", "-", requirement)
    out = cache / f"wheels-{key}"
    if not (out / ".complete").exists():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:",
                        "-d", str(out), requirement], check=True, timeout=900, capture_output=True)
        (out / ".complete").touch()
    return out


def _project(wheel: Path) -> str:
    """The normalized project name of a wheel file (PEP 503)."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-", 1)[0]).lower()


def write_index(wheels: Path, root: Path) -> Path:
    """root/simple/<project>/index.html linking root/files/<wheel>; returns root/simple."""
    simple = root / "simple"
    root.mkdir(parents=True, exist_ok=True)
    (root / "files").symlink_to(wheels.resolve(), target_is_directory=True)
    by_project: dict[str, list[str]] = {}
    for wheel in sorted(wheels.glob("*.whl")):
        by_project.setdefault(_project(wheel), []).append(wheel.name)
    if not by_project:
        raise ValueError(f"no wheels in {wheels}")
    for project, files in by_project.items():
        (simple / project).mkdir(parents=True)
        links = "".join(f'<a href="../../files/{html.escape(f)}">{html.escape(f)}</a>\n' for f in files)
        (simple / project / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    return simple


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _server(root: Path, port: int) -> ThreadingHTTPServer:
    handler = functools.partial(_QuietHandler, directory=str(root))
    try:
        return ThreadingHTTPServer(("127.0.0.1", port), handler)
    except OSError:
        return ThreadingHTTPServer(("127.0.0.1", 0), handler)


@contextmanager
def serve_index(wheels: Path, root: Path, port: int = PORT) -> Iterator[str]:
    """Serve the index of ``wheels`` on 127.0.0.1:``port`` (a free one if that is taken);
    yields its /simple/ URL."""
    write_index(wheels, root)
    server = _server(root, port)
    thread = threading.Thread(target=server.serve_forever, name="wheel-index", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
