"""Preparing `data.source: files` in the driver's memory against streaming it through Ray Data.

A synthetic corpus is written to a temporary directory from the Python standard library's
modules (each copy headed by its own number, so no two documents are equal): half as text files
(one document each), half as JSONL files of `{"text": ...}` rows, each a paragraph. Three
preparations, each in a fresh process so its peak RSS is its own:

  (a) in memory (`prepare_files`) of a corpus it can hold (`--memory-size-mb`);
  (b) streamed (`prepare_streaming`) of the same corpus, side by side with (a);
  (c) streamed of a corpus several times larger than Ray's object store (`--size-mb`, the
      object store `--object-store-mb`);
  (d) training on a streamed corpus (`--train-size-mb`; 0 skips it): one epoch of 2 DDP
      workers (a 38k-parameter GPT, so the data path, not the model, is what is measured)
      reading the splits through Ray Data (`data.feed: ray_data`, `data.cache: false`) while
      the training split's windows, as Ray Data blocks (two int64 columns: 16 bytes a token),
      are at least 3x the object store. Reported: the driver's peak RSS, the largest
      worker's (the run's `peak_rss_mb`), and the share of the step time spent waiting for
      input (`step_data_wait_ms / step_ms`), with the part of it that waited for the first
      batch (the pipeline's read tasks and split coordinator starting) and the share after
      it. Targets: driver and every worker under `DRIVER_RSS_BOUND_MB` /
      `WORKER_RSS_BOUND_MB`, data_wait_fraction <= 0.05, blocks >= 3x the object store.
  (e) tokenize and pack (`--tokenize-size-mb`): raylane's in-memory preparation with a
      byte-level BPE trained on the corpus, against that tokenizer's own `encode_batch` of the
      same documents (`pipeline_vs_tokenizer`, target >= 0.8), medians of 3.

Each reports the driver's peak RSS (and its RSS before preparing: the process with Ray
connected), seconds, MB/s of source text and tokens/s (tokens in the packed streams, bytes
tokenizer, context 256). Timing starts after Ray is connected and the sources are hashed. The
last line printed is one JSON object.

    python benchmarks/data_pipeline.py [--size-mb 400] [--memory-size-mb 40] [--object-store-mb 80]
                                       [--train-size-mb 17] [--tokenize-size-mb 8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

from raylane.config import load_config
from raylane.data import ensure_dataset
from raylane.data.corpus import read_corpus
from raylane.data.files import chat_template_for, find_sources, prepare_files
from raylane.data.streaming import prepare_streaming

ROOT = Path(__file__).resolve().parents[1]
LM = ROOT / "configs" / "train" / "lm_pipeline.yaml"
DDP_LM = ROOT / "configs" / "train" / "lm_serve.yaml"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
CONTEXT = 256
#: (d)'s targets: peak RSS of the driver and of the largest training worker.
DRIVER_RSS_BOUND_MB = 600
WORKER_RSS_BOUND_MB = 1000
#: (d)'s model: small enough that the 2 workers ask for data as fast as they can.
TINY_GPT = ["model.d_model=32", "model.n_heads=2", "model.n_layers=1", "training.batch_size=16"]


def write_corpus(root: Path, size_mb: int, seed: int = 0) -> int:
    """About `size_mb` MB of text and JSONL files under `root`; returns the bytes written."""
    modules = [p.read_text(errors="replace") for p in sorted(STDLIB.glob("*.py"))]
    rng = random.Random(seed)
    (root / "text").mkdir(parents=True)
    written, copy, target = 0, 0, size_mb * 2**20
    jsonl = None
    while written < target:
        text = f"# copy {copy}\n" + rng.choice(modules)
        if copy % 2:
            (root / "text" / f"doc{copy:07d}.txt").write_text(text)
            written += len(text.encode())
        else:
            if jsonl is None or jsonl.tell() > 32 * 2**20:
                jsonl = (root / f"rows{copy:07d}.jsonl").open("w")
            for paragraph in text.split("\n\n"):
                if paragraph.strip():
                    line = json.dumps({"text": paragraph}) + "\n"
                    jsonl.write(line)
                    written += len(line.encode())
            jsonl.flush()
        copy += 1
    return written


def _data_overrides(corpus: Path, out: Path, feed: str) -> list[str]:
    return [
        "data.source=files",
        f"data.files=[{corpus}/**/*.txt,{corpus}/*.jsonl]",
        f"data.train_path={out}/train.parquet",
        f"data.validation_path={out}/validation.parquet",
        f"data.feed={feed}",
        f"model.input_dim={CONTEXT}",
    ]


def _start_ray(object_store_mb: int) -> None:
    import ray  # the benchmark's own Ray: a small object store, on purpose

    ray.init(
        num_cpus=os.cpu_count(),
        object_store_memory=object_store_mb * 2**20,
        include_dashboard=False,
        log_to_driver=False,
    )


def child(mode: str, corpus: Path, out: Path, object_store_mb: int) -> dict:
    """One preparation in this process; its figures."""
    feed = "memory" if mode == "memory" else "ray_data"
    cfg = load_config(LM, _data_overrides(corpus, out, feed))
    if mode != "memory":
        _start_ray(object_store_mb)
    sources = find_sources(cfg)
    before = _peak_rss_mb()
    start = time.perf_counter()
    prepare = prepare_files if mode == "memory" else prepare_streaming
    windows = prepare(cfg, sources)
    seconds = time.perf_counter() - start
    manifest = json.loads((out / "manifest.json").read_text())
    source_mb = sum(entry["bytes"] for entry in sources.entries) / 2**20
    tokens = sum(manifest["tokens"].values())
    return {
        "mode": mode,
        "source_mb": round(source_mb, 1),
        "files": len(sources.files),
        "seconds": round(seconds, 2),
        "mb_per_s": round(source_mb / seconds, 2),
        "tokens_per_s": round(tokens / seconds),
        "tokens": tokens,
        "windows": list(windows),
        "dropped_tokens": manifest.get("dropped_tokens"),
        "peak_rss_mb": round(_peak_rss_mb()),
        "rss_before_prepare_mb": round(before),
    }


class RssTrace:
    """This process's resident memory (`/proc/self/status`), sampled every `interval` s by a
    thread from `start()`: where in a run the driver's memory grows."""

    def __init__(self, interval: float = 1.0):
        self.interval, self.samples = interval, []
        self.done = threading.Event()

    def start(self) -> RssTrace:
        threading.Thread(target=self._sample, daemon=True).start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(self.interval):
            self.samples.append(_rss_mb())

    def stop(self) -> dict:
        """The RSS at each fifth of the traced time (first sample to last), and its maximum."""
        self.done.set()
        samples = self.samples or [_rss_mb()]
        fifths = [samples[round(i * (len(samples) - 1) / 5)] for i in range(6)]
        return {"fifths": [round(mb) for mb in fifths], "max": round(max(samples))}


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def train_child(corpus: Path, out: Path, object_store_mb: int) -> dict:
    """(d) in this process: the corpus prepared streamed, then one epoch of 2 DDP workers
    reading it through Ray Data; its figures."""
    overrides = [*_data_overrides(corpus, out, "ray_data"), "data.cache=false", *TINY_GPT]
    overrides += ["training.epochs=1", f"training.storage_path={out}/runs"]
    overrides += [f"tracking.tracking_uri=sqlite:///{out}/mlflow.db"]
    cfg = load_config(DDP_LM, overrides)
    # Here only: torch and MLflow would add ~250 MB to (a)-(c)'s driver RSS, which they measure.
    from raylane.train.job import run_training

    _start_ray(object_store_mb)
    start = time.perf_counter()
    before_prepare = _rss_mb()
    train, validation = ensure_dataset(cfg)
    prepared = time.perf_counter()
    peak_before_training = _peak_rss_mb()
    trace = RssTrace().start()
    metrics = run_training(cfg, register=False).metrics
    training_rss = trace.stop()
    seconds = time.perf_counter() - prepared
    block_mb = train.rows * 2 * CONTEXT * 8 / 2**20  # features and labels, int64
    wait = metrics["step_data_wait_ms"] / metrics["step_ms"]
    first = metrics["step_first_wait_ms"]  # the pipeline starting: each epoch's first batch
    steady = (metrics["step_data_wait_ms"] - first) / (metrics["step_ms"] - first)
    return {
        "mode": "train",
        "train_windows": train.rows,
        "validation_windows": validation.rows,
        "train_blocks_mb": round(block_mb),
        "train_blocks_over_object_store": round(block_mb / object_store_mb, 2),
        "prepare_seconds": round(prepared - start, 1),
        "train_seconds": round(seconds, 1),
        "epoch_seconds": round(metrics["epoch_time_s"], 1),
        "tokens_per_s": round(train.rows * CONTEXT / metrics["epoch_time_s"]),
        "step_ms": round(metrics["step_ms"], 2),
        "data_wait_fraction": round(wait, 4),
        # Per worker: the per-step mean times each worker's steps (one epoch: its global step).
        "first_batch_wait_s": round(first * metrics["global_step"] / 1000, 2),
        "data_wait_fraction_after_first_batch": round(steady, 4),
        "driver_peak_rss_mb": round(_peak_rss_mb()),
        # Where the driver's memory went: Ray started, the corpus prepared, then the training
        # call (its preflight, the fit, the logging) traced.
        "driver_rss_before_prepare_mb": round(before_prepare),
        "driver_peak_rss_before_training_mb": round(peak_before_training),
        "driver_rss_while_training_mb": training_rss,
        "worker_peak_rss_mb": round(metrics["peak_rss_mb"]),
        "val_loss": round(metrics["val_loss"], 3),
    }


