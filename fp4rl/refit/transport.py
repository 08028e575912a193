"""How refit records get from the sender to the receiver: one interface, two transports.

A `Transport` has ``send(records)`` for the trainer's side and ``receive()`` (an iterator of
records) for the engine's, which `RefitReceiver.receive` consumes.

- `InProcessTransport`: trainer and engine colocated in one process. The receiver pulls records
  straight from the sender's generator: each tensor is the trainer's own parameter, quantized
  or copied from where it lies, with no host round trip and no staged copy of the model.
- `DistributedTransport`: a trainer process and an engine process, over `torch.distributed`
  point-to-point (NCCL between GPUs, gloo on CPUs). Each record is a length-prefixed JSON header
  (a small uint8 tensor), followed, for a tensor, by the tensor itself. Every wait has a
  timeout, and a peer that dies surfaces as an error on the other side (gloo reports the closed
  connection at once), so neither side waits forever.

Does not own any check: the receiver checks what arrives.
"""

from __future__ import annotations

import json
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
    """Point-to-point with rank ``peer`` of ``group``; a sender's failure becomes an `Abort`."""

    def __init__(self, peer: int, *, group=None, timeout: timedelta = timedelta(minutes=5)):
        self.peer, self.group, self.timeout = peer, group, timeout
        # NCCL moves CUDA tensors only, headers included; gloo moves CPU tensors.
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"

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
        while True:
            header = self._recv_header()
            kind = header.get("kind")
            if kind == "tensor":
                dtype = getattr(torch, header["dtype"].removeprefix("torch."), None)
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(f"{header['name']}: unknown dtype {header['dtype']!r}")
                tensor = torch.empty(header["shape"], dtype=dtype, device=self.device)
                self._wait(dist.irecv(tensor, self.peer, self.group), header["name"])
                yield NamedTensor(header["name"], tensor)
            elif kind == "end":
                yield EndOfStream(header["policy_version"], tuple(header["inventory"]))
                return
            elif kind == "abort":
                yield Abort(header["reason"])
                return
            else:
                raise ValueError(f"not a refit header: {header!r}")

    def _send(self, record: Record) -> None:
        if isinstance(record, NamedTensor):
            t = record.tensor
            header = {"kind": "tensor", "name": record.name, "shape": list(t.shape)}
            header["dtype"] = str(t.dtype)
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
        if isinstance(record, NamedTensor):
            data = record.tensor.detach().to(self.device).contiguous()
            self._wait(dist.isend(data, self.peer, self.group), record.name)

    def _recv_header(self) -> dict:
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(length, self.peer, self.group), "header")
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._wait(dist.irecv(payload, self.peer, self.group), "header")
        return json.loads(bytes(payload.cpu().numpy()).decode())

    def _wait(self, work, what: str) -> None:
        if work.wait(self.timeout) is False:
            raise TimeoutError(
                f"refit {what}: no transfer with rank {self.peer} within {self.timeout}"
            )
