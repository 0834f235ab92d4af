"""The disk KV tier (--kv-offload-dir): a file per prefix-cache block, named by its hash
(a sha256 chain of token ids and extra keys, the same in every process), so a restarted
engine finds the prefixes an earlier one computed.

A file is a header, then the block's keys and values of every layer as raw bytes:

    MAGIC | header length (4 bytes, little-endian) | header (msgpack) | payload

The header holds the model's fingerprint (path, dtype, layers, KV heads, head size, block
size), the payload's length and its sha256. Files are written by a background thread
(to a temporary name, then renamed: a crash leaves no half file under a real name); the
step only copies the block to host memory. At start-up the directory is scanned: a file
whose header is unreadable or from another model is removed, the rest are offered to the
scheduler. A load reads the whole file and checks length and checksum; a file that fails
is removed and reported, and the scheduler recomputes those tokens instead."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
from pathlib import Path

import msgspec
import torch

logger = logging.getLogger(__name__)

MAGIC = b"TROUPEKV1\n"
SUFFIX = ".kv"


def fingerprint(engine, num_kv_heads: int) -> dict:
    """What a block's bytes depend on besides its tokens: the model and the cache layout."""
    m = engine.model
    return {"model": os.path.realpath(m.model_path), "dtype": engine.dtype, "layers": m.num_hidden_layers,
            "kv_heads": num_kv_heads, "head_dim": m.head_dim, "block_size": engine.cache.block_size}


class DiskKV:
    """Block files in one directory: save() in the background, load() checked."""

    def __init__(self, directory: str, fingerprint: dict, block_shape: tuple[int, ...], dtype: torch.dtype,
                 num_layers: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.block_shape = block_shape  # (2 * layers, kv heads, block size, head dim)
        self.dtype = dtype
        self.num_layers = num_layers
        self._pending: dict[bytes, torch.Tensor] = {}  # hash -> block not yet on disk
        self._lock = threading.Lock()
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
        self._writer.start()

    def path(self, block_hash: bytes) -> Path:
        return self.directory / (block_hash.hex() + SUFFIX)

    def scan(self) -> list[bytes]:
        """The hashes of the files whose header matches this model; others are removed."""
        hashes = []
        for path in self.directory.glob("*" + SUFFIX):
            try:
                block_hash = bytes.fromhex(path.name[: -len(SUFFIX)])
                with open(path, "rb") as file:
                    header = self._read_header(file)
                if header["fingerprint"] != self.fingerprint:
                    raise ValueError("stale: another model or cache layout")
            except (OSError, ValueError, KeyError, TypeError, msgspec.DecodeError) as error:
                logger.warning("KV offload: ignoring and removing %s (%s)", path, error)
                path.unlink(missing_ok=True)
                continue
            hashes.append(block_hash)
        return hashes

    def save(self, block_hash: bytes, block: torch.Tensor) -> None:
        """Queues a block (on the CPU, its own memory) for writing."""
        with self._lock:
            self._pending[block_hash] = block
        self._queue.put(block_hash)

    def load(self, block_hash: bytes) -> torch.Tensor | None:
        """The block, or None (and the file removed) when it is missing, short, corrupt or stale."""
        with self._lock:
            pending = self._pending.get(block_hash)
        if pending is not None:
            return pending
        path = self.path(block_hash)
        try:
            with open(path, "rb") as file:
                header = self._read_header(file)
                payload = file.read()
            if header["fingerprint"] != self.fingerprint:
                raise ValueError("stale: another model or cache layout")
            if len(payload) != header["length"] or hashlib.sha256(payload).hexdigest() != header["sha256"]:
                raise ValueError("short or corrupt payload")
            return torch.frombuffer(bytearray(payload), dtype=self.dtype).view(self.block_shape)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, msgspec.DecodeError) as error:
            logger.warning("KV offload: block file %s is unusable (%s): recomputing", path, error)
            path.unlink(missing_ok=True)
            return None

    def flush(self) -> None:
        """Waits until every queued block is on disk."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(10)

    @staticmethod
    def _read_header(file) -> dict:
        if file.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a troupe KV block file")
        length = int.from_bytes(file.read(4), "little")
        return msgspec.msgpack.decode(file.read(length))

    def _write_loop(self) -> None:
        while True:
            block_hash = self._queue.get()
            try:
                if block_hash is None:
                    return
                with self._lock:
                    block = self._pending[block_hash]
                self._write(block_hash, block)
                with self._lock:
                    del self._pending[block_hash]
            except OSError as error:
                logger.warning("KV offload: could not write a block file (%s)", error)
                with self._lock:
                    self._pending.pop(block_hash, None)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes, block: torch.Tensor) -> None:
        payload = block.contiguous().view(torch.uint8).numpy().tobytes()
        header = msgspec.msgpack.encode({"fingerprint": self.fingerprint, "length": len(payload),
                                         "sha256": hashlib.sha256(payload).hexdigest()})
        path = self.path(block_hash)
        temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
        with open(temporary, "wb") as file:
            file.write(MAGIC + len(header).to_bytes(4, "little") + header + payload)
        os.replace(temporary, path)
