"""Many chat requests, each with a distinct image, through a running server, and the
resident memory of the server's whole process tree (launcher, API, every actor) along the
way: the check that image requests leave nothing behind (tests/multimodal/test_image_memory.py,
benchmarks/image_memory.py)."""

from __future__ import annotations

import base64
import io
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def tree_rss(pid: int) -> int:
    """Resident bytes of the process and all its descendants."""
    import psutil

    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def noise_data_url(size: int, seed: int) -> str:
    """A PNG data URL of size x size random pixels: no two seeds share an image."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def soak(base_url: str, model: str, pid: int, num_requests: int, image_size: int, concurrency: int = 4,
         num_samples: int = 5, timeout_s: float = 60.0) -> list[tuple[int, int]]:
    """Sends num_requests chats of one distinct image each (max_tokens 2), concurrency at a
    time; returns (requests done, tree RSS bytes) at num_samples evenly spaced points."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)

    def one(seed: int) -> None:
        content = [{"type": "image_url", "image_url": {"url": noise_data_url(image_size, seed)}},
                   {"type": "text", "text": "what is it?"}]
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                               max_tokens=2, temperature=0.0)
        assert reply.choices[0].finish_reason in ("length", "stop")

    samples = []
    bounds = np.linspace(0, num_requests, num_samples + 1).astype(int)
    with ThreadPoolExecutor(concurrency) as pool:
        for start, end in zip(bounds[:-1], bounds[1:]):
            list(pool.map(one, range(start, end)))
            time.sleep(0.5)  # let the last replies' buffers go
            samples.append((int(end), tree_rss(pid)))
    return samples
