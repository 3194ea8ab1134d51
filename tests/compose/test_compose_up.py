"""`docker compose up` for real (marker ``compose``; .ci/run runs it after the main suite, alone:
scripts/compose-test). A private dockerd (tests/compose/dockerd.py), a base image from Debian
packages (scripts/compose-base-image, cached), the project's image built from its own Dockerfile
(BASE_IMAGE and TORCH_INDEX as build arguments), the project's compose.yaml with the CI override
of stack.py, `up --wait`; then real traffic (drive.py: Generate with shared prefixes, CPU-tier
hits, a subscriber on the bridge), kvctl inside the image; `down -v` leaves no container, network
or volume, and the daemon stops by its PID leaving no process or mount. Skips only where no
Docker daemon can start. Every container's log is printed when something fails."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.compose.dockerd import Dockerd, DockerdUnavailable, start_dockerd
from tests.compose.stack import Compose, ci_override
from tests.compose.wheel_index import serve_index, torch_wheelhouse

pytestmark = [pytest.mark.compose, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KVO_CACHE") or Path.home() / ".cache" / "kvoffload")
TORCH = "torch==2.13.0"  # as the Dockerfile pins it
GPU_BLOCKS = 16  # KV_GPU_BLOCKS: a GPU tier small enough that prefixes fall to the CPU tier
REDIS_URL = "redis://redis:6379/0"  # as compose.yaml gives it to offloadd


def _say(config: pytest.Config, text: str) -> None:
    """Print past pytest's capture: progress of a long run, and the logs when it fails."""
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(text, file=sys.stderr, flush=True)


