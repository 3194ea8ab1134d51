"""The router's fleet page (router.page) in headless Chromium, served by uvicorn from a real app."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from events.schema import LogRecord
from events.state import CacheState
from router.page import page_routes
from tests.support.bridge_proc import FleetSimulator
from tests.web.browser import Chromium, png_check
from tests.web.devtools import Page
from tests.web.server import serving

ENGINES = ("engine-a", "engine-b", "<b>engine-c</b>")  # the third: markup must stay text


class FleetStatus:
    """``status()`` in the router's shape: blocks per engine and tier from the one reducer over
    a simulated fleet's log; request counts that grow with every call, so the test can tell
    which poll the page shows."""

    def __init__(self) -> None:
        self.state = CacheState()
        sim = FleetSimulator(list(ENGINES[:2]), seed=5)
        for offset, (source, events, seq) in enumerate(sim.records(80), start=1):
            self.state.apply(LogRecord(offset, source, 1, seq, 1_700_000_000.0 + offset, tuple(events)))
        self.calls = 0

    def engine(self, k: int, name: str) -> dict[str, Any]:
        counts = self.state.counts()
        return {
            "name": name, "url": f"http://127.0.0.1:{9000 + k}", "healthy": k != 2,
            "in_flight": k, "gpu_blocks": counts.get((name, "GPU", 0), 0),
            "cpu_blocks": counts.get((name, "CPU", 0), 0), "requests": 10 * (k + 1) + self.calls,
            "cached_tokens": 0 if k == 2 else 150 * (k + 1),
            "prompt_tokens": 0 if k == 2 else 1000,
            "gpu_hit_tokens": 0 if k == 2 else 100 * (k + 1),
            "cpu_hit_tokens": 0 if k == 2 else 50 * (k + 1),
        }

    def __call__(self) -> dict[str, Any]:
        self.calls += 1
        decisions = [
            {"t": 1_700_000_000.5, "request_id": "req-1", "engine": "engine-a", "reason": "kv_match",
             "predicted_cached_tokens": 64, "cached_tokens": 64},
            {"t": 1_700_000_001.0, "request_id": "req-2", "engine": "engine-b", "reason": "kv_match",
             "predicted_cached_tokens": 32, "cached_tokens": 16},
            {"t": 1_700_000_001.5, "request_id": "req-3", "engine": "engine-a", "reason": "least_loaded",
             "predicted_cached_tokens": 0, "cached_tokens": 0},
            {"t": 1_700_000_002.0, "request_id": "req-4", "engine": "engine-b", "reason": "kv_match",
             "predicted_cached_tokens": 48, "cached_tokens": None},
        ]
        return {"policy": "kv", "event_rate": 1234.56,
                "engines": [self.engine(k, n) for k, n in enumerate(ENGINES)],
                "decisions": decisions}


def _app(status: Any) -> FastAPI:
    app = FastAPI()
    app.include_router(page_routes(status))
    return app


def test_fleet_page_shows_engines_tiers_decisions_and_keeps_polling(tmp_path: Path) -> None:
    status = FleetStatus()
    browser = Chromium(tmp_path / "chromium", budget_ms=3500)
    with serving(_app(status)) as base:
        dom = browser.dom(base + "?interval_ms=500")
        with urllib.request.urlopen(base + "api/fleet", timeout=5) as resp:
            assert resp.headers["Cache-Control"] == "no-store"
            assert json.loads(resp.read())["policy"] == "kv"
        shot = tmp_path / "fleet.png"
        browser.screenshot(base, shot, 1280, 800)
    assert png_check(shot) == (1280, 800)

    polls = int(dom.by_id("conn").attrs["data-polls"])
    assert polls >= 3, "the page polls api/fleet, not once"  # 3.5 s at 0.5 s
    assert dom.text("conn") == "live"
    assert dom.text("policy") == "kv"
    assert dom.text("event-rate") == "1234.6"
    assert dom.text("engines-healthy") == "2 of 3 healthy"
    rows = dom.by_id("engines").all("tr", "engine")
    assert [r.attrs["data-engine"] for r in rows] == list(ENGINES)
    counts = status.state.counts()
    for k, (row, name) in enumerate(zip(rows, ENGINES, strict=True)):
        assert row.cell("name") == name
        assert row.one("td", "gpu-blocks").one("span", "n").text() == str(counts.get((name, "GPU", 0), 0))
        assert row.one("td", "cpu-blocks").one("span", "n").text() == str(counts.get((name, "CPU", 0), 0))
        assert row.cell("in-flight") == str(k)
    a, b, c = rows
    assert counts[("engine-a", "GPU", 0)] > 0 and counts[("engine-b", "CPU", 0)] > 0
    assert (a.cell("gpu-hit"), a.cell("cpu-hit"), a.cell("cached")) == ("10.0%", "5.0%", "150 / 1000")
    assert (b.cell("gpu-hit"), b.cell("cpu-hit")) == ("20.0%", "10.0%")
    assert (c.cell("gpu-hit"), c.cell("healthy")) == ("-", "down")  # no prompts yet; unhealthy
    assert c.one("td", "name").all("b") == []  # shown as text, not parsed as markup
    # The page shows the poll it counted: the status function's call number `polls`.
    assert a.cell("requests") == str(10 + polls)
    assert dom.text("total-requests") == str(60 + 3 * polls)
    assert dom.text("total-gpu-blocks") == str(sum(n for (_, m, _), n in counts.items() if m == "GPU"))
    assert (dom.text("fleet-gpu-hit"), dom.text("fleet-cpu-hit")) == ("15.0%", "7.5%")

    decisions = dom.by_id("decisions").all("tr", "decision")
    assert [d.attrs["data-request"] for d in decisions] == ["req-4", "req-3", "req-2", "req-1"]
    assert [d.cell("agree") for d in decisions] == ["", "yes", "no", "yes"]
    assert [d.cell("reported") for d in decisions] == ["pending", "0", "16", "64"]
    assert "miss" in decisions[2].classes and "miss" not in decisions[1].classes
    assert decisions[3].cell("time") == "22:13:20.500"
    assert dom.text("agreement") == "2 of 3 (66.7%)"


def test_a_failing_status_is_an_error_the_page_shows(tmp_path: Path) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("bridge not reachable")

    with serving(_app(broken)) as base:
        try:
            urllib.request.urlopen(base + "api/fleet", timeout=5)
            raise AssertionError("a failing status answered 2xx")
        except urllib.error.HTTPError as exc:
            assert exc.code == 503
            assert json.loads(exc.read()) == {"error": {
                "message": "fleet status unavailable: bridge not reachable", "type": "unavailable"}}
        dom = Chromium(tmp_path / "chromium", budget_ms=1500).dom(base)
    assert dom.text("conn") == "disconnected: fleet status unavailable: bridge not reachable"
    assert "down" in dom.by_id("conn").classes
    assert dom.by_id("engines").all("tr", "engine") == []


def test_the_page_follows_the_fleet_as_it_changes(tmp_path: Path) -> None:
    """Through the DevTools protocol: the page, loaded once, shows an engine going down and a
    new routing decision within a few polls."""
    status = FleetStatus()
    down: set[str] = set()  # what the fleet does next
    extra: list[dict[str, Any]] = []

    def changing() -> dict[str, Any]:
        body = status()
        for e in body["engines"]:
            e["healthy"] = e["healthy"] and e["name"] not in down
        body["decisions"] += extra
        return body

    with serving(_app(changing)) as base, Page(tmp_path / "devtools") as page:
        page.goto(base + "?interval_ms=200")
        page.wait_for("document.getElementById('conn').textContent === 'live'")
        assert page.text("engines-healthy") == "2 of 3 healthy"
        down.add("engine-b")
        extra.append({"t": 1_700_000_003.0, "request_id": "req-5", "engine": "engine-a",
                              "reason": "engine_down_retry", "predicted_cached_tokens": 16,
                              "cached_tokens": 16})
        page.wait_for("document.getElementById('engines-healthy').textContent === '1 of 3 healthy'")
        assert page.eval("document.querySelector('tr.engine[data-engine=\"engine-b\"] td.healthy')"
                         ".textContent") == "down"
        first = page.wait_for("(r => r.dataset.request === 'req-5' && r.querySelector('.reason')"
                              ".textContent)(document.querySelector('#decisions tr.decision'))")
        assert first == "engine_down_retry"
        assert page.text("agreement") == "3 of 4 (75.0%)"
        assert page.errors == []  # no uncaught exception in the page
