"""The data pipeline at size: tokenisation throughput of the token cache against a plain `datasets.map` of the same
tokenizer (same corpus, same processes, same run), and resident memory per rank while training on generated
corpora of two sizes (the larger >= 1 GB), to show that memory does not grow with the corpus.

    nice python -m benchmarks.data_pipeline            # 64 MB for throughput; 256 MB and 1 GB for memory (~20 min)
    python -m benchmarks.data_pipeline --quick         # a few MB: checks the script works, measures nothing

Corpora are JSON lines ({"text": ...}) of generated documents (0.2-3 KB of words) written into a temporary
directory. Throughput: "ours" is the whole build of a token cache (`portable_fsdp/data/cache.py`: the JSON read into
Arrow, `Dataset.map(batched=True, num_proc)` through our row encoder, the ids appended to tokens.bin, renamed into
place); "plain" is `load_dataset("json")` then `Dataset.map(lambda b: tok(b["text"]), batched=True, num_proc)` with
the same tokenizer as a transformers fast tokenizer (for `byte`, the equivalent fast tokenizer checkpoints are saved
with), which leaves lists of ids in Arrow and no packed stream. Both start from a cold `datasets` cache. tokens/s
counts the ids each produced (ours: with one end-of-document id per document).
Memory: `python -m portable_fsdp.run` with 2 CPU ranks trains a tiny Llama (the test recipe's) for --steps steps on
each corpus, its cache built beforehand (timed: the throughput at that size); metrics.jsonl's per-rank resident set
at the start (model and data opened), at the first log and at the end; and, sampled every 0.5 s from /proc, each
worker's largest heap (RssAnon) and resident pages of its token-cache mappings (tokens.bin, the epoch order).
Results: benchmarks/results/data_pipeline.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.common import ROOT, machine, table, write_json

WORDS_SEED = 7
TEST_RECIPE = str(ROOT / "portable_fsdp" / "configs" / "llama_tiny.py") + ":test"


# ---------------------------------------------------------------- corpora

def generate_corpus(path: pathlib.Path, nbytes: int, seed: int = 0) -> dict:
    """JSON lines of documents of random words until `nbytes`: a pool of 4,096 documents written over and over,
    each line numbered, so that writing a gigabyte takes seconds."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocabulary = ["".join(rng.choice(letters, int(n))) for n in rng.integers(2, 10, 3000)]
    pool = [" ".join(rng.choice(vocabulary, int(n))) for n in rng.integers(40, 500, 4096)]
    written = documents = 0
    with open(path, "w") as f:
        while written < nbytes:
            line = json.dumps({"text": f"{documents} {pool[documents % len(pool)]}"}) + "\n"
            f.write(line)
            written += len(line)
            documents += 1
    return {"bytes": written, "documents": documents}


