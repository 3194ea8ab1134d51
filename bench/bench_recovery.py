"""Recovery after kill -9 with a long history behind it, and what a checkpoint costs the stream.

    python bench/bench_recovery.py [--sizes 1000000 5000000 20000000] [--cpu-blocks 100000]
                                   [--before-tree DIR] [--restarts 1] [--bytecode]
                                   [--skip-cost] [--out bench/results/recovery.json]

**Recovery** (issue "durable core"): a real ``offloadd`` stores ``--cpu-blocks`` CPU-tier blocks
(Reserve -> arena write -> Commit through the real client), then history is appended until the
log has seen each of ``--sizes`` records (cumulative, one Redis), and at each size the daemon is
killed with SIGKILL and started again on the same Redis and arena: the time from ``exec`` to
health SERVING (and the daemon's own recovery time from its ``serving`` log line), Redis
``used_memory``, the newest checkpoint's bytes and the retained log's bytes. The daemon runs with
the default ``checkpoint_records`` (10,000) and ``--retention-records 100000 --retention-s 0``
(the default ``retention_s`` keeps a day of records, by design: memory then follows a day's
traffic, not history).

History is written by this process, not through gRPC: at the daemon's ~20-50k records/s 20M
records would take 7-15 minutes of a shared 2-core machine. It is the documented equivalent of
what the daemon leaves in Redis for the same records: a source ``history-engine``
(incarnation 1) appends pairs of records, ``BlockStored`` then ``BlockRemoved`` of one GPU block,
written as the daemon's write script writes them (``XADD {offset}-0 r <record>`` with the
record codec of events.records, its fence in the ``sources`` hash, the ``head`` key), pipelined;
the log is trimmed as the daemon trims it (exact ``XTRIM MINID`` to the retention floor, never
past the oldest kept checkpoint); and the two checkpoints the daemon keeps are written with the
daemon's codec (events.checkpoint) at the offsets it would have written them. Since each pair
leaves the state unchanged but for that source's fence, the state at an even offset is the
state before the history with the fence advanced: that is what the checkpoints hold. The newest
checkpoint is written ``checkpoint_records - 1`` records before the head: the worst case, a
checkpoint was due when the daemon died, so recovery replays the longest tail it can meet.

SERVING is probed every 50 ms on a channel that reconnects within 20 ms (gRPC's default waits
1 s, then 1.6 s, after a refused connection, which once made a restart look ~1 s slower); each
row has the daemon's CPU seconds by then and how long its event loop waited for a CPU
(``main_runq_s``: on a shared machine, exec -> SERVING less it is about an idle machine's). With
``--before-tree DIR`` (a checkout of another commit, e.g. ``git archive``), each size is
restarted ``--restarts`` times with that tree's daemon and this one's, alternating, on the same
Redis and arena (the measured restarts write no checkpoint, so each replays the same tail).
``--bytecode`` lets the daemons cache compiled bytecode (in a temporary directory), as an
installed package has it; without it, a tree run with PYTHONDONTWRITEBYTECODE compiles every
module of its own at each start.

**Checkpoint cost**: the whole event path (bench_pipeline's shape c, paced 50k block events/s
unless ``--cost-rate`` says otherwise, engine send -> subscriber receive) on a daemon holding ``--cpu-blocks`` CPU-tier blocks, once with
a checkpoint every ``--cost-interval-s`` (default 2 s: several during the run, each of the
whole state: the CPU tier and the GPU tier the run has stored so far, of which the daemon cuts
and writes only what changed, DECISIONS 60 and 65) and once with none, alternating. Each run
reports its checkpoints, their bytes, forks (and the longest), the most blocks one cut and
Redis's AOF rewrites. Redis runs as kv-stack runs it (``--auto-aof-rewrite-min-size 512mb``,
``--cost-aof-min-size``); ``--cost-redis-default`` runs both modes once more per round with
Redis's own default (the next AOF rewrite after ~64 MB of writes, DECISIONS 68).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_pipeline import run_pipeline, shape_batches
from events.checkpoint import (
    Manifest,
    checkpoint_id,
    decode_ids,
    decode_manifest,
    encode_chunk,
    encode_ids,
    encode_manifest,
    split,
)
from events.logkeys import LogKeys
from events.logreader import LogReader
from events.records import RECORD_FIELD, encode_record, entry_id
from events.schema import BlockRemoved, BlockStored, LogRecord
from events.state import CacheState, Snapshot, SourceSnapshot
from offloadd.client import BlockToStore, OffloadClient
from offloadd.config import OffloaddConfig
from offloadd.log import projection
from tests.support.offloadd_proc import REPO, DaemonProcess
from tests.support.redis_proc import RedisProcess
from tests.support.synthetic_engine import GROUP, SLOT, block_bytes, digest

HISTORY = "history-engine"
CKPT_RECORDS = OffloaddConfig().checkpoint_records  # the daemon's default (this tree's)
RETENTION = ("--retention-records", "100000", "--retention-s", "0")
REDIS_TIMEOUT = ("--redis-timeout-s", "5")  # a loaded machine's Redis can take a second to answer
CHAIN = 256  # blocks per Reserve/Commit


def fill_cpu_tier(target: str, n: int) -> float:
    """Store ``n`` CPU-tier blocks through the real client; seconds taken."""
    t0 = time.perf_counter()
    with OffloadClient(target, timeout_s=30.0) as client:
        arena = client.register_engine("cpu-filler", 1, "synthetic", [GROUP]).map_arena(0)
        try:
            for start in range(0, n, CHAIN):
                blocks = [BlockToStore(digest("cpu-filler", i), digest("cpu-filler", i - 1) if i > start else None,
                                       (i % 500, 1, 2, 3)) for i in range(start, min(n, start + CHAIN))]
                res = client.reserve("cpu-filler", 0, blocks)
                for b, (status, slot) in zip(blocks, res.blocks, strict=True):
                    if status.name == "RESERVED":
                        arena.write(slot, block_bytes(b.block_hash, SLOT))
                if res.reservation_id:
                    client.commit("cpu-filler", res.reservation_id)
        finally:
            arena.close()
    return time.perf_counter() - t0


def state_now(daemon: DaemonProcess, admin: Any, keys: LogKeys) -> CacheState:
    """The daemon's state (Snapshot RPC) brought up to the log's head after it is killed."""
    with OffloadClient(daemon.target) as client:
        state = CacheState.from_snapshot(client.snapshot())
    kill_with_children(daemon)
    for record in LogReader(admin, keys).iter_range(state.offset + 1):
        state.apply(record)
    return state


class HistoryWriter:
    """Appends the history as the daemon would leave it in Redis (module docstring)."""

    def __init__(self, admin: Any, keys: LogKeys, epoch: str) -> None:
        self.admin, self.keys, self.epoch = admin, keys, epoch

    def append(self, state: CacheState, n: int, chunk: int = 2000) -> tuple[int, float]:
        """``n`` more records after ``state`` (rounded down to pairs); (the new head, seconds)."""
        t0 = time.perf_counter()
        head = state.offset
        inc, seq = state.fence(HISTORY) or (1, 0)
        others = Snapshot(0, tuple(s for s in state.export().sources if s.source != HISTORY))
        fixed = [encode_chunk(part) for part in split(others)]  # the same bytes in every checkpoint
        stored = BlockStored((1 << 40,), None, (1, 2, 3, 4) * 4, 16, "GPU")
        removed = BlockRemoved((1 << 40,), "GPU")
        target = head + n - n % 2
        newest = target - (CKPT_RECORDS - 1)
        newest -= (newest - head) % 2  # after a pair: the history source holds no block
        ckpts = sorted(o for o in range(newest, head, -CKPT_RECORDS))
        now = time.time()
        while head < target:
            pipe = self.admin.pipeline(transaction=False)
            for _ in range(min(chunk, target - head) // 2):
                for events in ((stored,), (removed,)):
                    head += 1
                    seq += 1
                    data = encode_record(LogRecord(head, HISTORY, inc, seq, now, events))
                    pipe.xadd(self.keys.log, {RECORD_FIELD: data}, id=entry_id(head))
            pipe.hset(self.keys.sources, HISTORY, projection.encode((inc, seq)))
            pipe.set(self.keys.head, head)
            pipe.execute()
            now = time.time()
            if ckpts and head >= ckpts[0]:
                at = ckpts.pop(0)
                self._checkpoint(fixed, at, SourceSnapshot(HISTORY, inc, seq - (head - at), ()))
            if head % 100_000 < chunk:
                self._trim(head)
        self._trim(head)
        return head, time.perf_counter() - t0

    def _checkpoint(self, fixed: list[tuple[bytes, int]], offset: int, history: SourceSnapshot) -> None:
        """The daemon's checkpoint at ``offset``: the state before the history (its chunks
        encoded once) and the history source's fence, then the pointer (two kept)."""
        ckpt = checkpoint_id(self.epoch, offset)
        chunks = [*fixed, encode_chunk((history,))]
        pipe = self.admin.pipeline(transaction=False)
        for i, (data, _sum) in enumerate(chunks):
            pipe.set(self.keys.checkpoint_chunk(ckpt, i), data)
        pipe.set(self.keys.checkpoint_manifest(ckpt), encode_manifest(Manifest(
            ckpt, offset, self.epoch, time.time(), tuple(c for _, c in chunks),
            sum(len(d) for d, _ in chunks))))
        old = self.admin.get(self.keys.checkpoint)
        ids = (ckpt, *([] if old is None else _ids(old)))
        pipe.set(self.keys.checkpoint, encode_ids(ids[:2]))
        for dropped in ids[2:]:
            raw = self.admin.get(self.keys.checkpoint_manifest(dropped))
            count = 0 if raw is None else len(_manifest(raw).checksums)
            pipe.delete(self.keys.checkpoint_manifest(dropped),
                        *[self.keys.checkpoint_chunk(dropped, i) for i in range(count)])
        pipe.execute()

    def _trim(self, head: int) -> None:
        """To the retention floor (the last 100,000 records), never past the oldest kept
        checkpoint + 1."""
        raw = self.admin.get(self.keys.checkpoint)
        offsets = [_manifest(self.admin.get(self.keys.checkpoint_manifest(i))).offset
                   for i in (_ids(raw) if raw else ())]
        if offsets:
            floor = min(head - 100_000 + 1, min(offsets) + 1)
            if floor > 1:
                self.admin.xtrim(self.keys.log, minid=entry_id(floor), approximate=False)


