"""The project's compose.yaml run through Compose v2 (the `docker compose` CLI plugin) on a
private daemon, with a small CI override: the base image (tests/compose's debootstrap one) for
services of registry images (redis), and for our build BASE_IMAGE, torch from a local index
(TORCH_INDEX) and the host network (the build daemon has no bridge). Networks, ports and
service names are compose.yaml's own: the daemon that runs the stack lives in a network
namespace of its own (dockerd.py), so its bridge and published ports are that namespace's."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def ci_override(services: dict[str, Any], base_image: str, build_args: dict[str, str]) -> str:
    """The override as YAML text."""
    lines = ["# tests/compose: the CI override of compose.yaml (stack.py says why)", "services:"]
    for name, svc in services.items():
        lines.append(f"  {name}:")
        if "build" in svc:
            lines += ["    build:", "      network: host", "      args:"]
            lines += [f"        {k}: {json.dumps(v)}" for k, v in build_args.items()]
        else:
            lines.append(f"    image: {json.dumps(base_image)}")
            if name == "redis":
                lines.append("    working_dir: /data")  # where the official image runs it
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Compose:
    """`docker compose -f compose.yaml -f override ...` against one daemon."""

    docker: str
    files: tuple[Path, ...]
    env: dict[str, str]
    cwd: Path

    def run(self, *args: str, timeout_s: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [self.docker, "compose", "--progress", "plain"]
        for f in self.files:
            argv += ["-f", str(f)]
        return self.docker_run(*argv[1:], *args, timeout_s=timeout_s, check=check)

    def docker_run(self, *args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([self.docker, *args], cwd=self.cwd, env=self.env, capture_output=True,
                             text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        if check and res.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} -> {res.returncode}\n"
                                 f"{res.stdout[-6000:]}\n{res.stderr[-6000:]}")
        return res

    def ids(self, kind: str) -> list[str]:
        """Containers (all), volumes or networks the daemon has."""
        cmd = {"container": ["ps", "-aq"], "volume": ["volume", "ls", "-q"],
               "network": ["network", "ls", "--format", "{{.Name}}"]}[kind]
        out = self.docker_run(*cmd).stdout.split()
        return [n for n in out if kind != "network" or n not in ("host", "none")]

    def dump(self) -> str:
        """Everything that says what went wrong: ps, then every container's log."""
        parts = [self.run("ps", "-a", check=False).stdout]
        for cid in self.ids("container"):
            name = self.docker_run("inspect", "-f", "{{.Name}} {{.State.Status}} exit={{.State.ExitCode}}",
                                   cid, check=False).stdout.strip()
            logs = self.docker_run("logs", "--timestamps", "--tail", "200", cid, check=False)
            parts.append(f"----- {name} -----\n{logs.stdout}{logs.stderr}")
        return "\n".join(parts)
