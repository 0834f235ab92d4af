"""Bounded memory with images: 1,000 chat requests through the real server
(`python -m actors.launch`), each with a distinct random image, and the resident memory of
the server's whole process tree (launcher, API, every actor) as they go. The model is the
tiny random LLaVA of the tests with a 224 px CLIP tower (256 image tokens, 600 KB of float32
pixel values per processed image); the images are 224 px PNG data URLs.

    python benchmarks/image_memory.py
    python benchmarks/image_memory.py --num-requests 200 --mm-processor-cache-gb 0.004

Prints RSS at evenly spaced points and the growth after the first point (a warm-up: the
processor cache fills, allocator arenas settle). Bounded: the growth stays near zero
however many requests; anything kept per image would add about 0.6 MB a request.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

if __name__ == "__main__":  # this checkout first, and benchmarks/kernels.py must not shadow kernels/
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [os.path.dirname(_here)] + [path for path in sys.path
                                           if os.path.abspath(path or os.curdir) != _here]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--mm-processor-cache-gb", default=None, help="the server's flag (default: its default)")
    args = parser.parse_args()

    from pathlib import Path

    from tests.api.conftest import MODEL_NAME, ServerProcess
    from tests.multimodal.memory_soak import soak
    from tests.multimodal.tiny_llava import build_tiny_llava

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_llava(os.path.join(tmp, "llava"), image_size=args.image_size)
        flags = ["--log-level", "warning"]
        if args.mm_processor_cache_gb is not None:
            flags += ["--mm-processor-cache-gb", args.mm_processor_cache_gb]
        server = ServerProcess(model_dir, Path(tmp) / "server.log", *flags)
        try:
            start = time.perf_counter()
            samples = soak(server.url, MODEL_NAME, server.popen.pid, args.num_requests, args.image_size,
                           args.concurrency, args.samples)
            elapsed = time.perf_counter() - start
        finally:
            server.stop()
    first = samples[0][1]
    for done, rss in samples:
        print(f"{done:6d} requests: RSS {rss / 2**20:8.1f} MiB ({(rss - first) / 2**20:+6.1f})")
    half = samples[len(samples) // 2 - 1]
    print(f"{args.num_requests} requests with distinct {args.image_size} px images in {elapsed:.1f} s: RSS growth "
          f"after the first {samples[0][0]} {(samples[-1][1] - first) / 2**20:+.1f} MiB, over the last "
          f"{samples[-1][0] - half[0]} {(samples[-1][1] - half[1]) / 2**20:+.1f} MiB")


if __name__ == "__main__":
    main()