def train_bpe(directory: pathlib.Path, corpus: pathlib.Path, vocab_size: int = 8192) -> pathlib.Path:
    """A byte-level BPE tokenizer trained on the corpus's first 4 MB, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sample = []
    with open(corpus) as f:
        for line in f:
            sample.append(json.loads(line)["text"])
            if sum(map(len, sample)) > 4 << 20:
                break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(directory))
    return directory


# ---------------------------------------------------------------- throughput

def data_config(source: pathlib.Path, tokenizer: str, cache_dir: pathlib.Path, num_proc: int):
    from portable_fsdp.config.schema import base_config

    cfg = base_config().data
    cfg.source, cfg.tokenizer, cfg.cache_dir, cfg.num_proc = str(source), tokenizer, str(cache_dir), num_proc
    cfg.seq_len = 64
    return cfg


def ours(source: pathlib.Path, tokenizer: str, cache_dir: pathlib.Path, num_proc: int) -> dict:
    from portable_fsdp.data.loader import build_token_data

    began = time.perf_counter()
    build_token_data(data_config(source, tokenizer, cache_dir, num_proc), 2**17, 1)
    seconds = time.perf_counter() - began
    (meta,) = [json.loads(p.read_text()) for p in cache_dir.glob("*/meta.json")]
    return {"seconds": seconds, "tokens": meta["n_tokens"], "tokens_per_s": meta["n_tokens"] / seconds,
            "processes": meta["built"]["processes"]}


def plain(source: pathlib.Path, tokenizer: str, hf_cache: pathlib.Path, num_proc: int) -> dict:
    """load_dataset + map(tokenizer(batch["text"])) as a user would write it, with the same tokenizer."""
    import datasets
    import pyarrow.compute as pc
    from transformers import AutoTokenizer

    from portable_fsdp.data.tokenizers import byte_tokenizer_for_transformers

    tok = byte_tokenizer_for_transformers() if tokenizer == "byte" else AutoTokenizer.from_pretrained(tokenizer)
    began = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=str(source), split="train", cache_dir=str(hf_cache))
    mapped = dataset.map(lambda batch: tok(batch["text"], add_special_tokens=False), batched=True,
                         num_proc=num_proc if num_proc > 1 else None, remove_columns=["text"])
    seconds = time.perf_counter() - began
    tokens = sum(pc.sum(pc.list_value_length(chunk)).as_py() for chunk in mapped.data.table.column("input_ids").chunks)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def throughput(work: pathlib.Path, nbytes: int, num_proc: int) -> list:
    corpus = work / "throughput.jsonl"
    shape = generate_corpus(corpus, nbytes, seed=1)
    bpe = str(train_bpe(work / "bpe8k", corpus))
    rows = []
    for name, tokenizer in (("byte", "byte"), ("BPE, 8,192 ids", bpe)):
        mine = ours(corpus, tokenizer, work / f"cache-{name[:4]}", num_proc)
        theirs = plain(corpus, tokenizer, work / f"hf-{name[:4]}", num_proc)
        rows.append({"tokenizer": name, "corpus_bytes": shape["bytes"], "documents": shape["documents"],
                     "num_proc": num_proc, "ours": mine, "plain": theirs,
                     "ratio": mine["tokens_per_s"] / theirs["tokens_per_s"]})
        print(f"throughput {name}: ours {mine['tokens_per_s']:,.0f} tokens/s, plain map {theirs['tokens_per_s']:,.0f} "
              f"tokens/s, ratio {rows[-1]['ratio']:.2f}", flush=True)
        shutil.rmtree(work / f"cache-{name[:4]}", ignore_errors=True)
        shutil.rmtree(work / f"hf-{name[:4]}", ignore_errors=True)
    return rows


# ---------------------------------------------------------------- memory while training

def _status(pid: int, cache_dir: pathlib.Path) -> dict:
    """RssAnon (the heap: what the process allocated) and RssFile (mapped files: libraries, the token cache) of a
    process, and the resident pages of its mappings of files under `cache_dir`, in MiB."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                key, value = line.split(":")
                values[key] = int(value.split()[0]) / 1024
    cache, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if not line[0].isupper() or line.startswith("VmFlags"):  # a mapping's header: address range, path
                inside = str(cache_dir) in line
            elif inside and line.startswith("Rss:"):
                cache += int(line.split()[1])
    values["cache"] = cache / 1024
    return values


class Sampler(threading.Thread):
    """The launcher's worker processes' resident memory, every 0.5 s, largest value per process and kind."""

    def __init__(self, launcher_pid: int, cache_dir: pathlib.Path):
        super().__init__(daemon=True)
        self.launcher_pid, self.cache_dir, self.peaks, self.stop = launcher_pid, cache_dir, {}, threading.Event()

    def run(self):
        import psutil

        while not self.stop.wait(0.5):
            try:
                children = psutil.Process(self.launcher_pid).children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for child in children:
                try:
                    if "spawn_main" not in " ".join(child.cmdline()):
                        continue
                    for key, value in _status(child.pid, self.cache_dir).items():
                        peak = self.peaks.setdefault(child.pid, {})
                        peak[key] = max(peak.get(key, 0.0), value)
                except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
                    continue