def tokenize_child(corpus: Path, out: Path, _object_store_mb: int = 0, repeats: int = 3) -> dict:
    """(e) raylane's in-memory pipeline (read, split by document, tokenize, pack, write both
    splits) against the tokenizer's own `encode_batch` of the same documents' texts (read
    beforehand, not timed), both with one byte-level BPE (4,096 tokens) trained on the corpus
    first; the median of `repeats` runs each, tokens per second."""
    from tokenizers import Tokenizer

    bpe = ["data.tokenizer={train: {vocab_size: 4096}}", "model.num_classes=4096"]
    prepare_files(load_config(LM, [*_data_overrides(corpus, out / "bpe", "memory"), *bpe]))
    path = out / "bpe" / "tokenizer.json"
    given = [f"data.tokenizer={path}", "model.num_classes=4096"]
    cfg = load_config(LM, [*_data_overrides(corpus, out / "given", "memory"), *given])
    pipeline = []
    for _ in range(repeats):
        start = time.perf_counter()
        prepare_files(cfg)
        seconds = time.perf_counter() - start
        manifest = json.loads((out / "given" / "manifest.json").read_text())
        pipeline.append(sum(manifest["tokens"].values()) / seconds)
    # The same documents, read by raylane's own reader (not timed).
    chat = chat_template_for(cfg, None)[0].pieces
    texts = [doc.text for doc in read_corpus(find_sources(cfg).files, cfg.data, chat).documents]
    tokenizer, alone = Tokenizer.from_file(str(path)), []
    for _ in range(repeats):
        start = time.perf_counter()
        encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
        alone.append(sum(len(e.ids) for e in encoded) / (time.perf_counter() - start))
    pipeline_tps, alone_tps = statistics.median(pipeline), statistics.median(alone)
    return {
        "mode": "tokenize",
        "documents": len(texts),
        "pipeline_tokens_per_s": round(pipeline_tps),
        "tokenizer_tokens_per_s": round(alone_tps),
        "pipeline_vs_tokenizer": round(pipeline_tps / alone_tps, 3),
    }


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB


