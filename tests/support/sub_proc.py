"""A KvEventSubscriber in its own process, so a test can SIGSTOP it (a subscriber that does not
read) and SIGCONT it later.

``python -m tests.support.sub_proc PUB REPLAY TOPIC DONE_FILE OUT_FILE``: bootstraps, prints
"READY", follows the stream; once DONE_FILE holds a number N it runs until its next seq is N,
then writes its view and stats as JSON to OUT_FILE and exits.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import zmq

from events.subscriber import KvEventSubscriber


def main(pub: str, replay: str, topic: str, done_file: Path, out_file: Path) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    # A small kernel receive buffer, so a stopped subscriber backs the bridge up quickly.
    ctx.setsockopt(zmq.RCVBUF, 4096)
    sub = KvEventSubscriber(pub, replay, topic, ctx=ctx, idle_sync_s=0.5)
    time.sleep(0.3)
    sub.bootstrap()
    print("READY", flush=True)
    while not done_file.exists() or not done_file.read_text().strip():
        sub.poll(50)
    want = int(done_file.read_text())
    reached = sub.run_until(lambda s: s.next_seq == want, 30)
    view = [[src, medium, group, sorted(hashes)] for (src, medium, group), hashes in sorted(sub.view().items())]
    out_file.write_text(json.dumps({
        "reached": reached, "next_seq": sub.next_seq, "view": view,
        "stats": dataclasses.asdict(sub.stats),
    }))
    sub.close()
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5]))