def train_memory(work: pathlib.Path, nbytes: int, steps: int, num_proc: int) -> dict:
    corpus = work / f"corpus-{nbytes >> 20}MB.jsonl"
    began = time.perf_counter()
    shape = generate_corpus(corpus, nbytes, seed=2)
    generated = time.perf_counter() - began
    cache_dir = work / f"cache-{nbytes >> 20}MB"
    build = ours(corpus, "byte", cache_dir, num_proc)
    print(f"memory {nbytes >> 20} MB: generated in {generated:.0f} s, cache built in {build['seconds']:.0f} s "
          f"({build['tokens_per_s']:,.0f} tokens/s); training {steps} steps", flush=True)
    workdir = work / f"run-{nbytes >> 20}MB"
    args = [sys.executable, "-m", "portable_fsdp.run", "--config", TEST_RECIPE, "--workdir", str(workdir),
            "--nproc", "2", f"--config.data.source={corpus}", f"--config.data.cache_dir={cache_dir}",
            f"--config.train.steps={steps}", f"--config.train.log_every={max(1, steps // 10)}",
            "--config.train.progress_bar=false"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "USE_TORCH_XLA": "0", "OMP_NUM_THREADS": "1"})
    sampler = Sampler(proc.pid, cache_dir)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=3600)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        sampler.stop.set()
        sampler.join()
    if proc.returncode:
        raise RuntimeError(f"training on {corpus.name} failed: {err.strip().splitlines()[-1:]}")
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    (start,) = [r for r in records if r.get("event") == "start"]
    train = [r for r in records if "loss" in r]
    shutil.rmtree(cache_dir, ignore_errors=True)
    corpus.unlink()
    mem = {"start": start["mem_mb"], "first_log": train[0]["mem_mb"], "end": train[-1]["mem_mb"],
           "peak": train[-1]["peak_mem_mb"]}
    return {"corpus_bytes": shape["bytes"], "documents": shape["documents"], "tokens": build["tokens"],
            "build": build, "steps": steps, "log_steps": [train[0]["step"], train[-1]["step"]], "mem_mb": mem,
            "growth_mb": [e - s for s, e in zip(mem["start"], mem["end"])],
            "growth_after_first_log_mb": [e - s for s, e in zip(mem["first_log"], mem["end"])],
            "workers_peak_mb": list(sampler.peaks.values())}


def report(payload: dict) -> str:
    rates = table(["tokenizer", "corpus", "processes (ours / plain)", "ours (token cache) tokens/s", "plain datasets.map tokens/s",
                   "ours / plain"],
                  [[r["tokenizer"], f"{r['corpus_bytes'] / 2**20:,.0f} MB, {r['documents']:,} documents",
                    f"{r['ours']['processes']} / {r['num_proc']}", f"{r['ours']['tokens_per_s']:,.0f} ({r['ours']['seconds']:.1f} s)",
                    f"{r['plain']['tokens_per_s']:,.0f} ({r['plain']['seconds']:.1f} s)", f"{r['ratio']:.2f}"]
                   for r in payload["throughput"]])
    rows = []
    for m in payload["memory"]:
        workers = sorted(m["workers_peak_mb"], key=lambda w: -w.get("RssAnon", 0))
        rows.append([f"{m['corpus_bytes'] / 2**30:.2f} GB ({m['tokens'] / 1e6:,.0f}M tokens)",
                     f"{m['build']['seconds']:.0f} s ({m['build']['tokens_per_s'] / 1e6:.1f}M tokens/s)",
                     " / ".join(f"{v:.0f}" for v in m["mem_mb"]["start"]),
                     " / ".join(f"{v:.0f}" for v in m["mem_mb"]["end"]),
                     " / ".join(f"{v:+.0f}" for v in m["growth_mb"]),
                     " / ".join(f"{v:+.0f}" for v in m["growth_after_first_log_mb"]),
                     " / ".join(f"{v:.0f}" for v in m["mem_mb"]["peak"]),
                     " / ".join(f"{w.get('RssAnon', 0):.0f}" for w in workers),
                     " / ".join(f"{w.get('cache', 0):.1f}" for w in workers)])
    memory = table(["corpus", "cache build", "rank 0 / 1 MB at start", "at end", "growth", "growth after first log",
                    "peak", "largest heap (RssAnon) MB", "largest token-cache pages MB"], rows)
    return f"{rates}\n\n{memory}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--throughput-mb", type=int, default=64, help="0: no throughput runs")
    parser.add_argument("--sizes-mb", default="256,1024", help="corpus sizes of the memory runs (MB)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--num-proc", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="a few MB: checks that the script works")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_pipeline.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.throughput_mb, args.sizes_mb, args.steps = 4, "4,8", 10
    sizes = [int(s) << 20 for s in args.sizes_mb.split(",")]
    work = pathlib.Path(tempfile.mkdtemp(prefix="portable_fsdp-data-bench-"))
    try:
        rates = throughput(work, args.throughput_mb << 20, args.num_proc) if args.throughput_mb else []
        memory = [train_memory(work, size, args.steps, args.num_proc) for size in sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    payload = {"machine": machine(), "throughput": rates, "memory": memory, "steps": args.steps}
    if not args.quick:
        write_json(pathlib.Path(args.out), payload)
    print(report(payload))


if __name__ == "__main__":
    main()
