"""``kvctl demo --help`` says what kv-stack does: the options it names are kv-stack's and the
stack it describes (two engines behind kv-router) is the one kv-stack starts by default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvctl.main import main as kvctl_main
from stack.__main__ import _parser as stack_parser
from stack.launcher import StackConfig


def test_demo_help_matches_the_stack(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        kvctl_main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())
    named = set(re.findall(r"--[a-z][a-z-]+", text)) - {"--help"}
    known = {flag for action in stack_parser()._actions for flag in action.option_strings}
    assert named and named <= known, named - known
    assert "two engines" in text and "kv-router" in text and "joins" not in text
    policies = next(a.choices for a in stack_parser()._actions if "--policy" in a.option_strings)
    assert f"--policy{'|'.join(policies or [])}" in "".join(out.split())  # argparse wraps at hyphens
    assert stack_parser().parse_args(["demo"]).engines == 2 == StackConfig(run_dir=Path("run")).num_engines