def _ids(raw: bytes) -> tuple[str, ...]:
    return decode_ids(raw)


def _manifest(raw: bytes) -> Manifest:
    return decode_manifest(raw)


def recovery_seconds(daemon: DaemonProcess) -> dict[str, Any]:
    """The daemon's own report from its last ``serving`` line, with that line's time (``ts``)."""
    for line in reversed(daemon.log_path.read_text(errors="replace").splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("msg") == "serving":
            return {**(doc.get("recovery") or {}), "ts": doc.get("ts")}
    return {}


def memory(admin: Any, keys: LogKeys) -> dict[str, int]:
    info = admin.info("memory")
    raw = admin.get(keys.checkpoint)
    newest = _manifest(admin.get(keys.checkpoint_manifest(_ids(raw)[0]))) if raw else None
    blocks = sum(admin.memory_usage(k) or 0 for k in admin.scan_iter(keys.prefix + "blocks:*"))
    return {
        "used_memory": int(info["used_memory"]),
        "checkpoint_bytes": newest.num_bytes if newest else 0,
        "log_bytes": int(admin.memory_usage(keys.log) or 0),
        "log_records": int(admin.xlen(keys.log)),
        "cpu_projection_bytes": int(blocks),
    }


def restart_once(daemon: DaemonProcess, admin: Any, keys: LogKeys, head: int,
                 profile_dir: str = "") -> dict[str, Any]:
    """Start the (killed) daemon; its row: times, tail, resident blocks, memory."""
    args = list(daemon.args)
    if profile_dir:  # py-spy's profile of the restart; the start is slower under it
        py_spy = str(Path(sys.executable).with_name("py-spy"))
        daemon.args = [py_spy, "record", "--format", "raw", "--rate", "250", "--duration", "8", "-o",
                       str(Path(profile_dir) / f"restart_{head}_{int(time.time())}.txt"), "--", *args]
    persisting = redis_persisting(admin)  # a rewrite the history's writes set off takes a core
    t0, exec_wall = time.perf_counter(), time.time()
    daemon.poll_s = 0.005  # SERVING seen within ~5 ms of it (the default 50 ms is a tenth of a start)
    try:
        daemon.start(timeout_s=120)
    finally:
        daemon.args = args
        daemon.poll_s = 0.05
    to_serving = time.perf_counter() - t0
    cpu_s = process_cpu_s(daemon.proc.pid) if daemon.proc and not profile_dir else None
    runq_s = main_runq_s(daemon.proc.pid) if daemon.proc and not profile_dir else None
    report = recovery_seconds(daemon)
    with OffloadClient(daemon.target) as client:
        resident = client.stats()
    row: dict[str, Any] = {"history_records": head,
           "exec_to_serving_s": round(to_serving, 3),
           "redis_persisting_at_exec": persisting or None,
           "cpu_to_serving_s": cpu_s,
           "main_runq_s": runq_s,  # the event loop's wait for a CPU before SERVING was seen
           "recovery_s": report.get("seconds"),
           # exec -> the daemon's serving line, less its recovery: interpreter, imports, config,
           # Redis, owner lease, and the servers bound after recovery (wall, same clock)
           "outside_recovery_s": (round(report["ts"] - exec_wall - report["seconds"], 3)
                                  if report.get("ts") and report.get("seconds") else None),
           "load_and_replay_s": report.get("load_and_replay_seconds"),
           "tail_records": report.get("num_records"),
           "checkpoint_offset": report.get("checkpoint_offset"),
           "cpu_blocks": report.get("num_blocks"),
           "stats_blocks": getattr(resident, "num_blocks", None),
           **memory(admin, keys)}
    row["memory_goal_bytes"] = 2 * (row["checkpoint_bytes"] + row["log_bytes"])
    if profile_dir:
        time.sleep(max(0.0, 9 - (time.perf_counter() - t0)))  # py-spy writes at 8 s
    return row


def redis_persisting(admin: Any) -> str:
    """What Redis is writing in the background now ('aof-rewrite', 'rdb-save'; '' for nothing)."""
    info = admin.info("persistence")
    busy = [name for name, key in (("aof-rewrite", "aof_rewrite_in_progress"),
                                   ("rdb-save", "rdb_bgsave_in_progress")) if int(info.get(key, 0))]
    return "+".join(busy)


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) ``pid`` has used: on a shared machine, the
    measure of a start that its load inflates least."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 3)


