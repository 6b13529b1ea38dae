"""
Tokenize a text corpus into the flat token memmaps the nanotune training scripts read.

    # default corpus, offline on any machine: the .py files of this Python's standard library
    python data_prep.py                                    # -> data/stdlib, BPE tokenizer of 4096

    # a folder of text (searched recursively for .txt .md .py ... and .jsonl files)
    python data_prep.py --input ~/notes --out_dir data/notes --vocab_size 8192

    # fine-tuning data: JSONL, one {"prompt": ..., "response": ...} or {"text": ...} per line
    python data_prep.py --input sft.jsonl --out_dir data/sft --tokenizer llama-2-7b/tokenizer.model

    # any mix of files and folders, with the Llama 2 tokenizer
    python data_prep.py --input books/ extra.txt --out_dir data/books --tokenizer llama-2-7b/tokenizer.model

What ends up in out_dir:

    train.bin, val.bin              token ids, each document followed by eos_id (no BOS);
                                    np.uint16, or np.uint32 for vocabularies over 65536 pieces
    train_mask.bin, val_mask.bin    only if some input has prompt/response: np.uint8, one per token,
                                    1 = train on it (response and its EOS), 0 = prompt; plain text is all 1
    tokenizer.model                 the SentencePiece model that made the ids (trained here, or a copy)
    meta.json                       vocab_size, dtype, bos_id, eos_id, has_mask, token/document counts

    meta = json.load(open(os.path.join(out_dir, "meta.json")))
    data = np.memmap(os.path.join(out_dir, "train.bin"), dtype=meta["dtype"], mode="r")

Documents and the split: a text file is one document (files over DOC_CHARS characters are cut at
line boundaries into several), a JSONL line is one document. Each document goes wholly to train or
to val, by a hash of its name (its path inside the input folder, plus the JSONL line number), so
reruns give the same split. Val always gets at least one document, and train too; an input that is a
single text document is cut at a line boundary and its last val_fraction goes to val, as nanoGPT
does with Shakespeare.

Outputs are built in a temporary folder next to out_dir and moved in at the end (meta.json last),
so a failed run never leaves a half-written out_dir, and an existing one is replaced only then.
"""

import argparse
import contextlib
import hashlib
import io
import itertools
import json
import multiprocessing
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

# files a folder input is searched for; a file named directly is read whatever its extension
TEXT_EXTENSIONS = (".txt", ".md", ".rst", ".tex", ".py", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu",
                   ".rs", ".go", ".java", ".js", ".ts", ".sh", ".html", ".css", ".json", ".toml",
                   ".yaml", ".yml", ".cfg", ".ini")
# the default corpus leaves out the stdlib's tests (a third of it, and repetitive) and anything installed
STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
# longer text files are cut into documents of about this many characters, so encoding one stays small
DOC_CHARS = 1 << 22
# the tokenizer trains on a deterministic sample of at most about this many characters of the input
SAMPLE_CHARS = 16 << 20
# documents go to the encoding workers in chunks of about this many characters
CHUNK_CHARS = 1 << 20


class DataPrepError(Exception):
    """A mistake in the inputs or settings; main() prints it as one line, without a traceback."""


def dtype_for_vocab(vocab_size):
    """The smallest unsigned dtype that holds every token id below vocab_size."""
    if vocab_size <= 2**16:
        return np.uint16
    if vocab_size <= 2**32:
        return np.uint32
    raise DataPrepError(f"a vocabulary of {vocab_size} pieces does not fit in uint32 token ids; "
                        f"use a tokenizer with at most 2**32 pieces")


