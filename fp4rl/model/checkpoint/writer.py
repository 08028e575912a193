"""Writing an fp4rl state dict as a Hugging Face safetensors checkpoint.

Owns ``save_checkpoint``: the hub per-expert layout (whatever layout was read), sharding with an
index, config.json, the atomic write through a temporary sibling directory (``write_checkpoint``,
also used for checkpoints that hold more than weights: `fp4rl.export`'s packed NVFP4), and the
safetensors file format itself (``_write_safetensors``: safetensors' own writer makes every file
0600). Does not own the name table (``names``) or reading (``reader``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

from fp4rl.model.checkpoint.names import INDEX_FILE, MODEL_FILE, fp4rl_to_hf, non_finite
from fp4rl.model.config import ModelConfig

# .NAME.partial-HOST-PIDNS-PID-RANDOM: a save in progress, or the leftover of a killed one.
_PARTIAL = re.compile(r"\..+\.partial-(?P<host>.+)-(?P<pidns>\d+)-(?P<pid>\d+)-[0-9a-f]{12}")
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
# What a file may hold besides weights: packed E2M1 codes and E4M3 block scales (fp4rl.export).
_STORED = {**_DTYPES, torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}


def save_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    config: ModelConfig,
    path: str | Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
    files: Mapping[str, bytes] | None = None,
) -> None:
    """Write config.json and the hub per-expert safetensors layout (sharded with an index when
    larger than ``max_shard_bytes``) to the new directory ``path``.

    Atomic: everything is written and fsynced in a temporary sibling directory that is then
    renamed to ``path``, so a crash or error never leaves a partial checkpoint. An existing
    non-empty ``path`` is never overwritten. A state dict that does not match ``config``, holds
    a NaN or infinity, or a dtype other than F64, F32, F16 or BF16 raises ValueError naming
    every such tensor; nothing is written. Every file and the directory take the process umask.
    ``files`` (name -> content: a tokenizer, generation_config.json) are written beside them.

    The temporary directory is ``.NAME.partial-HOST-PIDNS-PID-RANDOM``: the writer's host name,
    PID namespace and process id. A save killed before its rename leaves it behind; each save
    first removes those in the same parent directory whose writer is dead: written under this
    host name and PID namespace by a process id that no longer exists (``os.kill(pid, 0)``
    raises ProcessLookupError). Anything that cannot be shown dead is left alone: a partial
    directory of a live process (a save still running), of another host or PID namespace (a
    shared file system, another container), or of another naming.
    """
    _check_target(path, max_shard_bytes)
    tensors = fp4rl_to_hf(state_dict, config)
    bad = [
        f"{name}: dtype {t.dtype}; fp4rl writes (as it loads) F64, F32, F16 or BF16"
        for name, t in state_dict.items()
        if t.dtype not in _DTYPES
    ]
    bad += non_finite(state_dict)
    if bad:
        raise ValueError(f"refusing to save {path}; nothing was written:\n  " + "\n  ".join(bad))
    dtype = str(tensors["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    config_json = config.to_hf_dict(dtype=dtype)
    write_checkpoint(path, tensors, config_json, files=files, max_shard_bytes=max_shard_bytes)


def write_checkpoint(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor],
    config_json: dict,
    *,
    files: Mapping[str, bytes] | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write hub-named ``tensors`` (F64, F32, F16, BF16, U8 or F8_E4M3), ``config_json`` as
    config.json and ``files`` to the new directory ``path``, sharded and atomically as
    `save_checkpoint` says. Checks the target only: `save_checkpoint` checks a state dict
    first, a caller with other tensors checks its own."""
    _check_target(path, max_shard_bytes)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_partials(path.parent)
    # mkdir rather than tempfile.mkdtemp: that makes the directory 0700, unreadable by others.
    tmp = partial_path(path)
    tmp.mkdir()
    try:
        _write(tmp, tensors, config_json, max_shard_bytes)
        for name, content in (files or {}).items():
            _write_bytes(tmp / name, content)
        fsync_path(tmp)  # the file names inside it, before they become visible under `path`
        os.rename(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_target(path: str | Path, max_shard_bytes: int) -> None:
    if type(max_shard_bytes) is not int or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    path = Path(path)
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not an empty directory; not overwriting it")


def _writer() -> str:
    """HOST-PIDNS: where a process id names one process (0 when /proc does not say)."""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    return f"{socket.gethostname()}-{pidns}"


def partial_path(final: Path) -> Path:
    """The temporary sibling a write of ``final`` goes to before its rename:
    ``.NAME.partial-HOST-PIDNS-PID-RANDOM``, which `remove_dead_partials` recognizes."""
    return final.with_name(
        f".{final.name}.partial-{_writer()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    )


def remove_dead_partials(parent: Path) -> list[Path]:
    """Remove the partial directories in ``parent`` of writers whose process is gone (this host
    and PID namespace, a process id that no longer exists); returns them. Those of a live
    process or of another host are left alone."""
    here, removed = _writer(), []
    for entry in parent.iterdir():
        m = _PARTIAL.fullmatch(entry.name)
        if m is None or f"{m['host']}-{m['pidns']}" != here or not entry.is_dir():
            continue
        try:
            os.kill(int(m["pid"]), 0)
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)  # another save may be removing it too
            removed.append(entry)
        except (OSError, OverflowError):  # EPERM: a live process of another user
            pass
    return removed


def _write(
    directory: Path, tensors: Mapping[str, torch.Tensor], config_json: dict, max_shard_bytes: int
) -> None:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():  # model order keeps a layer's tensors together
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    n = len(shards)
    files = (
        [MODEL_FILE]
        if n == 1
        else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    )
    for file, shard in zip(files, shards, strict=True):
        _write_safetensors(directory / file, {name: tensors[name] for name in shard})
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {
            name: file for file, shard in zip(files, shards, strict=True) for name in shard
        }
        _write_json(
            directory / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map}
        )
    _write_json(directory / "config.json", config_json)


def _write_safetensors(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file: an 8-byte little-endian header length, the JSON header (each
    tensor's dtype, shape and [begin, end) byte offsets in the data that follows, and the
    ``format`` metadata transformers expects), then the raw bytes of each tensor in turn.

    Written here rather than by ``safetensors.torch.save_file``: safetensors 0.8 writes a
    ``tempfile`` (created 0600, whatever the umask) and renames it over ``file``, which left
    checkpoints unreadable by other users. Created by open(), the file takes the process umask
    like config.json. Tensors go to disk one at a time from their views: no copy of a shard.
    """
    # Larger elements first, so that every tensor starts aligned to its element size.
    names = sorted(tensors, key=lambda name: -tensors[name].element_size())
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        t = tensors[name]
        end = offset + t.numel() * t.element_size()
        header[name] = {
            "dtype": _STORED[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the spec allows trailing spaces; the data starts 8-aligned
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in names:  # bytes in the machine's order: little-endian, as the spec says
            t = tensors[name].detach().to("cpu").contiguous()
            f.write(t.view(-1).view(torch.uint8).numpy())
        f.flush()
        os.fsync(f.fileno())


def _write_json(file: Path, obj: object) -> None:
    _write_bytes(file, (json.dumps(obj, indent=2) + "\n").encode())


def _write_bytes(file: Path, content: bytes) -> None:
    file.write_bytes(content)
    fsync_path(file)


def fsync_path(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
