"""The fleet page as kv-router serves it, fed by its real status: Redis, offloadd, kv-bridge, a
real engine (tiny random model) and kv-router as processes, requests through the official
``openai`` client, the page read in headless Chromium and checked against ``/status``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai

from tests.router.procs import Proc, get_json, routed_stack
from tests.web.browser import png_check
from tests.web.devtools import Page

DOC = "Document 3. The page shows where each request went and what it found cached there. " * 3


def _settled(front: Proc, requests: int) -> dict[str, Any]:
    """/status once every decision has its reported cached tokens and the GPU tier is seen."""
    deadline = time.monotonic() + 20
    while True:
        status: dict[str, Any] = get_json(f"{front.url}/status")[1]
        decisions = status["decisions"]
        if (len(decisions) == requests and all(d["cached_tokens"] is not None for d in decisions)
                and status["engines"][0]["gpu_blocks"] > 0):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.1)


def test_the_routers_fleet_page_shows_its_status(tmp_path: Path) -> None:
    with routed_stack(tmp_path, 1) as stack:
        front = stack.router
        client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="none", max_retries=0)
        for question in ("What is it?", "Who wrote it?", "Why?"):
            client.completions.create(model="tiny", prompt=DOC + question, max_tokens=2,
                                      temperature=0, extra_body={"ignore_eos": True})
            time.sleep(0.3)  # the router sees the engine's new blocks before the next request
        status = _settled(front, 3)
        with Page(tmp_path / "devtools") as page:
            page.goto(f"{front.url}/?interval_ms=300")
            page.wait_for("document.querySelectorAll('#decisions tr.decision').length === 3")
            shown = page.eval("""(() => {
                const row = document.querySelector('tr.engine');
                const cell = (c) => row.querySelector('td.' + c).textContent;
                return {name: row.dataset.engine, healthy: cell('healthy'), requests: cell('requests'),
                        gpu: row.querySelector('td.gpu-blocks .n').textContent,
                        cpu: row.querySelector('td.cpu-blocks .n').textContent,
                        gpuHit: cell('gpu-hit'), cached: cell('cached'),
                        decisions: Array.from(document.querySelectorAll('#decisions tr.decision'))
                          .map((r) => [r.dataset.request, r.querySelector('.engine').textContent,
                                       r.querySelector('.reason').textContent,
                                       r.querySelector('.reported').textContent]),
                        policy: document.getElementById('policy').textContent,
                        agreement: document.getElementById('agreement').textContent};
            })()""")
            shot = tmp_path / "router-page.png"
            page.screenshot(shot, 1280, 720)
            assert page.errors == []  # no uncaught exception in the page
    assert png_check(shot) == (1280, 720)
    e = status["engines"][0]
    assert shown["name"] == "e0" and shown["healthy"] == "healthy" and shown["requests"] == "3"
    assert shown["gpu"] == str(e["gpu_blocks"]) and shown["cpu"] == str(e["cpu_blocks"])
    assert e["gpu_hit_tokens"] > 0  # the 2nd and 3rd requests found the document's blocks
    assert shown["gpuHit"] == f"{100 * e['gpu_hit_tokens'] / e['prompt_tokens']:.1f}%"
    assert shown["cached"] == f"{e['cached_tokens']} / {e['prompt_tokens']}"
    newest_first = [[d["request_id"], d["engine"], d["reason"], str(d["cached_tokens"])]
                    for d in reversed(status["decisions"])]
    assert shown["decisions"] == newest_first
    agree = sum(d["cached_tokens"] == d["predicted_cached_tokens"] for d in status["decisions"])
    assert shown["agreement"].startswith(f"{agree} of 3 ")
    assert shown["policy"] == "kv"
