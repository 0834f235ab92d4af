"""Embedding throughput: N texts of 16-256 tokens through troupe's /v1/embeddings (a real
server, the openai client, requests of --batch texts at --concurrency at once) against
sentence-transformers' encode in one process, on one BERT-base-shaped model with random
weights, written once to a temporary directory so both read the same file. Runs alternate
(troupe, sentence-transformers, troupe...), medians and the throughput ratio.

    python benchmarks/embeddings_throughput.py                 # BERT-base shape, 1000 texts
    python benchmarks/embeddings_throughput.py --num-texts 200 --layers 4
    python benchmarks/embeddings_throughput.py --quantization int8   # troupe W8A8, s-t in fp32

It also prints how close troupe's embeddings are to sentence-transformers' (cosine per text,
min and mean): 1.0 up to float rounding in fp32, what 8 bits cost with --quantization int8.

Both sides get the same CPU threads (--threads, default all): sentence-transformers through
torch.set_num_threads in its process, troupe's worker by the same limit (its other actors
are mostly idle while the model runs)."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":  # this checkout's troupe first, then benchmarks/ (serve_vs_offline's Server)
    sys.path = [os.path.dirname(_HERE), _HERE] + [path for path in sys.path
                                                  if os.path.abspath(path or os.curdir) != _HERE]

_WORDS = 30000  # a WordPiece vocabulary of BERT-base's size: special tokens, then one token per word


def write_model(out_dir: str, layers: int, seed: int) -> str:
    """A random BERT-base-shaped BertModel, its WordPiece tokenizer, and sentence-transformers'
    files (CLS pooling, normalised), as a bge-style embedder is saved."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import BertConfig, BertModel, BertTokenizerFast

    base = os.path.join(out_dir, "base")
    os.makedirs(base, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(_WORDS)]
    with open(os.path.join(base, "vocab.txt"), "w") as vocab_file:
        vocab_file.write("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=os.path.join(base, "vocab.txt")).save_pretrained(base)
    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=len(vocab), num_hidden_layers=layers, max_position_embeddings=512)).save_pretrained(base)
    transformer = Transformer(base)
    model = SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(),
                                                              pooling_mode="cls"), Normalize()], device="cpu")
    embedder = os.path.join(out_dir, "embedder")
    model.save(embedder)
    return embedder


def make_texts(num: int, seed: int) -> list[str]:
    """Texts of 14-254 words: 16-256 tokens with [CLS] and [SEP]."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(_WORDS)}" for _ in range(rng.randint(14, 254))) for _ in range(num)]


def time_sentence_transformers(model_dir: str, texts_path: str, threads: int, batch: int, out_path: str) -> float:
    """encode() in a fresh process (as troupe's side starts fresh), timed around the call only;
    the embeddings saved to out_path (.npy)."""
    code = f"""
import json, time, torch
torch.set_num_threads({threads})
from sentence_transformers import SentenceTransformer
texts = json.load(open({texts_path!r}))
model = SentenceTransformer({model_dir!r}, device="cpu")
model.encode(texts[:8], batch_size=8)
start = time.perf_counter()
embeddings = model.encode(texts, batch_size={batch})
print(time.perf_counter() - start)
import numpy
numpy.save({out_path!r}, embeddings)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def time_troupe(server, model: str, texts: list[str], batch: int, concurrency: int) -> tuple[float, list]:
    """Seconds for all texts, and their embeddings in text order."""
    import asyncio

    from openai import AsyncOpenAI

    embeddings: list = [None] * len(texts)

    async def run() -> float:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600)
        limit = asyncio.Semaphore(concurrency)

        async def send(first: int, chunk: list[str]) -> None:
            async with limit:
                response = await client.embeddings.create(model=model, input=chunk)
                assert len(response.data) == len(chunk)
                for item in response.data:
                    embeddings[first + item.index] = item.embedding

        await send(0, texts[:8])  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(send(i, texts[i:i + batch]) for i in range(0, len(texts), batch)))
        elapsed = time.perf_counter() - start
        await client.close()
        return elapsed

    return asyncio.run(run()), embeddings


def cosine_summary(troupe: list, reference_path: str) -> str:
    import numpy

    a, b = numpy.asarray(troupe, dtype=numpy.float64), numpy.load(reference_path).astype(numpy.float64)
    cosine = (a * b).sum(1) / (numpy.linalg.norm(a, axis=1) * numpy.linalg.norm(b, axis=1))
    return f"cosine troupe vs sentence-transformers per text: min {cosine.min():.6f}, mean {cosine.mean():.6f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-texts", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=12, help="BERT-base has 12")
    parser.add_argument("--batch", type=int, default=32, help="texts per request / per encode batch")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096,
                        help="troupe's step budget (an encoder has no decodes to keep responsive; ~ one 32-text batch)")
    parser.add_argument("--quantization", choices=("none", "int8"), default="none",
                        help="troupe's --quantization (sentence-transformers runs fp32 either way)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from serve_vs_offline import Server

    with tempfile.TemporaryDirectory() as work:
        model_dir = write_model(work, args.layers, args.seed)
        texts = make_texts(args.num_texts, args.seed)
        texts_path = os.path.join(work, "texts.json")
        with open(texts_path, "w") as texts_file:
            json.dump(texts, texts_file)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        server = Server(["--model", model_dir, "--served-model-name", "embedder",
                         "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                         "--quantization", args.quantization], [])
        try:
            server.wait_ready()
            troupe, reference = [], []
            reference_path = os.path.join(work, "reference.npy")
            for _ in range(args.repeats):
                seconds, embeddings = time_troupe(server, "embedder", texts, args.batch, args.concurrency)
                troupe.append(seconds)
                reference.append(time_sentence_transformers(model_dir, texts_path, args.threads, args.batch,
                                                            reference_path))
                print(f"troupe {troupe[-1]:.2f} s, sentence-transformers {reference[-1]:.2f} s", flush=True)
            similarity = cosine_summary(embeddings, reference_path)
        finally:
            server.stop()
    t, r = statistics.median(troupe), statistics.median(reference)
    print(similarity)
    print(f"{args.num_texts} texts, {args.layers} layers, {args.threads} threads, troupe steps of "
          f"{args.max_num_batched_tokens} tokens, quantization {args.quantization}: troupe median {t:.2f} s "
          f"({args.num_texts / t:.1f} texts/s), sentence-transformers median {r:.2f} s "
          f"({args.num_texts / r:.1f} texts/s); throughput ratio troupe / sentence-transformers {r / t:.2f}")


if __name__ == "__main__":
    main()