def main_runq_s(pid: int) -> float | None:
    """Seconds the main thread of ``pid`` (the daemon's event loop) was ready to run but waited
    for a CPU (``/proc/PID/schedstat``): on a shared machine, exec -> SERVING less this is
    about what an idle machine would have measured (Redis' own waits are not taken out)."""
    try:
        return round(int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9, 3)
    except (OSError, IndexError, ValueError):
        return None


def in_tree(args: list[str], tree: str) -> list[str]:
    """``args`` (``python -m offloadd ...``) run with ``tree`` as the working directory, so
    ``-m`` imports that tree's packages."""
    return ["/bin/sh", "-c", 'cd "$0" && exec "$@"', tree, *args]


def run_recovery(work: Path, sizes: list[int], cpu_blocks: int, profile_dir: str = "",
                 before_tree: str = "", restarts: int = 1) -> list[dict[str, Any]]:
    redis_proc = RedisProcess(work / "redis")
    redis_proc.start()
    keys = LogKeys("default")
    admin = redis.Redis.from_url(redis_proc.url)
    daemon = DaemonProcess(work / "offloadd", redis_proc.url, "default",
                           capacity_bytes=max(1 << 20, 2 * cpu_blocks * SLOT),
                           extra_args=("--log-level", "INFO", *RETENTION, *REDIS_TIMEOUT))
    rows: list[dict[str, Any]] = []
    base_args = list(daemon.args)
    # The measured restarts write no checkpoint of their own, so every restart at a size
    # replays the same tail (the history's newest checkpoint is one record short of due).
    measured = [*base_args, "--checkpoint-records", str(10**9)]
    trees = [("before", in_tree(measured, before_tree)), ("after", measured)] if before_tree else [("", measured)]
    try:
        daemon.start()
        fill_s = fill_cpu_tier(daemon.target, cpu_blocks)
        print(f"stored {cpu_blocks} CPU-tier blocks in {fill_s:.1f} s", file=sys.stderr)
        epoch = admin.get(keys.epoch).decode()  # type: ignore[union-attr]
        writer = HistoryWriter(admin, keys, epoch)
        for size in sizes:
            state = state_now(daemon, admin, keys)  # and kill -9
            head, write_s = writer.append(state, size - state.offset)
            print(f"history at {head} records ({write_s:.1f} s to write); restarting", file=sys.stderr)
            for _ in range(restarts):
                for name, args in trees:
                    kill_with_children(daemon)
                    daemon.args = args
                    row = {"tree": name, "write_s": round(write_s, 1)}
                    try:
                        row.update(restart_once(daemon, admin, keys, head, profile_dir))
                    except RuntimeError as exc:  # it did not start: a row that says so
                        row.update(history_records=head, error=str(exc)[-2000:])
                        daemon.args = measured  # running again for what follows
                        daemon.start(timeout_s=120)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
            daemon.args = base_args
    finally:
        kill_with_children(daemon)
        admin.close()
        redis_proc.stop()
    return rows


