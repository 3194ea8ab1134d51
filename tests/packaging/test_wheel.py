"""The wheel as a new user gets it: built from a copy of the tree (what git tracks or would
track, so no stale build/), installed into a fresh venv without extras, then with the extras the
Dockerfile installs. Every console script answers --help; the base install runs kvctl, kv-bridge,
offloadd and the subscriber without torch; and every command compose.yaml runs in the image
exists there. Module-scoped: one wheel, one venv (base first, then the extras), about a minute."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
BASE_SCRIPTS = ("kvctl", "kv-bridge", "offloadd")  # must work without any extra
ENGINE_HINT = "pip install 'kvoffload[engine]'"
TORCH = "torch==2.13.0"  # the CPU build on local disk; a plain "torch" pulls a CUDA build
# what compose's `sh -c` scripts may run besides our console scripts (all in python:3.11-slim)
SHELL_TOOLS = {"set", "umask", "test", "find", "chmod"}
PROBES = {"stack.healthcheck"}  # `python -m` modules compose runs as healthchecks: they return at once


@dataclass(frozen=True)
class Venv:
    root: Path

    def exe(self, name: str) -> Path:
        return self.root / "bin" / name

    def run(self, *argv: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        cmd = [str(a) for a in argv]
        cmd[0] = str(self.exe(cmd[0])) if self.exe(cmd[0]).exists() else cmd[0]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        # run from an empty directory: the checkout must not shadow the installed packages
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=self.root)

    def pip_install(self, *args: str | Path) -> None:
        res = self.run("python", "-m", "pip", "install", "-q", "--disable-pip-version-check", *args, timeout=600)
        assert res.returncode == 0, res.stderr[-4000:]


def _source_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def _dockerfile_lines(prefix: str) -> list[str]:
    return [ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.startswith(prefix)]


def _dockerfile_extras() -> list[str]:
    """The extras the image installs: its ``ARG EXTRAS=...`` default."""
    (line,) = _dockerfile_lines("ARG EXTRAS=")
    found = re.fullmatch(r"ARG EXTRAS=([a-z0-9_,-]+)", line)
    assert found, line
    return found.group(1).split(",")


def _requirements_command() -> list[str]:
    """The Dockerfile's command that lists the image's requirements from pyproject.toml
    (``RUN python -c '...' "$EXTRAS" > requirements.txt``), with its extras filled in."""
    (line,) = _dockerfile_lines("RUN python -c ")
    argv = shlex.split(line.removeprefix("RUN "))
    assert argv[3:] == ["$EXTRAS", ">", "requirements.txt"], argv
    return [*argv[:3], ",".join(_dockerfile_extras())]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for f in _source_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    return src


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check",
                          "-w", str(dist), str(source)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    (built,) = dist.glob("kvoffload-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh venv with the wheel and its base dependencies (from the index, through pip's cache)."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=120)
    env = Venv(root)
    env.pip_install(wheel)
    return env


def test_wheel_holds_every_module_and_the_protos(wheel: Path, source: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    include = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    want = set()
    data = PYPROJECT["tool"]["setuptools"].get("package-data", {})
    for f in (Path(p) for p in _source_files()):
        if f.parts[0] in include and (f.suffix == ".py" or _is_package_data(f, data)):
            want.add(f.as_posix())
        elif f.parts[:2] == ("proto", "kvcache") and f.suffix in (".py", ".proto", ".pyi"):
            want.add(Path(*f.parts[1:]).as_posix())
    assert {"kvcache/v1/events.proto", "kvcache/v1/events_pb2.pyi", "kvcache/v1/events_pb2.py"} <= want
    assert not want - names, f"missing from the wheel: {sorted(want - names)}"
    ours = {n for n in names if not n.startswith("kvoffload-")}
    assert not ours - want, f"in the wheel but not in the tree: {sorted(ours - want)}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    for name, target in SCRIPTS.items():
        assert f"{name} = {target}" in text


def _is_package_data(f: Path, data: dict[str, list[str]]) -> bool:
    """Whether pyproject's package-data ships ``f`` (a path in the tree, outside proto/)."""
    for package, globs in data.items():
        base = Path(*package.split("."))
        if f.is_relative_to(base) and any(f.relative_to(base).match(g) for g in globs):
            return True
    return False


def test_base_install_runs_without_torch(venv: Venv) -> None:
    assert venv.run("python", "-c", "import torch").returncode != 0, "the base install must not bring torch"
    for name in BASE_SCRIPTS:
        res = venv.run(name, "--help")
        assert res.returncode == 0, f"{name}: {res.stderr[-3000:]}"
    res = venv.run("python", "-c", "import events.subscriber, events.hashing")
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - set(BASE_SCRIPTS)))
def test_base_install_engine_scripts_work_or_say_what_to_install(venv: Venv, name: str) -> None:
    res = venv.run(name, "--help")
    assert "Traceback" not in res.stdout + res.stderr, res.stderr[-3000:]
    if res.returncode != 0:
        assert ENGINE_HINT in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.fixture(scope="module")
def image_venv(venv: Venv, wheel: Path, source: Path) -> Venv:
    """The same venv with what the Dockerfile installs, as it does: torch pinned first, then the
    requirements its own command lists from pyproject.toml, then the project without
    dependencies; pip check then says that list left nothing out."""
    venv.pip_install(TORCH)
    shutil.copy(source / "pyproject.toml", venv.root / "pyproject.toml")  # where the command runs
    listed = venv.run(*_requirements_command())
    (venv.root / "pyproject.toml").unlink()
    assert listed.returncode == 0, listed.stderr[-3000:]
    (venv.root / "requirements.txt").write_text(listed.stdout)
    venv.pip_install("-r", venv.root / "requirements.txt")
    venv.pip_install("--no-deps", f"{wheel}[{','.join(_dockerfile_extras())}]")
    check = venv.run("python", "-m", "pip", "check")
    assert check.returncode == 0, check.stdout[-3000:]
    return venv


