"""Headless Chromium for the page tests: the DOM after the page's scripts ran, and screenshots.

``--virtual-time-budget`` lets the page run (timers, fetches to our real servers) for that much
virtual time before Chromium dumps the DOM or takes the screenshot; no WebDriver, nothing
downloaded. :class:`Dom` is a small tree over the dumped HTML (stdlib parser) so tests find
elements by id and class and read their text.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}


def chromium_or_skip() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed (scripts/setup --test installs Debian's chromium)")
    return path


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node | str] = field(default_factory=list)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def walk(self) -> list[Node]:
        out = [self]
        for c in self.children:
            if isinstance(c, Node):
                out.extend(c.walk())
        return out

    def all(self, tag: str | None = None, cls: str | None = None) -> list[Node]:
        return [n for n in self.walk()[1:]
                if (tag is None or n.tag == tag) and (cls is None or cls in n.classes)]

    def one(self, tag: str | None = None, cls: str | None = None) -> Node:
        found = self.all(tag, cls)
        assert len(found) == 1, f"{len(found)} <{tag or '*'} class={cls}> in <{self.tag}>"
        return found[0]

    def cell(self, cls: str) -> str:
        """The text of this row's one cell of class ``cls``."""
        return self.one("td", cls).text()


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


class Dom:
    def __init__(self, html: str) -> None:
        builder = _TreeBuilder()
        builder.feed(html)
        builder.close()
        self.html = html
        self.root = builder.root
        self._ids = {n.attrs["id"]: n for n in self.root.walk() if "id" in n.attrs}

    def by_id(self, element_id: str) -> Node:
        assert element_id in self._ids, f"no element with id {element_id!r}"
        return self._ids[element_id]

    def text(self, element_id: str) -> str:
        return self.by_id(element_id).text()


class Chromium:
    """One headless Chromium per call, with a profile under ``workdir``."""

    def __init__(self, workdir: Path, budget_ms: int = 3000) -> None:
        self.path = chromium_or_skip()
        self.workdir = workdir
        self.budget_ms = budget_ms
        workdir.mkdir(parents=True, exist_ok=True)

    def _run(self, url: str, *flags: str) -> str:
        cmd = [self.path, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--disable-extensions", f"--user-data-dir={self.workdir / 'profile'}",
               f"--virtual-time-budget={self.budget_ms}", *flags, url]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
        assert proc.returncode == 0, f"chromium exited {proc.returncode}: {proc.stderr[-2000:]}"
        return proc.stdout

    def dom(self, url: str) -> Dom:
        return Dom(self._run(url, "--dump-dom"))

    def screenshot(self, url: str, path: Path, width: int, height: int) -> None:
        self._run(url, f"--screenshot={path}", f"--window-size={width},{height}",
                  "--hide-scrollbars")


def png_check(path: Path) -> tuple[int, int]:
    """(width, height) of a real PNG with more than a blank image in it; asserts otherwise."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    assert data[12:16] == b"IHDR"
    pixels, pos = b"", 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        if kind == b"IDAT":
            pixels += data[pos + 8 : pos + 8 + length]
        pos += 12 + length
    raw = zlib.decompress(pixels)
    assert len(set(raw)) > 16, f"{path} looks blank ({len(set(raw))} distinct byte values)"
    return width, height
