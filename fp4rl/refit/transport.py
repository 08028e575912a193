"""How refit records get from the sender to the receiver: one interface, two transports.

A `Transport` has ``send(records)`` for the trainer's side and ``receive()`` (an iterator of
records) for the engine's, which `RefitReceiver.receive` consumes.

- `InProcessTransport`: trainer and engine colocated in one process. The receiver pulls records
  straight from the sender's generator: each tensor is the trainer's own parameter, quantized
  or copied from where it lies, with no host round trip and no staged copy of the model.
- `DistributedTransport`: a trainer process and an engine process, over `torch.distributed`
  point-to-point (NCCL between GPUs, gloo on CPUs). Each record is a length-prefixed JSON header
  (a small uint8 tensor), followed, for a tensor, by its bytes (a contiguous uint8 tensor the
  receiver views as the header's dtype and shape; none for an empty tensor). Bytes travel over
  every backend whatever the dtype, and a header the receiver cannot read still says how many
  bytes follow, so the receiver reads the rest of the stream before it raises and the sender's
  sends all complete.

  Every transfer lives on the transport's device: the current CUDA device under NCCL (each
  process calls ``torch.cuda.set_device`` first, or passes ``device``), the CPU under gloo.
  Tensors on another device are copied there before they are sent; received tensors are
  allocated there. Every wait is ``Work.wait(timeout)``, which returns only once the transfer
  has completed (under NCCL it blocks the host as well as ordering the current stream after
  it), so a header is read on the host only after it landed and a received tensor is complete
  before the receiver uses it. A wait past the timeout fails with the tensor's name; a peer
  that dies surfaces at once over gloo (the closed connection). NCCL gives no such notice: the
  other side's wait ends at the timeout, PyTorch then aborts the communicator (the process
  group is unusable afterwards, and its NCCL error handling may take the process down).

Does not own any check: the receiver checks what arrives.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from fp4rl.refit.protocol import Abort, EndOfStream, NamedTensor, Record


class Transport(Protocol):
    def send(self, records: Iterable[Record]) -> None:
        """Hand one stream of records to the receiving side."""

    def receive(self) -> Iterator[Record]:
        """The records of the next stream, up to and including its `EndOfStream` or `Abort`."""


class InProcessTransport:
    """Colocated: ``send`` hands over the sender's generator, ``receive`` runs it."""

    def __init__(self) -> None:
        self._streams: deque[Iterator[Record]] = deque()

    def send(self, records: Iterable[Record]) -> None:
        self._streams.append(iter(records))

    def receive(self) -> Iterator[Record]:
        if not self._streams:
            raise RuntimeError("no refit stream was sent")
        return self._streams.popleft()


class DistributedTransport:
    """Point-to-point with rank ``peer`` of ``group``; a sender's failure becomes an `Abort`.

    ``device`` is where transfers live: by default the current CUDA device under NCCL (set it
    per process first), the CPU otherwise.
    """

    def __init__(
        self,
        peer: int,
        *,
        group=None,
        timeout: timedelta = timedelta(minutes=5),
        device: torch.device | str | None = None,
    ):
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise ValueError(f"timeout must be a positive timedelta, got {timeout!r}")
        self.peer, self.group, self.timeout = peer, group, timeout
        # NCCL moves CUDA tensors only, headers included; gloo moves CPU tensors. A group with
        # both ("cpu:gloo,cuda:nccl") sends over NCCL.
        nccl = "nccl" in str(dist.get_backend(group))
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
        self.device = torch.device(device)
        if nccl and self.device.type != "cuda":
            raise ValueError(f"a transport over NCCL needs a CUDA device, got {self.device}")

    def send(self, records: Iterable[Record]) -> None:
        """Send every record; if producing them raises, send an `Abort` and re-raise."""
        stream = iter(records)
        while True:
            try:
                record = next(stream)
            except StopIteration:
                record = Abort("the sender's stream ended without an end-of-stream record")
            except Exception as err:
                self._send(Abort(f"{type(err).__name__}: {err}"))
                raise
            self._send(record)
            if isinstance(record, EndOfStream | Abort):
                return

    def receive(self) -> Iterator[Record]:
        frames = self._frames()
        for header, data in frames:
            try:
                record = _record(header, data)
            except (KeyError, TypeError, ValueError) as err:
                for _ in frames:  # read the rest, so the sender finishes and the next stream
                    pass  # starts in step
                raise ValueError(f"unreadable refit record: {err}") from err
            yield record

    def _frames(self) -> Iterator[tuple[dict, torch.Tensor | None]]:
        """``(header, bytes or None)`` of each record of one stream, up to its last."""
        while True:
            header = self._recv_header()
            if header.get("kind") != "tensor":
                yield header, None
                return
            data = torch.empty(header["nbytes"], dtype=torch.uint8, device=self.device)
            if data.numel():
                self._wait(dist.irecv(data, self.peer, self.group), header.get("name", "tensor"))
            yield header, data

    def _send(self, record: Record) -> None:
        data = None
        if isinstance(record, NamedTensor):
            t = record.tensor.detach()
            data = t.to(self.device).contiguous().reshape(-1).view(torch.uint8)
            header = {"kind": "tensor", "name": record.name, "shape": list(t.shape)}
            header |= {"dtype": str(t.dtype), "nbytes": data.numel()}
        elif isinstance(record, EndOfStream):
            header = {"kind": "end", "policy_version": record.policy_version}
            header["inventory"] = list(record.inventory)
        elif isinstance(record, Abort):
            header = {"kind": "abort", "reason": record.reason}
        else:
            raise TypeError(f"not a refit record: {type(record).__name__}")
        payload = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        for part in (length, payload):
            self._wait(dist.isend(part.to(self.device), self.peer, self.group), "header")
        if data is not None and data.numel():
            self._wait(dist.isend(data, self.peer, self.group), record.name)

    def _recv_header(self) -> dict:
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(length, self.peer, self.group), "header")
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._wait(dist.irecv(payload, self.peer, self.group), "header")
        return json.loads(bytes(payload.cpu().numpy()).decode())

    def _wait(self, work, what: str) -> None:
        try:
            done = work.wait(self.timeout)
        except Exception as err:  # gloo: a closed connection; NCCL: its own timeout
            raise ConnectionError(
                f"refit {what}: the transfer with rank {self.peer} failed: "
                f"{type(err).__name__}: {err}"
            ) from err
        if done is False:
            raise TimeoutError(
                f"refit {what}: no transfer with rank {self.peer} within {self.timeout}"
            )


def _record(header: dict, data: torch.Tensor | None) -> Record:
    """The record a header (and, for a tensor, its bytes) stands for."""
    kind = header["kind"]
    if kind == "tensor":
        name, shape = header["name"], header["shape"]
        dtype = getattr(torch, str(header["dtype"]).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name}: unknown dtype {header['dtype']!r}")
        if data.numel() != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{name}: {data.numel()} bytes do not hold {dtype} of shape {shape}")
        return NamedTensor(name, data.view(dtype).view(shape))
    if kind == "end":
        return EndOfStream(header["policy_version"], tuple(header["inventory"]))
    if kind == "abort":
        return Abort(header["reason"])
    raise ValueError(f"not a refit header: {header!r}")
