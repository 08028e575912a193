"""`DistributedTransport`'s framing, in one process: its point-to-point calls go to a wire that
queues each send and hands it to the receive that matches it, in order, as gloo and NCCL do.

Claims: every record arrives as sent (name, dtype, shape, bits), whatever its dtype or layout;
only contiguous uint8 and int64 tensors on the transport's device travel, and nothing for an
empty tensor; a tensor header the receiver cannot read is named, and the rest of its stream is
read first, so the sender's sends complete and the next stream arrives in step; a sender's
exception arrives as an `Abort`; a failed or timed-out wait names the tensor; the transport
refuses a timeout that is not positive and, over NCCL, a device that is not a GPU. The real
backends run in `test_refit_distributed.py`.
"""

import json
from collections import deque
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fp4rl.refit import Abort, DistributedTransport, EndOfStream, NamedTensor

CPU = torch.device("cpu")


class Done:
    def __init__(self, result=True, error=None):
        self.result, self.error = result, error

    def wait(self, timeout):
        if self.error:
            raise self.error
        return self.result


class Wire:
    """Point-to-point between two ranks of one process; ``fail`` maps a send's ordinal to the
    `Done` its wait gives."""

    def __init__(self):
        self.queue: deque[torch.Tensor] = deque()
        self.sent: list[tuple[torch.dtype, int]] = []
        self.fail: dict[int, Done] = {}

    def isend(self, tensor, dst, group=None):
        assert tensor.is_contiguous() and tensor.device == CPU, (tensor.stride(), tensor.device)
        self.queue.append(tensor.clone())
        self.sent.append((tensor.dtype, tensor.numel()))
        return self.fail.get(len(self.sent) - 1, Done())

    def irecv(self, tensor, src, group=None):
        sent = self.queue.popleft()
        assert (sent.dtype, sent.shape) == (tensor.dtype, tensor.shape), (sent, tensor)
        assert tensor.is_contiguous() and tensor.device == CPU
        tensor.copy_(sent)
        return Done()

    def rewrite_header(self, name: str, old: bytes, new: bytes) -> None:
        """Replace ``old`` by ``new`` (as long) in the queued header of tensor ``name``."""
        for t in self.queue:
            text = bytes(t.numpy())
            if t.dtype == torch.uint8 and f'"name": "{name}"'.encode() in text:
                t.copy_(torch.frombuffer(bytearray(text.replace(old, new)), dtype=torch.uint8))
                return
        raise AssertionError(f"no header of {name} on the wire")


@pytest.fixture
def wire(monkeypatch):
    wire = Wire()
    monkeypatch.setattr(dist, "isend", wire.isend)
    monkeypatch.setattr(dist, "irecv", wire.irecv)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    return wire


def stream() -> list:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "fp32": torch.randn(3, 5, generator=gen),
        "bf16": torch.randn(4, 16, generator=gen).bfloat16(),
        "transposed": torch.randn(6, 4, generator=gen).t(),  # not contiguous
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.empty(0, 4),
        "mask": torch.rand(7, generator=gen) > 0.5,
    }
    records = [NamedTensor(name, t) for name, t in tensors.items()]
    return [*records, EndOfStream(4, tuple(tensors))]


def test_records_arrive_as_sent_whatever_their_dtype_and_layout(wire):
    transport, sent = DistributedTransport(1), stream()
    transport.send(sent)
    got = list(transport.receive())
    assert not wire.queue
    assert len(got) == len(sent) and got[-1] == sent[-1]
    for a, b in zip(got[:-1], sent[:-1], strict=True):
        assert a.name == b.name and a.tensor.dtype == b.tensor.dtype
        assert a.tensor.shape == b.tensor.shape and a.tensor.is_contiguous()
        assert a.tensor.device == CPU
        bits = (lambda t: t.view(torch.uint8)) if a.tensor.ndim else (lambda t: t.reshape(1))
        assert torch.equal(bits(a.tensor.contiguous()), bits(b.tensor.contiguous())), a.name
    # Each record: an int64 length and a uint8 header; each non-empty tensor: its uint8 bytes.
    assert {dtype for dtype, _ in wire.sent} == {torch.int64, torch.uint8}
    assert len(wire.sent) == 2 * len(sent) + sum(r.tensor.numel() > 0 for r in sent[:-1])


def test_unreadable_tensor_header_is_named_after_the_rest_of_its_stream_is_read(wire):
    transport = DistributedTransport(1)
    transport.send(stream())
    wire.rewrite_header("fp32", b'"torch.float32"', b'"torch.float99"')
    with pytest.raises(ValueError, match=r"fp32: unknown dtype 'torch.float99'"):
        list(transport.receive())
    assert not wire.queue  # every send of the stream was received
    transport.send(stream())  # the next stream arrives in step
    assert [r.name for r in transport.receive() if isinstance(r, NamedTensor)][0] == "fp32"


def test_bytes_that_do_not_fit_the_header_are_named(wire):
    transport = DistributedTransport(1)
    transport.send(stream())
    wire.rewrite_header("bf16", b'"shape": [4, 16]', b'"shape": [4, 17]')
    with pytest.raises(ValueError, match=r"bf16: 128 bytes do not hold torch.bfloat16 of shape"):
        list(transport.receive())
    assert not wire.queue


def test_sender_exception_arrives_as_abort(wire):
    def failing():
        yield from stream()[:2]
        raise RuntimeError("out of memory")

    transport = DistributedTransport(1)
    with pytest.raises(RuntimeError, match="out of memory"):
        transport.send(failing())
    got = list(transport.receive())
    assert [type(r) for r in got] == [NamedTensor, NamedTensor, Abort]
    assert got[-1].reason == "RuntimeError: out of memory"


@pytest.mark.parametrize(
    ("done", "error"),
    [
        (Done(result=False), TimeoutError),
        (Done(error=RuntimeError("Connection closed by peer")), ConnectionError),
    ],
)
def test_failed_wait_names_the_tensor(wire, done, error):
    wire.fail[2] = done  # the first record's bytes, after its length and header
    transport = DistributedTransport(1, timeout=timedelta(seconds=3))
    with pytest.raises(error, match=r"refit fp32: .*rank 1"):
        transport.send(stream())


def test_bad_settings_are_refused(wire, monkeypatch):
    with pytest.raises(ValueError, match="timeout must be a positive timedelta, got 0"):
        DistributedTransport(1, timeout=0)
    with pytest.raises(ValueError, match="positive timedelta"):
        DistributedTransport(1, timeout=timedelta(0))
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        with pytest.raises(ValueError, match="over NCCL needs a CUDA device, got cpu"):
            DistributedTransport(1, device="cpu")


def test_headers_are_json_the_peer_can_read(wire):
    DistributedTransport(1).send([EndOfStream(1, ("a",))])
    length, payload = wire.queue
    assert length.item() == payload.numel()
    assert json.loads(bytes(payload.numpy())) == {
        "kind": "end", "policy_version": 1, "inventory": ["a"]
    }  # fmt: skip
