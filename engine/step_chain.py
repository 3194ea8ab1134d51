"""Async scheduling of decodes: the next decode step is launched before the last step's tokens
reach the host, fed those tokens on the device.

A synchronous step leaves the GPU idle while the host reads the tokens, detokenises, checks
stops, schedules and prepares the next step (~0.3-0.7 ms a step on an H200 host, against
~1-2 ms of GPU work). When every running request just sampled a token on the device and will
decode once more, the engine launches that decode straight away (vLLM's async scheduling):
the grid step reads its token ids from the argmax of the step still running, and the host
does the last step's bookkeeping while the GPU computes. The host then learns tokens one step
late; what it learns changes nothing already launched:

- a request that stops on the token just read (EOS, a stop token or string) had one more
  decode launched: its row is dropped and the K/V it writes lands in the request's own last
  block, which is not hashed yet and is freed with the request (nothing else reads it before
  a later step, in stream order, overwrites it);
- a request that would stop by length, a queued request, a step whose requests did not all
  sample, anything but greedy sampling, an offload connector, or a pool short of a block:
  the engine steps synchronously (the next step is scheduled once the tokens are in).

The blocks a chained step completes are hashed (BlockStored) only once its input token is on
the host, in the same order as a synchronous step would; the tokens are identical, as the
step runs the same graph on the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.kv_manager import KVCacheManager
from engine.request import Request
from engine.runner import ModelRunner
from engine.scheduler import ScheduledRequest, Scheduler


@dataclass
class Launched:
    """A step on its way: what it computes, and where its tokens or logits will be."""

    scheduled: list[ScheduledRequest]
    requests: list[Request]
    """The sampled requests, in the order of the rows of ``logits`` / ``tokens``."""
    logits: Tensor | None
    """float32 logits (sampling on the host), or None when ``tokens`` holds the greedy picks."""
    tokens: Tensor | None = None
    """Device argmax per row, [len(requests)]."""
    host: Tensor | None = None
    """Pinned copy of ``tokens`` (async scheduling), valid once ``ready`` has completed."""
    ready: torch.cuda.Event | None = None

    @property
    def live(self) -> bool:
        return any(not r.is_finished for r in self.requests)


class StepChain:
    """The step launched ahead (at most one) and the pinned buffers its tokens come back in."""

    def __init__(self, device: torch.device, eligible: bool, enabled: bool) -> None:
        self.device, self.eligible = device, eligible
        """Whether this engine can chain steps (grid steps, no offload connector)."""
        self.enabled = eligible and enabled
        self.pending: Launched | None = None
        self._buffers: list[Tensor] = []
        self._ready: list[torch.cuda.Event] = []
        self._turn = 0
        self.launched = 0
        """Steps launched ahead of their inputs' tokens (for tests and benchmarks)."""

    def take(self) -> Launched | None:
        """The step launched ahead, if any of its requests is still running."""
        step, self.pending = self.pending, None
        return step if step is not None and step.live else None

    def pick(self, launched: Launched, logits: Tensor) -> None:
        """Greedy tokens of ``logits`` on the device, on CUDA also queued to pinned host memory
        (read by :meth:`tokens` without waiting for later work, and without a copy of its own
        issued once the step is done: the engine picks right after the launch)."""
        launched.tokens = logits.argmax(dim=-1)
        if self.device.type != "cuda":
            return
        n = launched.tokens.numel()
        if not self._buffers or self._buffers[0].numel() < n:
            self._buffers = [torch.empty(max(n, 64), dtype=torch.long, pin_memory=True) for _ in range(2)]
            self._ready = [torch.cuda.Event() for _ in range(2)]
        # Two buffers: the step launched ahead writes one while the other is still to be read.
        # Each has its event, recorded again with each copy into it (a new event per step cost
        # a create and a destroy on the host): whoever waits on it reads that buffer's copy.
        turn = self._turn
        host = self._buffers[turn][:n]
        self._turn ^= 1
        host.copy_(launched.tokens, non_blocking=True)
        launched.host, launched.ready = host, self._ready[turn]
        launched.ready.record()

    def launch_ahead(self, launched: Launched, scheduler: Scheduler, kv: KVCacheManager, runner: ModelRunner,
                     max_model_len: int) -> Launched | None:
        """The next decode of every request of ``launched``, launched before its tokens are
        read, when nothing but those tokens decides it; else None (nothing changed but, maybe,
        a block allocated that the next step needs anyway)."""
        reqs, running = launched.requests, scheduler.running
        if (not self.enabled or launched.tokens is None or scheduler.waiting
                or len(reqs) != len(launched.scheduled) or len(reqs) != len(running)
                or any(a is not b for a, b in zip(reqs, running, strict=True))):
            return None
        if any(r.next_token_ends_by_length(max_model_len) for r in reqs):
            return None  # stops by length on the token being read: nothing to launch
        if not all(kv.allocate_slots(r, 1) for r in reqs):
            return None  # short of blocks: the scheduler decides (preemption) once tokens are in
        sched = [ScheduledRequest(r, r.num_computed_tokens, 1) for r in reqs]
        logits = runner.execute_decodes(sched, launched.tokens)
        if logits is None:
            return None
        ahead = Launched(sched, list(reqs), None)
        self.pick(ahead, logits)
        self.launched += 1
        return ahead

    @staticmethod
    def tokens(launched: Launched) -> list[int]:
        if launched.ready is not None and launched.host is not None:
            launched.ready.synchronize()
            return launched.host.tolist()
        assert launched.tokens is not None
        return launched.tokens.tolist()
