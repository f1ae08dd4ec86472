"""Token data for training: prepare a corpus once, then read batches by mmap as a pure function of
(seed, step) and the process's rows, so a resumed or multi-process run sees exactly the batches it would
have seen.

``prepare`` tokenises a directory of text files with the ``tokenizers`` library
(a byte-level BPE trained on the training part, or a given tokenizer file),
holds out a fraction of the files (chosen by the seed) and writes token shards
as ``.npy``. With no directory it builds the default corpus deterministically
from the running Python's standard library sources (``Lib/**/*.py``), which
every machine that runs this code has: a small code LM needs no download.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from typing import Optional

import numpy as np

from ..configs import HELD_OUT, MAX_BYTES  # the data section's defaults

PAD, EOS = "<pad>", "<|endoftext|>"  # id 0 is padding (never in text), then end of document
SHARD_TOKENS = 1 << 24  # tokens per .npy shard
META = "meta.json"


def stdlib_files(max_bytes: int) -> list[str]:
    """The standard library's .py files in sorted path order (tests and site-packages left out), up to
    max_bytes in all."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in p and f"{os.sep}test" not in p[len(root):])
    out, total = [], 0
    for p in files:
        size = os.path.getsize(p)
        if total + size > max_bytes:
            continue
        out.append(p)
        total += size
    if not out:
        raise FileNotFoundError(f"no Python sources under {root!r}; pass a text directory to prepare-data")
    return out


def text_files(src: str) -> list[str]:
    """Every file under `src` that decodes as UTF-8, in sorted path order."""
    if not os.path.isdir(src):
        raise FileNotFoundError(f"data source {src!r} is not a directory of text files")
    out = []
    for p in sorted(glob.glob(os.path.join(src, "**", "*"), recursive=True)):
        if os.path.isfile(p):
            try:
                with open(p, encoding="utf-8") as f:
                    f.read()
                out.append(p)
            except (UnicodeDecodeError, OSError):
                continue
    if not out:
        raise FileNotFoundError(f"no UTF-8 text files under {src!r}")
    return out


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def prepare(out_dir: str, vocab_size: int, src: Optional[str] = None, tokenizer: Optional[str] = None,
            held_out: float = HELD_OUT, seed: int = 0, max_bytes: int = MAX_BYTES) -> dict:
    """Tokenise `src` (default: the standard library corpus) into `out_dir`; returns the metadata written."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 0.0 < held_out < 1.0:
        raise ValueError(f"held_out={held_out}; expected a fraction in (0, 1)")
    files = text_files(src) if src else stdlib_files(max_bytes)
    if len(files) < 2:
        raise ValueError(f"{len(files)} text file(s) in {src!r}; need at least 2 to hold one out")
    order = np.random.default_rng(seed).permutation(len(files))
    n_eval = max(1, int(round(held_out * len(files))))
    splits = {"eval": [files[i] for i in order[:n_eval]], "train": [files[i] for i in order[n_eval:]]}
    os.makedirs(out_dir, exist_ok=True)
    if tokenizer:
        tok = Tokenizer.from_file(tokenizer)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator((_read(p) for p in splits["train"]), trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"the tokenizer has {tok.get_vocab_size()} tokens but the model's vocab_size is "
                         f"{vocab_size}; raise --config.model.vocab_size or use a smaller tokenizer")
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    meta = {"vocab_size": vocab_size, "tokenizer_vocab": tok.get_vocab_size(), "seed": seed,
            "source": src or f"python stdlib {sysconfig.get_paths()['stdlib']}", "dtype": np.dtype(dtype).name,
            "splits": {}}
    for split, paths in splits.items():
        ids = []
        for enc in tok.encode_batch([_read(p) for p in paths]):
            ids.extend(enc.ids)
            if eos is not None:
                ids.append(eos)
        tokens = np.asarray(ids, dtype)
        shards = []
        for i in range(0, max(1, len(tokens)), SHARD_TOKENS):
            name = f"{split}_{len(shards):03d}.npy"
            np.save(os.path.join(out_dir, name), tokens[i:i + SHARD_TOKENS])
            shards.append(name)
        meta["splits"][split] = {"files": len(paths), "tokens": int(len(tokens)), "shards": shards,
                                 "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()}
    with open(os.path.join(out_dir, META), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


class TokenData:
    """Prepared shards, memory-mapped; windows drawn by a counter-based generator."""

    def __init__(self, data_dir: str):
        path = os.path.join(data_dir, META)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{data_dir!r} holds no prepared data ({META} missing); run "
                                    f"`gshard-jax prepare-data --out {data_dir}` first")
        with open(path) as f:
            self.meta = json.load(f)
        self.shards = {s: [np.load(os.path.join(data_dir, n), mmap_mode="r") for n in m["shards"]]
                       for s, m in self.meta["splits"].items()}

    def windows(self, split: str, seed: int, step: int, rows: int, length: int, start: int = 0,
                stop: Optional[int] = None) -> np.ndarray:
        """Rows [start, stop) of step `step`'s [rows, length] int32 batch of token windows. The whole batch
        is a pure function of (seed, step), so any split of its rows over processes reads the same data."""
        shards = [s for s in self.shards[split] if len(s) >= length]
        if not shards:
            raise ValueError(f"the {split} split has no shard of at least {length} tokens; prepare more data or "
                             f"shorten train.seq_len")
        sizes = np.array([len(s) - length + 1 for s in shards], np.float64)
        rng = np.random.default_rng([seed, step, {"train": 0, "eval": 1}[split]])
        which = rng.choice(len(shards), size=rows, p=sizes / sizes.sum())
        starts = (rng.random(rows) * sizes[which]).astype(np.int64)
        stop = rows if stop is None else stop
        return np.stack([np.asarray(shards[w][s:s + length], np.int32)
                         for w, s in zip(which[start:stop], starts[start:stop])])


def model_batch(kind: str, windows: np.ndarray) -> dict:
    """A loss_fn batch from [B, n] windows: decoder_lm predicts the next token (n = L + 1); encoder_decoder
    reads the first half as source and predicts the continuation (n = 2L + 1)."""
    if kind == "encoder_decoder":
        L = (windows.shape[1] - 1) // 2
        return {"source": windows[:, :L], "inputs": windows[:, L:2 * L], "targets": windows[:, L + 1:2 * L + 1]}
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def window_length(kind: str, seq_len: int) -> int:
    return 2 * seq_len + 1 if kind == "encoder_decoder" else seq_len + 1