def stdlib_files():
    """The default corpus: (path, key) for the .py files of the standard library, tests left out."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_SKIP_DIRS)  # sorted: same order everywhere
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                files.append((path, os.path.relpath(path, root).replace(os.sep, "/")))
    return files


def list_files(inputs):
    """(path, key) for every file to read; the key names a file independently of where the input lives."""
    files = []
    for inp in map(os.fspath, inputs):
        if not os.path.exists(inp):
            raise DataPrepError(f"--input {inp} does not exist")
        if not os.path.isdir(inp):
            files.append((inp, os.path.basename(inp)))
            continue
        for dirpath, dirnames, filenames in os.walk(inp):
            # hidden folders (.git, .venv) and caches are not text anyone meant to train on
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
            for name in sorted(filenames):
                ext = os.path.splitext(name)[1].lower()
                if not name.startswith(".") and (ext in TEXT_EXTENSIONS or ext == ".jsonl"):
                    path = os.path.join(dirpath, name)
                    files.append((path, os.path.relpath(path, inp).replace(os.sep, "/")))
    return files


def iter_documents(files, skipped=None):
    """Yield (key, prompt, text) per document of the (path, key) files; prompt is None for plain text.

    Text files that are not UTF-8 (or hold NUL bytes: binaries) are skipped and appended to skipped.
    """
    for path, key in files:
        if path.lower().endswith(".jsonl"):
            yield from _jsonl_documents(path, key)
        else:
            yield from _text_documents(path, key, skipped if skipped is not None else [])


def _text_documents(path, key, skipped):
    # newline="" keeps the text byte for byte, so decoding the tokens gives back the file
    try:
        f = open(path, encoding="utf-8", newline="")
        text = f.read(DOC_CHARS)
    except (UnicodeDecodeError, OSError):
        skipped.append(path)
        return
    with f:
        if "\x00" in text:
            skipped.append(path)
            return
        i = 0
        while text:
            try:
                text += f.readline()  # end the document at a line boundary
                next_text = f.read(DOC_CHARS)
            except UnicodeDecodeError:
                # its start was text, so this is a damaged file rather than a binary: say so
                raise DataPrepError(f"{path} is not valid UTF-8 after its first {DOC_CHARS * i:,} characters; "
                                    f"fix its encoding or remove it from --input") from None
            yield (key if i == 0 else f"{key}#{i}"), None, text
            text, i = next_text, i + 1


def _jsonl_documents(path, key):
    try:
        f = open(path, "rb")  # bytes, so a decode error can name its line
    except OSError as e:
        raise DataPrepError(f"cannot read {path}: {e.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                record = json.loads(line)
            except UnicodeDecodeError:  # a ValueError too, so it comes first
                raise DataPrepError(f"{where} is not valid UTF-8") from None
            except json.JSONDecodeError as e:
                raise DataPrepError(f"{where} is malformed JSON ({e.msg}, column {e.colno})") from None
            if isinstance(record, dict) and isinstance(record.get("text"), str):
                if record["text"]:
                    yield f"{key}:{lineno}", None, record["text"]
            elif (isinstance(record, dict) and isinstance(record.get("prompt"), str)
                  and isinstance(record.get("response"), str)):
                if record["prompt"] or record["response"]:
                    yield f"{key}:{lineno}", record["prompt"], record["response"]
            else:
                raise DataPrepError(f'{where} has neither a "text" string nor "prompt" and "response" strings')


def unit_hash(s):
    """A number in [0, 1) fixed by s on every machine and run (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.md5(s.encode("utf-8", "surrogatepass")).digest()[:8], "big") / 2**64


def cut_in_two(text, val_fraction):
    """Split text at the line boundary nearest past (1 - val_fraction) of it; for a single-document input."""
    if len(text) < 2:
        raise DataPrepError("the input is a single document of one character; give more text")
    target = int(len(text) * (1 - val_fraction))
    cut = text.find("\n", target) + 1
    if cut in (0, len(text)):
        cut = text.rfind("\n", 0, target) + 1
    if cut in (0, len(text)):
        cut = target  # a single line: cut mid-line rather than leave val empty
    cut = min(max(cut, 1), len(text) - 1)
    return text[:cut], text[cut:]


def load_tokenizer(path):
    """A SentencePieceProcessor for path, or a DataPrepError saying why it isn't one."""
    if not os.path.isfile(path):
        raise DataPrepError(f"--tokenizer {path} does not exist")
    try:
        return spm.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError):
        raise DataPrepError(f"--tokenizer {path} is not a SentencePiece model (a tokenizer.model file)") from None


