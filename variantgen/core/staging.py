"""Host-to-device copies of plan() metadata without device syncs.

A copy from pageable host memory (``torch.tensor(list, device="cuda")``) waits for the
kernels already queued on the stream; plan() made about a dozen of them, each a full
sync (tens of microseconds on the H200 while kernels are queued). Here values go through
a page-locked buffer and a non-blocking copy. Regions of the buffer are handed out one
after another during a plan(); ``begin()`` (at the start of the next plan) waits for the
previous plan's copies to have run before the buffer is reused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ALIGN = 16


class HostStaging:
    def __init__(self, device: torch.device):
        self.device = device
        self._buffer: torch.Tensor | None = None  # page-locked uint8
        self._offset = 0
        self._retired: list[torch.Tensor] = []  # outgrown buffers with copies possibly in flight
        self._event: torch.cuda.Event | None = None
        self._unrecorded = False  # copies queued since the last record()

    def begin(self) -> None:
        """Start handing out the buffer from its beginning (after the last copies ran)."""
        if self._unrecorded:  # the last plan() stopped before record() (it raised)
            self.record()
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self._retired.clear()
        self._offset = 0

    def record(self) -> None:
        """Mark the copies queued so far (to_device's, and the caller's from page-locked memory
        it reuses on the next plan, e.g. the int workspace mirrors): begin() waits for them."""
        if self.device.type == "cuda":
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self.device))
        self._unrecorded = False

    def queued(self) -> None:
        """The caller queued a copy out of page-locked memory that it rewrites on its next plan
        (record() at the end of plan() marks it; begin() waits for it)."""
        self._unrecorded = True

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the staging's device: itself where it is there already, a host tensor through
        the page-locked buffer (a copy from pageable memory would wait for the queued kernels)."""
        where = t.device
        if where == self.device:
            return t
        if where.type == "cpu" and self.device.type == "cuda":
            return self.to_device(t, t.dtype)
        return t.to(self.device)

    def to_device(self, values: Sequence[int] | torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """``values`` as a 1-D ``dtype`` tensor on the device (a CPU tensor is copied as it is)."""
        host = values.reshape(-1).to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host.to(self.device)
        nbytes = host.numel() * host.element_size()
        if self._buffer is None or self._offset + nbytes > self._buffer.numel():
            if self._buffer is not None:
                self._retired.append(self._buffer)
            self._buffer = torch.empty(max(2 * (self._offset + nbytes), 1 << 16), dtype=torch.uint8, pin_memory=True)
            self._offset = 0
        region = self._buffer[self._offset:self._offset + nbytes].view(dtype)
        self._offset += -(-nbytes // ALIGN) * ALIGN
        region.copy_(host)
        self.queued()
        return region.to(self.device, non_blocking=True)


INT_WORKSPACE_BYTES = 8 << 20  # FlashInfer's int workspace size (its wrappers' default)


class IntWorkspaces:
    """Int workspaces for FlashInfer's schedulers, one per launch: (device buffer, page-locked
    host mirror of the same size), made on first use and kept."""

    def __init__(self, device: torch.device, nbytes: int = INT_WORKSPACE_BYTES):
        self.device = device
        self.nbytes = nbytes
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self._pairs) <= i:
            self._pairs.append((torch.empty(self.nbytes, dtype=torch.uint8, device=self.device),
                                torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")))
        return self._pairs[i]