def kill_with_children(daemon: DaemonProcess) -> None:
    """kill -9 the daemon and its children: a profiled restart runs it as py-spy's child, which
    killing py-spy alone would leave running, holding the namespace's lease."""
    if daemon.proc is not None:
        pid = daemon.proc.pid
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in children:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(child), signal.SIGKILL)
    daemon.kill()


def run_cost(work: Path, cpu_blocks: int, rounds: int, rate: float, scale: float,
             interval_s: float, aof_min_size: str = "512mb", also_default: bool = False) -> dict[str, Any]:
    batches = shape_batches("c", scale)
    aof = ("--auto-aof-rewrite-min-size", aof_min_size) if aof_min_size else ()
    modes = [("checkpointing", str(interval_s), aof), ("none", "100000", aof)]
    if also_default:  # the same two with Redis's own default (64mb, DECISIONS 68)
        modes += [("checkpointing+redis-default", str(interval_s), ()),
                  ("none+redis-default", "100000", ())]
    out: dict[str, list[dict[str, Any]]] = {m[0]: [] for m in modes}
    for _ in range(rounds):
        for mode, interval, redis_args in modes:
            args = ("--checkpoint-interval-s", interval, "--checkpoint-records", "1000000000",
                    "--log-level", "INFO", "--redis-timeout-s", "10")
            got = run_pipeline(work, batches, rate, daemon_args=args,
                               prepare=lambda target: fill_cpu_tier(target, cpu_blocks),
                               capacity_bytes=max(1 << 20, 2 * cpu_blocks * SLOT),
                               redis_args=redis_args)
            out[mode].append({k: got.get(k) for k in ("p50_ms", "p99_ms", "lost", "received",
                                                       "block_events_per_s", "checkpoints",
                                                       "checkpoint_bytes_max", "checkpoint_bytes_total",
                                                       "checkpoint_bytes_sent_total",
                                                       "checkpoint_fork_ms_max", "checkpoint_forks",
                                                       "checkpoint_blocks_cut_max", "redis")})
            print(f"{mode}: {out[mode][-1]}", file=sys.stderr)
    p99 = {m: statistics.median(r["p99_ms"] for r in rows) for m, rows in out.items()}
    return {"block_events_per_s_paced": rate, "batches": len(batches[0]),
            "checkpoint_interval_s": interval_s, "runs": out,
            "median_p99_ms": p99, "ratio": p99["checkpointing"] / p99["none"],
            "aof_rewrites": {m: [(r.get("redis") or {}).get("aof_rewrites") for r in rows]
                             for m, rows in out.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 5_000_000, 20_000_000],
                   help="history sizes in records, ascending (cumulative on one Redis)")
    p.add_argument("--cpu-blocks", type=int, default=100_000, help="CPU-tier blocks resident")
    p.add_argument("--cost-rounds", type=int, default=2, help="alternating checkpoint-cost runs")
    p.add_argument("--cost-rate", type=float, default=50_000.0,
                   help="paced block events/s of the checkpoint-cost runs (shape c: 50000)")
    p.add_argument("--cost-scale", type=float, default=1.0, help="shape c's 10,000 batches x this")
    p.add_argument("--cost-interval-s", type=float, default=2.0,
                   help="checkpoint interval of the checkpointing runs (default 2)")
    p.add_argument("--cost-aof-min-size", default="512mb",
                   help="redis-server --auto-aof-rewrite-min-size of the cost runs: 512mb as kv-stack "
                        "and compose run it (DECISIONS 68); '' for Redis's default")
    p.add_argument("--cost-redis-default", action="store_true",
                   help="also run both cost modes with Redis's default config")
    p.add_argument("--skip-cost", action="store_true", help="recovery only")
    p.add_argument("--skip-recovery", action="store_true", help="checkpoint cost only")
    p.add_argument("--out", default="bench/results/recovery.json")
    p.add_argument("--before-tree", default="",
                   help="also restart with the daemon of this source tree, alternating (before/after)")
    p.add_argument("--restarts", type=int, default=1, help="restarts per size (per tree)")
    p.add_argument("--bytecode", action="store_true",
                   help="let the daemons cache compiled bytecode, as an installed package has it")
    p.add_argument("--py-spy-dir", default="",
                   help="profile each restart with py-spy (raw stacks) into this directory")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the processes it started
    if args.sizes != sorted(args.sizes) or args.sizes[0] <= 0:
        p.error("--sizes must be positive and ascending")
    result: dict[str, Any] = {"machine": {"cpus": os.cpu_count(),
                                          "python": platform.python_version()},
                              "cpu_blocks": args.cpu_blocks, "checkpoint_records": CKPT_RECORDS,
                              "retention": " ".join(RETENTION)}
    if args.restarts < 1:
        p.error("--restarts must be >= 1")
    result["before_tree"] = args.before_tree
    result["bytecode"] = args.bytecode
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        if args.bytecode:  # inherited by the daemons this process starts
            os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
            os.environ["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
            for tree in filter(None, (str(REPO), args.before_tree)):  # compiled before any start
                subprocess.run([sys.executable, "-c", "import offloadd.__main__"], cwd=tree, check=True)
        if not args.skip_recovery:
            result["recovery"] = run_recovery(Path(tmp) / "rec", args.sizes, args.cpu_blocks,
                                              args.py_spy_dir, args.before_tree, args.restarts)
        if not args.skip_cost:
            result["checkpoint_cost"] = run_cost(Path(tmp) / "cost", args.cpu_blocks, args.cost_rounds,
                                                args.cost_rate, args.cost_scale, args.cost_interval_s,
                                                args.cost_aof_min_size, args.cost_redis_default)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in result.get("recovery", []):
        if "error" in row:
            print(f"{row['tree']:>6} {row['history_records']:>10} records: did not start")
            continue
        print(f"{row['tree']:>6} {row['history_records']:>10} records: SERVING {row['exec_to_serving_s']:.2f} s after "
              f"exec ({row['cpu_to_serving_s']} s of CPU, {row['main_runq_s']} s waiting for one; recovery {row['recovery_s']:.2f} s, tail {row['tail_records']}, "
              f"outside recovery {row['outside_recovery_s']} s"
              f"{'; Redis: ' + row['redis_persisting_at_exec'] if row.get('redis_persisting_at_exec') else ''}), used_memory "
              f"{row['used_memory'] / 2**20:.1f} MiB (goal {row['memory_goal_bytes'] / 2**20:.1f} MiB)")
    if "checkpoint_cost" in result:
        c = result["checkpoint_cost"]
        print(f"p99 with checkpoints {c['median_p99_ms']['checkpointing']:.1f} ms, without "
              f"{c['median_p99_ms']['none']:.1f} ms: {c['ratio']:.2f}x (goal <= 2x)")
        for mode, p99 in c["median_p99_ms"].items():
            print(f"  {mode}: median p99 {p99:.1f} ms, AOF rewrites per run {c['aof_rewrites'][mode]}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
