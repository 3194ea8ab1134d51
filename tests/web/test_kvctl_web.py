"""``kvctl web`` on a log recorded from a real run (offloadd, synthetic engines, kv-bridge,
``kvctl record``), checked in headless Chromium against the reducer's own state."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from events.codec_jsonl import load_records
from events.schema import LogRecord
from events.state import CacheState
from kvctl.main import main as kvctl
from offloadd.client import OffloadClient
from tests.support.bridge_proc import REPO_ROOT, BridgeProcess
from tests.support.offloadd_proc import DaemonProcess
from tests.support.redis_proc import RedisProcess
from tests.support.synthetic_engine import SLOT, SyntheticPublisher, SyntheticStorer
from tests.web.browser import Chromium, Dom, png_check
from tests.web.devtools import Page

NAMESPACE = "kvctl-web"


@dataclass
class Recording:
    path: Path
    records: list[LogRecord]

    def state_at(self, offset: int) -> CacheState:
        state = CacheState()
        for r in self.records:
            if r.offset <= offset:
                state.apply(r)
        return state


def _wait(cond: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def recording(redis_server: RedisProcess, tmp_path_factory: pytest.TempPathFactory) -> Recording:
    """Two engines' GPU tiers and a storer filling a 40-slot CPU tier (so it evicts), through the
    daemon's log and the bridge, recorded to a file by ``kvctl record``."""
    work = tmp_path_factory.mktemp("kvctl-web")
    daemon = DaemonProcess(work / "d", redis_server.url, NAMESPACE, capacity_bytes=40 * SLOT)
    bridge = BridgeProcess(redis_server.url, work / "bridge", "--start", "beginning",
                           namespace=NAMESPACE)
    pubs: list[SyntheticPublisher] = []
    daemon.start()
    try:
        bridge.start()
        pubs = [SyntheticPublisher(daemon.target, f"engine-{x}", incarnation=2, seed=k,
                                   max_batches=25, pause_s=0.002) for k, x in enumerate("ab")]
        storer = SyntheticStorer(daemon.target, "engine-c", chain_len=4, max_chains=16, pause_s=0.002)
        for p in pubs:
            p.start()
        storer.start()
        _wait(lambda: storer.stats.stores >= 16 and all(p.submitted >= 25 for p in pubs), 30, "engines")
        storer.stop()
        for p in pubs:
            p.stop()
        assert all(p.stream.flush(20) for p in pubs)
        with OffloadClient(daemon.target) as client:
            batches = sum(1 for r in client.subscribe(1) if r.events)
        out = work / "recorded.jsonl"
        rec = subprocess.run(
            [sys.executable, "-m", "kvctl", "record", "--pub", bridge.pub, "--replay", bridge.replay,
             "--from-seq", "0", "--count", str(batches), "--out", str(out)],
            capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
        )
        assert rec.returncode == 0, rec.stderr
    finally:
        for p in pubs:
            p.stop()
            p.close()
        bridge.stop()
        daemon.stop()
    with out.open() as fp:
        records = list(load_records(fp))
    assert len(records) == batches >= 60
    return Recording(out, records)