def run(mode: str, corpus: Path, out: Path, object_store_mb: int) -> dict:
    """`child` in a fresh process (its own peak RSS); its JSON line."""
    command = [sys.executable, __file__, "--child", mode, str(corpus), str(out)]
    command += ["--object-store-mb", str(object_store_mb)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{mode} preparation failed:\n{done.stderr[-3000:]}")
    # The last JSON line: Ray's raylet may print a warning to the driver's stdout after it.
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    figures = json.loads(lines[-1])
    print(json.dumps(figures), flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=400)
    parser.add_argument("--memory-size-mb", type=int, default=40)
    parser.add_argument("--object-store-mb", type=int, default=80)
    parser.add_argument("--train-size-mb", type=int, default=17)
    parser.add_argument("--tokenize-size-mb", type=int, default=8)
    parser.add_argument("--child", nargs=3, metavar=("MODE", "CORPUS", "OUT"))
    args = parser.parse_args()
    if args.child:
        mode, corpus, out = args.child
        modes = {"train": train_child, "tokenize": tokenize_child}
        measure = modes.get(mode, partial(child, mode))
        print(json.dumps(measure(Path(corpus), Path(out), args.object_store_mb)))
        return
    with tempfile.TemporaryDirectory(prefix="raylane-data-bench-") as tmp:
        small, large = Path(tmp) / "small", Path(tmp) / "large"
        write_corpus(small, args.memory_size_mb)
        memory = run("memory", small, Path(tmp) / "out-memory", args.object_store_mb)
        streamed = run("streaming", small, Path(tmp) / "out-small", args.object_store_mb)
        write_corpus(large, args.size_mb, seed=1)
        big = run("streaming", large, Path(tmp) / "out-large", args.object_store_mb)
        write_corpus(Path(tmp) / "tokenize", args.tokenize_size_mb, seed=3)
        tokenized = run("tokenize", Path(tmp) / "tokenize", Path(tmp) / "out-tokenize", 0)
        trained = None
        if args.train_size_mb:
            write_corpus(Path(tmp) / "train", args.train_size_mb, seed=2)
            trained = run(
                "train", Path(tmp) / "train", Path(tmp) / "out-train", args.object_store_mb
            )
    result = {
        "object_store_mb": args.object_store_mb,
        "cpus": os.cpu_count(),
        "memory": memory,
        "streaming_same_corpus": streamed,
        "streaming_large": big,
        "large_over_object_store": round(big["source_mb"] / args.object_store_mb, 1),
        "tokenize": tokenized,
        "train": trained,
    }
    result["targets_met"] = {"pipeline_vs_tokenizer": tokenized["pipeline_vs_tokenizer"] >= 0.8}
    if trained:
        result["targets_met"] |= {
            "stream_peak_rss_mb": trained["driver_peak_rss_mb"] <= DRIVER_RSS_BOUND_MB
            and trained["worker_peak_rss_mb"] <= WORKER_RSS_BOUND_MB,
            "data_wait_fraction": trained["data_wait_fraction"] <= 0.05,
            "train_blocks_over_object_store": trained["train_blocks_over_object_store"] >= 3,
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
