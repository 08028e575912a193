"""`HostRows`: the host memory a generate call's captured rows are copied into, step by step."""

import pytest
import torch

from fp4rl.rollout.rows import HostRows


def rows(n: int, width: int, start: int) -> torch.Tensor:
    return (torch.arange(start, start + n * width) % 251).to(torch.uint8).view(n, width)


def test_steps_land_one_after_another_and_are_handed_over_without_a_copy():
    host = HostRows()
    steps = [rows(n, 48, 1000 * i) for i, n in enumerate((5, 1, 7))]
    firsts = [host.copy_in(step)[1] for step in steps]
    assert firsts == [0, 5, 6]
    chunk = host._chunks[0]
    taken = host.take()
    assert torch.equal(taken, torch.cat(steps))
    assert taken.data_ptr() == chunk.data_ptr()  # a view of the one chunk
    # The rows are the taker's now: the next call writes into memory of its own, one chunk as
    # large as the last call's, and never over the rows taken.
    assert host._chunks == []
    view, first = host.copy_in(rows(2, 48, 7))
    assert first == 0 and view.data_ptr() != chunk.data_ptr()
    assert [c.numel() for c in host._chunks] == [chunk.numel()]
    assert torch.equal(taken, torch.cat(steps))


def test_a_call_that_outgrows_its_chunk_spills_and_leaves_one_chunk_for_the_next(monkeypatch):
    """Chunks of 10 rows at first: a step that does not fit the rest of a chunk starts the next
    (at least as large as all before it), the rows it skips keep their numbers, and the join
    reads every step at its number; then one chunk of the total size holds the next call."""
    width = 32
    monkeypatch.setattr(HostRows, "MIN_CHUNK_BYTES", 10 * width)
    host = HostRows()
    sizes = (6, 3, 4, 9, 2, 25)
    steps = [rows(n, width, 100 * i) for i, n in enumerate(sizes)]
    firsts = [host.copy_in(step)[1] for step in steps]
    # chunk 0: rows 0..10 (6 + 3, one skipped); chunk 1: 10..20 (4, then 9 does not fit);
    # chunk 2 (20 rows, as large as both before it): 20..40 (9 + 2); chunk 3: 40..80 (25).
    assert firsts == [0, 6, 10, 20, 29, 40]
    assert [c.numel() // width for c in host._chunks] == [10, 10, 20, 40]
    taken = host.take()
    for step, first in zip(steps, firsts, strict=True):
        assert torch.equal(taken[first : first + len(step)], step)
    assert taken.shape == (65, width)
    assert host._chunks == []
    assert [host.copy_in(step)[1] for step in steps] == [0, 6, 9, 13, 22, 24]
    assert [c.numel() for c in host._chunks] == [80 * width]  # one chunk of the last call's
    chunk = host._chunks[0]
    assert host.take().data_ptr() == chunk.data_ptr()  # this call fitted it: no concatenation


def test_rows_of_another_width_in_one_call_are_refused_and_release_frees():
    host = HostRows()
    host.copy_in(rows(2, 16, 0))
    with pytest.raises(ValueError, match="rows of 32 bytes in a call of 16-byte rows"):
        host.copy_in(rows(2, 32, 0))
    host.release()
    assert host._chunks == []
    assert host.take().shape == (0, 0)
    host.begin()  # a new call may have another width
    assert host.copy_in(rows(3, 32, 0))[1] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rows_from_the_gpu_land_in_pinned_memory_once_synchronized():
    host = HostRows()
    step = rows(300, 64, 3).cuda()
    view, first = host.copy_in(step)
    assert first == 0 and view.is_pinned()
    torch.cuda.synchronize()
    taken = host.take()
    assert taken.is_pinned() and torch.equal(taken, step.cpu())