def _script(name: str, *args: str, timeout_s: float) -> list[str]:
    """Run scripts/NAME; its output lines (the last one is what it made)."""
    res = subprocess.run(["bash", str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                         timeout=timeout_s, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"scripts/{name} failed:\n{res.stderr[-4000:]}"
    return res.stdout.strip().splitlines()


@dataclass(frozen=True)
class Tools:
    docker: str
    docker_config: Path  # the private DOCKER_CONFIG with the Compose v2 plugin


@contextmanager
def _daemon(run_name: str, *, own_netns: bool) -> Iterator[Dockerd]:
    """A private dockerd on the cached data root; stopped by PID, nothing left, at the end."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"kvo-{run_name}-", dir="/tmp"))  # short: a socket path
    try:
        dockerd = start_dockerd(run_dir, CACHE / "docker", own_netns=own_netns)
    except DockerdUnavailable as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        pytest.skip(f"no Docker daemon can start here: {exc}")
    try:
        yield dockerd
    finally:
        leftovers = dockerd.stop()
    assert not leftovers, f"the daemon left these behind: {leftovers}"
    assert not run_dir.exists()


@pytest.fixture(scope="module")
def tools() -> Iterator[Tools]:
    if os.geteuid() != 0:
        pytest.skip("no Docker daemon can start: dockerd needs root")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "compose.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the data root in CACHE is one run's at a time
        try:
            docker_config = Path(_script("compose-setup", str(CACHE), timeout_s=900)[-1])
        except AssertionError as exc:
            if shutil.which("dockerd") is None:
                pytest.skip(f"no Docker daemon can start: docker.io could not be installed: {exc}")
            raise
        docker = shutil.which("docker")
        assert docker, "docker.io brings the docker CLI"
        yield Tools(docker, docker_config)


def _compose(tools: Tools, dockerd: Dockerd, *files: Path) -> Compose:
    env = {**dockerd.env(tools.docker_config), "KV_GPU_BLOCKS": str(GPU_BLOCKS),
           "COMPOSE_BAKE": "false"}  # no buildx here: Compose builds through the daemon's BuildKit
    return Compose(tools.docker, (ROOT / "compose.yaml", *files), env, ROOT)


def _clean(compose: Compose) -> None:
    """What an interrupted earlier run may have left in the cached data root."""
    for cid in compose.ids("container"):
        compose.docker_run("rm", "-f", "-v", cid)
    for vol in compose.ids("volume"):
        compose.docker_run("volume", "rm", "-f", vol)
    for net in compose.ids("network"):
        compose.docker_run("network", "rm", net)


@dataclass(frozen=True)
class Images:
    override: Path
    timings: dict[str, float]


@pytest.fixture(scope="module")
def images(tools: Tools, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Images:
    """The base image (made once, cached) and the project's image, built by `docker compose
    build` from its Dockerfile on a daemon on the machine's network."""
    work = tmp_path_factory.mktemp("compose")
    services: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    base_tar = Path(_script("compose-base-image", str(CACHE), timeout_s=1800)[-1])
    timings["base image"] = time.monotonic() - t0
    base = f"kvoffload-ci-base:{base_tar.stem.removeprefix('base-')}"
    override = work / "compose.ci.yaml"
    with _daemon("build", own_netns=False) as dockerd:
        compose = _compose(tools, dockerd, override)
        _clean(compose)
        t1 = time.monotonic()
        if not compose.docker_run("images", "-q", base).stdout.strip():
            changes = _script("compose-base-image", "--changes", timeout_s=30)
            compose.docker_run("import", *[a for c in changes for a in ("--change", c)], str(base_tar), base,
                               timeout_s=600)
        with serve_index(torch_wheelhouse(CACHE, TORCH), work / "index") as torch_index:
            override.write_text(ci_override(services, base, {"BASE_IMAGE": base, "TORCH_INDEX": torch_index}))
            _say(request.config, f"[compose] building the image (base {base}, torch from {torch_index})")
            built = next(n for n, s in services.items() if "build" in s and "profiles" not in s)
            res = compose.run("build", built, timeout_s=2400, check=False)
            if res.returncode != 0:
                _say(request.config, f"[compose] build failed:\n{res.stdout[-20000:]}\n{res.stderr[-5000:]}")
            assert res.returncode == 0, "docker compose build failed (its output is above)"
        compose.docker_run("image", "prune", "-f")  # the previous build's image, now untagged
        compose.docker_run("builder", "prune", "-f", "--keep-storage", "3gb")  # bound the cache
        timings["build"] = time.monotonic() - t1
    return Images(override, timings)


@dataclass(frozen=True)
class Stack:
    compose: Compose
    netns: str  # the stack's network namespace, where compose.yaml's published ports are


@pytest.fixture(scope="module")
def stack(tools: Tools, images: Images, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """`up --wait` on a daemon in its own network namespace; `down -v` after the tests, and
    nothing left: no container, network or volume, no process, no mount."""
    config = request.config
    timings = dict(images.timings)
    with _daemon("stack", own_netns=True) as dockerd:
        compose = _compose(tools, dockerd, images.override)
        _clean(compose)
        failed_before = request.session.testsfailed
        try:
            t0 = time.monotonic()
            _say(config, "[compose] up --wait")
            compose.run("up", "--detach", "--wait", "--wait-timeout", "300", "--no-build", timeout_s=420)
            timings["up --wait"] = time.monotonic() - t0
            yield Stack(compose, dockerd.netns)
        except BaseException:
            _say(config, f"[compose] FAILED; the stack as it was:\n{compose.dump()}\n[dockerd]\n{dockerd.log_tail()}")
            raise
        finally:
            if request.session.testsfailed > failed_before:
                _say(config, f"[compose] a test failed; the stack as it was:\n{compose.dump()}")
            t1 = time.monotonic()
            compose.run("down", "--volumes", "--timeout", "20", timeout_s=300)
            timings["down -v"] = time.monotonic() - t1
            _say(config, "[compose] " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
        left = {kind: compose.ids(kind) for kind in ("container", "volume", "network")}
        assert left == {"container": [], "volume": [], "network": []}, f"down -v left {left}"


def test_compose_v2_takes_the_users_file_as_it_is(tools: Tools) -> None:
    """What users run, every profile on: Compose v2 itself parses and interpolates compose.yaml,
    and the images not built here are the official ones (nothing of the CI override)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KV_")}
    res = subprocess.run([tools.docker, "compose", "-f", str(ROOT / "compose.yaml"), "--profile", "*",
                          "config", "--format", "json"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**env, "DOCKER_CONFIG": str(tools.docker_config)})
    assert res.returncode == 0, res.stderr
    services = json.loads(res.stdout)["services"]
    assert {"redis", "offloadd", "kv-bridge", "model-init", "engine"} <= set(services)
    for name, svc in services.items():
        if "build" in svc:
            assert svc["image"].startswith("kvoffload:"), name
            assert "BASE_IMAGE" not in (svc["build"].get("args") or {}), f"{name}: users get the default base"
        else:
            assert "/" not in svc["image"].split(":")[0], f"{name}: {svc['image']} is not an official image"


def test_every_service_is_up_and_healthy(stack: Stack) -> None:
    out = stack.compose.run("ps", "--all", "--format", "json").stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    state = {r["Service"]: (r["State"], r.get("Health", ""), r.get("ExitCode", 0)) for r in rows}
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for name, svc in services.items():
        if "profiles" in svc:
            assert name not in state, f"{name} is in a profile: not started by a plain up"
        elif name == "model-init":
            assert state[name][0] == "exited" and state[name][2] == 0, state[name]
        else:
            assert state[name][0] == "running", f"{name}: {state[name]}"
            if "healthcheck" in svc:
                assert state[name][1] == "healthy", f"{name}: {state[name]}"
    uid = stack.compose.run("exec", "-T", "engine", "id", "-u").stdout.strip()
    assert uid == "1000", "the engine runs as the image's user, not root"


def test_generate_with_shared_prefixes_hits_the_cpu_tier(stack: Stack) -> None:
    res = subprocess.run(
        ["nsenter", f"--net={stack.netns}", sys.executable, "-m", "tests.compose.drive",
         "--num-gpu-blocks", str(GPU_BLOCKS)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr[-4000:]
    seen = json.loads(res.stdout)
    prefix = 6 * 16
    assert seen["a"]["gpu"] == seen["a"]["cpu"] == 0, seen["a"]  # cold
    assert seen["b"]["gpu"] >= prefix and seen["b"]["cpu"] == 0, seen["b"]  # shared prefix, GPU tier
    again = seen["a_again"]
    assert again["cpu"] >= prefix and again["gpu"] + again["cpu"] < again["prompt"], again  # back from offloadd
    sub = seen["subscriber"]
    assert sub["cpu_prefix_blocks"] >= 6, sub
    assert "offloadd/CPU" in sub["tiers"] and any(t.endswith("/GPU") for t in sub["tiers"]), sub
    assert sub["gaps"] == sub["lost"] == sub["malformed"] == 0, sub


def test_kvctl_in_the_image_reads_the_stacks_log(stack: Stack) -> None:
    verify = stack.compose.run("exec", "-T", "offloadd", "kvctl", "verify", "--json", REDIS_URL, check=False)
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-3000:]
    stats = stack.compose.run("exec", "-T", "offloadd", "kvctl", "stats", "--json", REDIS_URL)
    assert json.loads(stats.stdout), stats.stdout
    bad = stack.compose.run("exec", "-T", "offloadd", "kvctl", "stats", "redis://nowhere.invalid:6379/0", check=False)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr


def test_every_service_stops_gracefully_on_sigterm(stack: Stack) -> None:
    """Last: `docker compose stop` sends SIGTERM; every process exits 0 within the grace period
    (137 would be the SIGKILL after it)."""
    t0 = time.monotonic()
    stack.compose.run("stop", "--timeout", "30", timeout_s=300)
    took = time.monotonic() - t0
    rows = [json.loads(line) for line in stack.compose.run("ps", "--all", "--format", "json").stdout.splitlines() if line.strip()]
    codes = {r["Service"]: r.get("ExitCode") for r in rows}
    assert codes and all(code == 0 for code in codes.values()), f"exit codes after SIGTERM: {codes} ({took:.0f} s)"