def train_tokenizer(sentences, vocab_size):
    """Train a byte-fallback BPE SentencePiece model on an iterable of lines; returns the model bytes."""
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            # an iterator rather than a file: the trainer records its input path in the model, and a
            # temp path there would make the tokenizer.model of two identical runs differ
            sentence_iterator=iter(sentences),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,  # any byte encodes, so no <unk> and every text decodes back exactly
            character_coverage=0.9995,  # rare characters go to bytes rather than taking vocabulary
            normalization_rule_name="identity",  # text, code and whitespace come back unchanged
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,  # no space added in front, so encoded pieces concatenate exactly
            allow_whitespace_only_pieces=True,  # indentation runs become single tokens
            split_digits=True,  # as Llama: numbers are spelled digit by digit
            user_defined_symbols=["\n"],  # the trainer reads lines, so it never sees newlines; give them a piece
            max_sentence_length=16384,  # long lines of code still count
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=1,  # recorded in the model; fixed so the file is the same on every machine
            minloglevel=2,  # only errors, which arrive as exceptions anyway
        )
    except RuntimeError as e:
        msg = str(e)
        if m := re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", msg):
            raise DataPrepError(f"--vocab_size {vocab_size} is too large for this corpus, which supports at most "
                                f"{m.group(1)}; lower --vocab_size or add text") from None
        if m := re.search(r"smaller than required_chars\. \d+ vs (\d+)", msg):
            raise DataPrepError(f"--vocab_size {vocab_size} is too small for this corpus, which needs at least "
                                f"{m.group(1)} (256 bytes, special pieces and its characters)") from None
        raise DataPrepError(f"training the tokenizer failed: {msg.splitlines()[0]}") from None
    return model.getvalue()


# the encoder of this process, set by _init_encoder in each worker (or in this process for num_proc=1)
_encoder = None


def _init_encoder(model_path, dtype):
    global _encoder
    _encoder = (spm.SentencePieceProcessor(model_file=model_path), dtype)


def _encode_chunk(chunk):
    """Encode (prompt, text, is_val) documents; returns {is_val: (ids array, mask bytes, n_docs)}."""
    sp, dtype = _encoder
    out = {False: ([], bytearray(), 0), True: ([], bytearray(), 0)}
    for prompt, text, is_val in chunk:
        ids, mask, n = out[is_val]
        # prompt and response are encoded apart so the mask boundary falls exactly between them (with a
        # tokenizer that adds a dummy prefix, as Llama 2's does, the response starts with a space piece)
        p = sp.encode(prompt) if prompt else []
        r = sp.encode(text) if text else []
        ids.extend(p)
        ids.extend(r)
        ids.append(sp.eos_id())
        mask += b"\x00" * len(p) + b"\x01" * (len(r) + 1)  # the EOS is trained: the model learns to stop
        out[is_val] = (ids, mask, n + 1)
    return {k: (np.array(ids, dtype=dtype), mask, n) for k, (ids, mask, n) in out.items()}


def _chunks(docs, size):
    chunk, n = [], 0
    for doc in docs:
        chunk.append(doc)
        n += len(doc[0] or "") + len(doc[1])
        if n >= size:
            yield chunk
            chunk, n = [], 0
    if chunk:
        yield chunk


def _imap_bounded(pool, fn, items, window):
    # Pool.imap alone would pull the whole input into its task queue; a window bounds memory
    items = iter(items)
    while batch := list(itertools.islice(items, window)):
        yield from pool.imap(fn, batch)


