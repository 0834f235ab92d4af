"""Bounded memory with images: 160 chat requests through the real server, each with a
distinct 224 px image (600 KB of float32 pixels after processing), and the server process
tree's resident memory after the first 60 (a warm-up: allocator arenas and the prefix
cache's tables grow by some 20-40 MiB, then level off) against after all 160. Anything that
kept an image per request (the processor cache past its limit, pixel values or features left
in the scheduler or the worker) would add at least 100 x 600 KB = 60 MB (an unbounded
processor cache: 66 MiB); measured growth is a few MiB. The processor cache is set to 4 MiB
(--mm-processor-cache-gb) so that it fills and evicts within the test. The 1,000-request
version: benchmarks/image_memory.py."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL", reason="images need pillow (a dependency in pyproject.toml)")
pytest.importorskip("psutil", reason="resident memory needs psutil")

from tests.api.conftest import MODEL_NAME, ServerProcess, served
from tests.multimodal.memory_soak import soak
from tests.multimodal.tiny_llava import build_tiny_llava

IMAGE_SIZE = 224  # 16 x 16 patches: 256 image tokens
MAX_GROWTH = 24 * 2**20


@pytest.mark.slow
def test_distinct_images_leave_resident_memory_bounded(tmp_path):
    model_dir = build_tiny_llava(str(tmp_path / "llava224"), image_size=IMAGE_SIZE)
    process = ServerProcess(model_dir, tmp_path / "server.log", "--mm-processor-cache-gb", "0.004",
                            "--log-level", "warning")
    for server in served(process):
        samples = soak(server.url, MODEL_NAME, server.popen.pid, num_requests=160, image_size=IMAGE_SIZE,
                       num_samples=8)
        assert samples[2][0] == 60
        growth = samples[-1][1] - samples[2][1]
        assert growth < MAX_GROWTH, f"resident memory grew {growth / 2**20:.1f} MiB: {samples}"