def test_dockerfile_installs_the_engine_extra() -> None:
    assert "engine" in _dockerfile_extras()
    assert f"RUN pip install --index-url \"$TORCH_INDEX\" {TORCH}" in (ROOT / "Dockerfile").read_text()


def test_dockerfile_installs_dependencies_before_copying_the_sources() -> None:
    """A source change must not install the dependencies again: they are a layer of their own,
    before any COPY of a package; the project comes after the last, without dependencies."""
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    deps = lines.index("RUN pip install -r /tmp/requirements.txt")
    project = lines.index('RUN pip install --no-deps --no-build-isolation ".[$EXTRAS]" && pip check')
    copies = [i for i, ln in enumerate(lines) if ln.startswith("COPY ") and "--from=" not in ln]
    sources = [i for i in copies if not lines[i].startswith("COPY pyproject.toml")]
    assert deps < min(sources) and max(sources) < project, "dependencies, then the sources, then the project"
    # the requirements stage sees pyproject.toml alone; the image takes only its list from there
    assert lines[deps - 1] == "COPY --from=requirements /src/requirements.txt /tmp/requirements.txt"
    stage = lines[lines.index("FROM ${BASE_IMAGE} AS requirements"):lines.index("FROM ${BASE_IMAGE}")]
    assert [ln for ln in stage if ln.startswith("COPY")] == ["COPY pyproject.toml ./"]


def test_the_dockerfiles_requirements_are_pyprojects(source: Path) -> None:
    res = subprocess.run([sys.executable, *_requirements_command()[1:]], cwd=source, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    project = PYPROJECT["project"]
    want = [*PYPROJECT["build-system"]["requires"], *project["dependencies"],
            *(d for e in _dockerfile_extras() for d in project["optional-dependencies"][e])]
    assert res.stdout.splitlines() == want
    assert TORCH in want and any(d.startswith("grpcio==") for d in want)


def test_with_the_image_extras_every_script_answers_help(image_venv: Venv) -> None:
    for name in SCRIPTS:
        res = image_venv.run(name, "--help")
        assert res.returncode == 0, f"{name}: {res.stderr[-3000:]}"


def _compose_commands() -> list[tuple[str, list[str]]]:
    """(service, argv) of every command, entrypoint and healthcheck run in our image."""
    compose: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    out = []
    for name, svc in compose["services"].items():
        if "build" not in svc:
            continue  # redis: not our image
        for key in ("entrypoint", "command"):
            if key in svc:
                argv = svc[key]
                out.append((name, shlex.split(argv) if isinstance(argv, str) else list(argv)))
        test = svc.get("healthcheck", {}).get("test")
        if test:
            assert test[0] == "CMD", f"{name}: exec-form healthchecks only"
            out.append((name, list(test[1:])))
    return out


def _shell_commands(script: str) -> list[list[str]]:
    """Each simple command of a small sh script (lines split at ||, && and ;)."""
    cmds = []
    for line in script.splitlines():
        for part in re.split(r"\|\||&&|;", line.split("#", 1)[0]):
            words = shlex.split(part)
            if words:
                cmds.append(words)
    return cmds


def _check_command(env: Venv, wheel_names: set[str], service: str, argv: list[str]) -> None:
    exe = argv[0]
    if exe == "sh":
        assert argv[1] == "-c", f"{service}: {argv}"
        for words in _shell_commands(argv[2]):
            if words[0] == "exec":  # `exec CMD` runs CMD in the shell's place
                words = words[1:]
            if words[0] not in SHELL_TOOLS:
                _check_command(env, wheel_names, service, words)
        return
    if exe == "python":
        assert argv[1] == "-m", f"{service}: {argv}"
        module = argv[2]
        path = module.replace(".", "/")
        assert {f"{path}.py", f"{path}/__main__.py"} & wheel_names, f"{service}: {module} is not in the wheel"
        if module in PROBES:  # run it for real: nothing listens here, so it answers 1 (or 0 if something does)
            res = env.run(*argv, timeout=60)
            assert res.returncode in (0, 1) and "Traceback" not in res.stderr, f"{service}: {argv}: {res.stderr}"
        else:  # a process that runs until stopped (ingest.demo_engine): it imports and answers --help
            res = env.run(*argv[:3], "--help", timeout=60)
            assert res.returncode == 0, f"{service}: {module} --help: {res.stderr[-3000:]}"
        return
    assert exe in SCRIPTS, f"{service}: {exe} is not a console script of kvoffload"
    # the subcommand it uses exists: `kv-engine serve --help`
    sub = [a for a in argv[1:2] if not a.startswith("-") and "/" not in a]
    res = env.run(exe, *sub, "--help")
    assert res.returncode == 0, f"{service}: {exe} {sub}: {res.stderr[-3000:]}"


def test_every_command_compose_runs_is_in_the_image(image_venv: Venv, wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    commands = _compose_commands()
    assert {s for s, _ in commands} >= {"offloadd", "kv-bridge", "engine", "model-init"}
    for service, argv in commands:
        _check_command(image_venv, names, service, argv)