@contextmanager
def kvctl_web(path: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``kvctl web PATH --port 0`` as a process; yields the URL it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "kvctl", "web", str(path), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        serving = proc.stdout.readline()
        assert serving.startswith("kvctl: serving http://127.0.0.1:"), (first, serving, proc.stderr)
        yield serving.split()[2], proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _tiers(dom: Dom, table: str, kind: str) -> dict[tuple[str, str, int], object]:
    return {(r.attrs["data-source"], r.attrs["data-medium"], int(r.attrs["data-group"])): r
            for r in dom.by_id(table).all("tr", kind)}


def _check_state(dom: Dom, rec: Recording, at: int) -> CacheState:
    state = rec.state_at(at)
    assert dom.text("offset") == str(at)
    assert dom.by_id("status").attrs.get("data-ready") == "1", dom.text("status")
    chains: dict[tuple[str, str, int], int] = {}
    for src in state.export().sources:
        for e in src.events:
            key = (src.source, e.medium, e.group_idx)
            chains[key] = chains.get(key, 0) + 1
    rows = _tiers(dom, "state", "tier")
    assert set(rows) == set(state.counts())
    for key, n in state.counts().items():
        row = rows[key]
        assert row.cell("blocks") == str(n), key  # type: ignore[attr-defined]
        assert row.cell("chains") == str(chains[key]), key  # type: ignore[attr-defined]
    for medium, box in (("GPU", "total-gpu"), ("CPU", "total-cpu")):
        assert dom.text(box) == str(sum(n for (_, m, _), n in state.counts().items() if m == medium))
    last = max((r for r in rec.records if r.offset <= at), key=lambda r: r.offset)
    assert dom.text("record").startswith(f"record {last.offset}: {last.source} ")
    return state


def _check_diff(dom: Dom, before: CacheState, after: CacheState) -> int:
    expect = _changes(before, after)
    rows = _tiers(dom, "diff", "change")
    got = {k: (int(r.cell("added")[1:]), int(r.cell("removed")[1:]))  # type: ignore[attr-defined]
           for k, r in rows.items()}
    assert got == expect
    return sum(rem for _, rem in expect.values())


def test_kvctl_web_shows_state_at_offsets_and_diffs(recording: Recording, tmp_path: Path) -> None:
    browser = Chromium(tmp_path / "chromium")
    offsets = [r.offset for r in recording.records]
    last, mid = offsets[-1], offsets[len(offsets) // 2]
    early = _offset_with_removals(recording)
    cpu_source = next(s for (s, m, _) in recording.state_at(last).counts() if m == "CPU")
    with kvctl_web(recording.path) as (url, proc):
        pinned = browser.dom(f"{url}?at={mid}&a={early}&b={last}&source={cpu_source}")
        default = browser.dom(url)  # the slider at the end, diff from the start following it
        shot = tmp_path / "kvctl-web.png"
        browser.screenshot(f"{url}?at={mid}&a={early}&source={cpu_source}", shot, 1400, 900)
        with urllib.request.urlopen(url + "api/log", timeout=5) as resp:
            summary = json.loads(resp.read())
        errors = {}
        for query in (f"state?at={last + 1}", "state?at=x", f"diff?a={last}&b={early}",
                      f"state?at={mid}&source=nobody"):
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(f"{url}api/{query}", timeout=5)
            assert caught.value.code == 400
            errors[query] = json.loads(caught.value.read())["error"]["message"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    assert png_check(shot) == (1400, 900)

    assert (summary["start"], summary["last"], summary["records"]) == (0, last, len(offsets))
    assert pinned.by_id("slider").attrs["max"] == str(last)
    state = _check_state(pinned, recording, mid)
    chains = pinned.by_id("chains").all("tr", "chain")
    tiers = state.export().sources
    assert len(chains) == min(100, sum(len(s.events) for s in tiers if s.source == cpu_source))
    assert pinned.text("chains-source") == cpu_source
    assert "selected" in _tiers(pinned, "state", "tier")[(cpu_source, "CPU", 0)].classes  # type: ignore[attr-defined]
    removed = _check_diff(pinned, recording.state_at(early), recording.state_at(last))
    assert removed > 0, "the recorded run evicts: the diff has removals"
    assert pinned.text("diff-summary").startswith(f"offset {early} \u2192 {last}: +")

    _check_state(default, recording, last)
    assert default.by_id("slider").attrs["min"] == "0"
    _check_diff(default, CacheState(), recording.state_at(last))

    assert list(errors.values()) == [
        f"offset {last + 1} is beyond the end of the log (last offset {last})",
        "at: Input should be a valid integer, unable to parse string as an integer",
        f"A ({last}) must not be after B ({early})",
        f"no source 'nobody' at offset {mid} (known: {', '.join(recording.state_at(mid).sources())})",
    ]


def test_kvctl_web_bad_input_is_one_line(
    recording: Recording, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(recording.path.read_text().splitlines()[0] + "\n{not json\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    cases = {
        str(tmp_path / "missing.jsonl"): "no such file: ",
        str(bad): "line 2: JSON is malformed",
        str(empty): "the log is empty: nothing to show",
    }
    try:
        for path, message in cases.items():
            assert kvctl(["web", path, "--port", "0"]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"kvctl: error: {message}"), err
            assert err.count("\n") == 1
        assert kvctl(["web", str(recording.path), "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert err == f"kvctl: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
        assert kvctl(["web", str(recording.path), "--port", "70000"]) == 2
        assert "--port must be in 0..65535" in capsys.readouterr().err
    finally:
        busy.close()


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        body: dict[str, Any] = json.loads(resp.read())
        return body


def test_kvctl_web_on_the_redis_log_shows_what_the_recording_shows(
    recording: Recording, redis_server: RedisProcess,
) -> None:
    """The same run read from the daemon's log in Redis (fenced) has the recording's tiers at
    the recording's last offset, and after it the engines' goodbyes (their GPU tiers cleared)."""
    recorded_last = recording.records[-1].offset
    views = []
    for log in (str(recording.path), redis_server.url):
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", "web", log, "--namespace", NAMESPACE, "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        try:
            assert proc.stdout is not None
            proc.stdout.readline()
            url = proc.stdout.readline().split()[2]
            views.append((_get(url + "api/log"), _get(f"{url}api/state?at={recorded_last}"),
                          _get(f"{url}api/state?at={_get(url + 'api/log')['last']}")))
            with pytest.raises(urllib.error.HTTPError) as unknown:  # the API's error shape here too
                _get(url + "api/nothing")
            assert unknown.value.code == 404
            assert json.loads(unknown.value.read()) == {"error": {"message": "Not Found",
                                                                  "type": "invalid_request_error"}}
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0

    def tiers(state: dict[str, Any]) -> dict[str, Any]:
        return {s["source"]: s["tiers"] for s in state["sources"]}

    (_, from_file, _), (redis_log, from_redis, redis_end) = views
    assert tiers(from_file) == tiers(from_redis) and tiers(from_file)
    fences = {s["source"]: s["fence"] for s in from_redis["sources"]}
    assert fences["engine-a"] == [2, 25]  # the log's fence: incarnation 2, its 25 batches
    assert redis_log["last"] > recorded_last
    assert tiers(redis_end)["engine-a"] == [] and tiers(redis_end)["engine-b"] == []


def test_the_slider_keys_and_buttons_drive_the_page(recording: Recording, tmp_path: Path) -> None:
    """Through the DevTools protocol: arrow keys on the focused slider (the browser moves it and
    fires its events), 'A = here', Home/End and a click on a tier row."""
    offsets = [r.offset for r in recording.records]
    mid, last = offsets[len(offsets) // 2], offsets[-1]
    rows_js = ("Array.from(document.querySelectorAll('#state tr.tier')).map(r => [r.dataset.source,"
               " r.dataset.medium, Number(r.dataset.group), Number(r.querySelector('.blocks').textContent)])")
    diff_js = ("Array.from(document.querySelectorAll('#diff tr.change')).map(r => [r.dataset.source,"
               " r.dataset.medium, Number(r.dataset.group), r.querySelector('.added').textContent,"
               " r.querySelector('.removed').textContent])")

    def at(page: Page, offset: int) -> None:
        page.wait_for(f"document.getElementById('offset').textContent === '{offset}'")
        counts = recording.state_at(offset).counts()
        assert sorted(tuple(r) for r in page.eval(rows_js)) == sorted((*k, n) for k, n in counts.items())

    with kvctl_web(recording.path) as (url, _proc), Page(tmp_path / "devtools") as page:
        page.goto(f"{url}?at={mid}")
        page.wait_for("document.getElementById('status').dataset.ready === '1'")
        at(page, mid)
        page.eval("document.getElementById('slider').focus()")
        for _ in range(2):
            page.press("ArrowRight")
        at(page, mid + 2)
        page.eval("document.getElementById('set-a').click()")
        for _ in range(5):
            page.press("ArrowRight")
        at(page, mid + 7)
        # The diff of each step lands on its own (the click's A -> A first): wait for the last.
        summary = page.wait_for(f"(t => t.startsWith('offset {mid + 2} \u2192 {mid + 7}: ') && t)"
                                "(document.getElementById('diff-summary').textContent)")
        changes = _changes(recording.state_at(mid + 2), recording.state_at(mid + 7))
        assert sorted(tuple(r) for r in page.eval(diff_js)) == sorted(
            (*k, f"+{a}", f"\u2212{r}") for k, (a, r) in changes.items())
        assert summary.startswith(f"offset {mid + 2} \u2192 {mid + 7}: +{sum(a for a, _ in changes.values())} ")
        page.press("Home")
        at(page, 0)
        assert page.eval("document.getElementById('state-empty').hidden") is False
        assert page.text("record") == "before the first record"
        page.press("End")
        at(page, last)
        cpu = page.eval("document.querySelector('#state tr.tier[data-medium=CPU]').dataset.source")
        page.eval("document.querySelector('#state tr.tier[data-medium=CPU]').click()")
        page.wait_for(f"document.getElementById('chains-source').textContent === {json.dumps(cpu)}")
        chains = page.wait_for("document.querySelectorAll('#chains tr.chain').length")
        assert chains == sum(len(s.events) for s in recording.state_at(last).export().sources
                             if s.source == cpu)
        assert page.eval("location.search").startswith(f"?at={last}&a={mid + 2}&b={last}&source=")
        assert page.errors == []  # no uncaught exception in the page


def _offset_with_removals(rec: Recording) -> int:
    """The offset before the last whose state has the most blocks gone by the end. Which offsets
    those are depends on how the engines' and the storer's batches interleaved, so it is looked up
    in the recording rather than fixed (a fixed fifth of the log held none once, on a loaded run)."""
    final = rec.state_at(rec.records[-1].offset).view()
    state, best, best_at = CacheState(), 0, -1
    for r in rec.records[:-1]:
        state.apply(r)
        gone = sum(len(blocks - final.get(k, set())) for k, blocks in state.view().items())
        if gone > best:
            best, best_at = gone, r.offset
    assert best > 0, "the recorded run evicts (40 CPU slots, 64 blocks stored): some block is removed"
    return best_at


def _changes(before: CacheState, after: CacheState) -> dict[tuple[str, str, int], tuple[int, int]]:
    va, vb = before.view(), after.view()
    out = {k: (len(vb.get(k, set()) - va.get(k, set())), len(va.get(k, set()) - vb.get(k, set())))
           for k in va.keys() | vb.keys()}
    return {k: v for k, v in out.items() if v != (0, 0)}