def prepare(inputs=None, out_dir=None, vocab_size=None, tokenizer=None, val_fraction=0.01, num_proc=None):
    """Tokenize inputs (paths; None = the stdlib default corpus) into out_dir; returns the meta dict."""
    t0 = time.time()

    # settings first, before any expensive work
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    inputs = None if inputs is None else [os.fspath(p) for p in inputs]
    if out_dir is None:
        if inputs is not None:
            raise DataPrepError("--out_dir is required with --input, e.g. --out_dir data/mycorpus")
        out_dir = os.path.join("data", "stdlib")
    out_dir = os.fspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise DataPrepError(f"--out_dir {out_dir} is a file; give a folder")
    if not 0 < val_fraction < 1:
        raise DataPrepError(f"--val_fraction must be between 0 and 1, got {val_fraction}")
    if tokenizer is not None and vocab_size is not None:
        raise DataPrepError("give --vocab_size (to train a tokenizer) or --tokenizer (to use one), not both")
    num_proc = num_proc or min(os.cpu_count() or 1, 8)
    if num_proc < 1:
        raise DataPrepError(f"--num_proc must be at least 1, got {num_proc}")
    if tokenizer is not None:
        tokenizer = os.fspath(tokenizer)
        sp = load_tokenizer(tokenizer)
        if sp.eos_id() < 0:
            raise DataPrepError(f"--tokenizer {tokenizer} has no EOS piece, which separates documents here")
        dtype_for_vocab(sp.vocab_size())
    else:
        vocab_size = 4096 if vocab_size is None else vocab_size
        dtype_for_vocab(vocab_size)
    if inputs is None:
        files, sources = stdlib_files(), [f"default: python stdlib {sysconfig.get_paths()['stdlib']}"]
    else:
        files, sources = list_files(inputs), inputs
    if not files:
        raise DataPrepError(f"no text files in {' '.join(inputs)} (looked for .jsonl {' '.join(TEXT_EXTENSIONS)})")

    # first pass: check every document parses and count them, before training or writing anything,
    # and set aside the tokenizer's sample: documents picked by hash, at a rate aiming at SAMPLE_CHARS
    total_bytes = sum(os.path.getsize(path) for path, _ in files)
    sample_rate = min(1.0, SAMPLE_CHARS / max(total_bytes, 1))
    skipped = []
    n_docs = n_val = 0
    has_mask = False
    lowest, highest = (1.0, -1), (-1.0, -1)  # (split hash, index) of the docs to move if val or train is empty
    first = None
    with tempfile.TemporaryFile("w+", encoding="utf-8", newline="\n") as sample:  # lines end at "\n" only
        sample_chars = 0
        for i, (key, prompt, text) in enumerate(iter_documents(files, skipped)):
            u = unit_hash("split:" + key)
            n_docs, n_val = i + 1, n_val + (u < val_fraction)
            lowest, highest = min(lowest, (u, i)), max(highest, (u, i))
            has_mask |= prompt is not None
            first = (prompt, text) if i == 0 else first
            if tokenizer is None and sample_chars < SAMPLE_CHARS and (
                    not sample_chars or unit_hash("sample:" + key) < sample_rate):
                for part in (prompt, text):
                    if part:
                        sample.write(part if part.endswith("\n") else part + "\n")
                        sample_chars += len(part)
        if n_docs == 0:
            note = f" ({len(skipped)} files skipped as not UTF-8 text)" if skipped else ""
            raise DataPrepError(f"no readable text in {' '.join(inputs or ['the stdlib'])}{note}")
        if n_docs == 1 and has_mask:
            raise DataPrepError("the input is a single prompt/response document; give at least 2, "
                                "so that val gets one of its own")
        if tokenizer is None:
            sample.seek(0)
            model = train_tokenizer((line.removesuffix("\n") for line in sample), vocab_size)
            sp = spm.SentencePieceProcessor(model_proto=model)
    vocab_size = sp.vocab_size()
    dtype = dtype_for_vocab(vocab_size)
    force_val = lowest[1] if n_val == 0 else -1
    force_train = highest[1] if n_val == n_docs else -1

    def split_docs():
        """(prompt, text, is_val) for the second pass, in the same order as the first."""
        if n_docs == 1:
            head, tail = cut_in_two(first[1], val_fraction)
            yield None, head, False
            yield None, tail, True
            return
        for i, (key, prompt, text) in enumerate(iter_documents(files)):
            is_val = (unit_hash("split:" + key) < val_fraction or i == force_val) and i != force_train
            yield prompt, text, is_val

    # second pass: encode into a temp folder beside out_dir (os.replace works within one file system)
    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=os.path.dirname(out_dir))
    try:
        model_path = os.path.join(tmp_dir, "tokenizer.model")
        if tokenizer is None:
            with open(model_path, "wb") as f:
                f.write(model)
        else:
            shutil.copyfile(tokenizer, model_path)
        names = ["train.bin", "val.bin"] + (["train_mask.bin", "val_mask.bin"] if has_mask else [])
        counts = {False: [0, 0], True: [0, 0]}  # is_val -> [tokens, docs]
        with contextlib.ExitStack() as stack:
            chunks = _chunks(split_docs(), CHUNK_CHARS)
            if num_proc == 1:
                _init_encoder(model_path, dtype)
                results = map(_encode_chunk, chunks)
            else:  # the pool before the progress bar, so no tqdm thread is running when it forks
                pool = stack.enter_context(multiprocessing.Pool(num_proc, _init_encoder, (model_path, dtype)))
                results = _imap_bounded(pool, _encode_chunk, chunks, 4 * num_proc)
            outs = {name: stack.enter_context(open(os.path.join(tmp_dir, name), "wb")) for name in names}
            bar = stack.enter_context(tqdm(total=n_docs + (n_docs == 1), unit="doc", desc="encoding",
                                           file=sys.stderr, disable=None))
            for result in results:
                for is_val, (ids, mask, n) in result.items():
                    split = "val" if is_val else "train"
                    outs[f"{split}.bin"].write(ids.tobytes())
                    if has_mask:
                        outs[f"{split}_mask.bin"].write(mask)
                    counts[is_val][0] += len(ids)
                    counts[is_val][1] += n
                    bar.update(n)

        meta = {
            "vocab_size": vocab_size,
            "dtype": np.dtype(dtype).name,
            "bos_id": sp.bos_id(),
            "eos_id": sp.eos_id(),
            "has_mask": has_mask,
            "mask_dtype": "uint8",
            "train_tokens": counts[False][0],
            "val_tokens": counts[True][0],
            "train_docs": counts[False][1],
            "val_docs": counts[True][1],
            "skipped_files": len(skipped),
            "val_fraction": val_fraction,
            "tokenizer": "tokenizer.model",
            "tokenizer_source": tokenizer or f"trained here: BPE, byte fallback, {sample_chars:,} characters of the input",
            "sources": sources,
        }
        with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)

        # move in: the old meta.json goes first and the new one comes last, so meta.json never describes
        # token files other than the ones beside it; stale masks of an earlier run go too
        os.makedirs(out_dir, exist_ok=True)
        for name in ("meta.json", "train_mask.bin", "val_mask.bin"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out_dir, name))
        for name in ["tokenizer.model"] + names + ["meta.json"]:
            os.replace(os.path.join(tmp_dir, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)

    note = f", {len(skipped)} files skipped (not UTF-8 text)" if skipped else ""
    cut = " (the single document cut in two)" if n_docs == 1 else ""
    print(f"wrote {out_dir}: train {meta['train_tokens']:,} tokens in {meta['train_docs']:,} docs, "
          f"val {meta['val_tokens']:,} tokens in {meta['val_docs']:,} docs{cut}, {meta['dtype']}, "
          f"vocab {vocab_size:,}{note}, {time.time() - t0:.1f}s")
    return meta


def main(argv=None):
    parser = argparse.ArgumentParser(prog="data_prep.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", metavar="PATH",
                        help="text files, folders (recursive) and .jsonl files; default: the Python stdlib")
    parser.add_argument("--out_dir", help="output folder; default data/stdlib without --input")
    vocab = parser.add_mutually_exclusive_group()
    vocab.add_argument("--vocab_size", type=int, help="train a BPE tokenizer of this many pieces (default 4096)")
    vocab.add_argument("--tokenizer", metavar="FILE.model", help="use this SentencePiece model, e.g. Llama 2's")
    parser.add_argument("--val_fraction", type=float, default=0.01, help="share of documents for val (default 0.01)")
    parser.add_argument("--num_proc", type=int, default=None, help="encoding processes (default min(cpus, 8))")
    args = parser.parse_args(argv)
    try:
        prepare(args.input, args.out_dir, args.vocab_size, args.tokenizer, args.val_fraction, args.num_proc)
    except DataPrepError as e:
        print(f"data_prep.py: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
