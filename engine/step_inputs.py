"""An eager step's inputs on the device: one upload of the host's index tensors, and the
per-token values derived from them there (positions, cache rows), so that a long prefill
builds no per-token indices on the host."""

from __future__ import annotations

import torch
from torch import Tensor


class StepUpload:
    """Collects a step's host index tensors and moves them to the device in one copy, through
    a pinned staging buffer the runner keeps (pinning a fresh tensor each step cost ~1-6 ms)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.parts: list[Tensor] = []
        self._staging: Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def begin(self) -> None:
        self.parts = []

    def add(self, x: Tensor) -> int:
        self.parts.append(x)
        return len(self.parts) - 1

    def send(self) -> list[Tensor]:
        if self.device.type != "cuda":
            return self.parts
        n = sum(x.numel() for x in self.parts)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the staging buffer
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(max(n, 2 * self._staging.numel() if self._staging is not None else 4096),
                                        dtype=torch.long, pin_memory=True)
        staged = self._staging[:n]
        torch.cat([x.reshape(-1).to(torch.long) for x in self.parts], out=staged)
        dev = staged.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        out, off = [], 0
        for x in self.parts:
            part = dev[off : off + x.numel()].view(x.shape)
            out.append(part if x.dtype == torch.long else part.to(x.dtype))
            off += x.numel()
        return out


def token_positions(meta: Tensor, batch: int, total: int) -> tuple[Tensor, Tensor]:
    """Each token's position and request row, ``[T]`` each, from ``meta`` = starts then
    lengths of the step's requests (on the device: no host work per token)."""
    dev = meta.device
    starts, lens = meta[:batch], meta[batch:]
    if batch == 1:
        return starts + torch.arange(total, device=dev), torch.zeros(total, dtype=torch.long, device=dev)
    row = torch.repeat_interleave(torch.arange(batch, device=dev), lens, output_size=total)
    first = torch.cumsum(lens, 0) - lens  # each request's first token in the flat batch
    return torch.arange(total, device=dev) - first[row] + starts[row], row


def write_rows(block: Tensor, positions: Tensor, layers: int, bs: int) -> Tensor:
    """``[L, 2, T]``: the flat cache row of each token's K (0) and V (1) in each of the group's
    layers, ``((block * L + l) * 2 + kv) * bs + offset``, from each token's block and position."""
    dev = block.device
    base = block * (layers * 2 * bs) + positions % bs
    per_layer = (torch.arange(layers, device=dev) * (2 * bs)).view(-1, 1, 1)
    return base.view(1, 1, -1) + per_layer + (torch.arange(2, device=dev) * bs).view(1, 2, 1)
