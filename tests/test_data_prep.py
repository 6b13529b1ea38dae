import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import data_prep  # noqa: E402
from data_prep import DataPrepError, dtype_for_vocab, iter_documents, list_files, prepare  # noqa: E402

VOCAB = 350  # small enough for a few KB of text, so sentencepiece trains in milliseconds
WORDS = ("the quick brown fox jumps over a lazy dog while alpha beta gamma delta return import "
         "class def self value data token model train loss résumé naïve café 42 3.14 ✓").split()


def sentence(rng, n=8):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_corpus(root, n_files=8, seed=0):
    """A folder of small text files (one nested, with indented code and tabs); returns {name: text}."""
    rng = random.Random(seed)
    texts = {}
    for i in range(n_files):
        lines = [sentence(rng) for _ in range(rng.randint(5, 15))]
        lines += ["def f(x):", "    if x:", "\t\treturn x  # done", "a windows line\r", ""]
        name = f"sub/doc{i}.md" if i == 0 else f"doc{i}.txt"
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        texts[name] = "\n".join(lines) + "\n"
        path.write_text(texts[name], encoding="utf-8", newline="")
    (root / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x00")  # a binary: skipped
    (root / "ignored.bin").write_text("not a text extension")
    return texts


def write_jsonl(path, n=40, seed=1, plain_every=5):
    """prompt/response records with a plain "text" record every plain_every lines; returns the records."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        if plain_every and i % plain_every == 0:
            records.append({"text": sentence(rng, 12)})
        else:
            records.append({"prompt": "Q: " + sentence(rng, 6) + "\nA:", "response": " " + sentence(rng, 6)})
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n\n")  # blank lines are allowed
    return records


def load(out):
    meta = json.loads((out / "meta.json").read_text())
    read = lambda name, dtype: np.fromfile(out / name, dtype=dtype)  # noqa: E731
    return meta, read


def split_docs(ids, eos_id):
    """The documents of a token stream, each without its EOS."""
    ends = np.flatnonzero(ids == eos_id)
    assert len(ids) == 0 or ends[-1] == len(ids) - 1, "the stream must end with EOS"
    return [doc[:-1] for doc in np.split(ids, ends + 1)[:-1]]


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    return root, write_corpus(root)


def test_dtype_for_vocab():
    assert dtype_for_vocab(4096) == np.uint16
    assert dtype_for_vocab(65536) == np.uint16  # ids 0..65535 still fit
    assert dtype_for_vocab(65537) == np.uint32
    assert dtype_for_vocab(70000) == np.uint32
    with pytest.raises(DataPrepError, match="uint32"):
        dtype_for_vocab(2**32 + 1)


def test_counts_match_files(corpus, tmp_path):
    root, texts = corpus
    out = tmp_path / "out"
    meta = prepare([root], out, vocab_size=VOCAB, num_proc=1)
    assert meta == json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == VOCAB and meta["dtype"] == "uint16"
    assert (meta["bos_id"], meta["eos_id"], meta["has_mask"]) == (1, 2, False)
    assert (out / "train.bin").stat().st_size == 2 * meta["train_tokens"] > 0
    assert (out / "val.bin").stat().st_size == 2 * meta["val_tokens"] > 0
    assert meta["train_docs"] + meta["val_docs"] == len(texts) and meta["val_docs"] >= 1
    assert meta["skipped_files"] == 1  # image.txt
    assert not (out / "train_mask.bin").exists() and not (out / "val_mask.bin").exists()
    assert spm.SentencePieceProcessor(model_file=str(out / meta["tokenizer"])).vocab_size() == VOCAB
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folder left


def test_documents_decode_exactly_and_stay_whole(corpus, tmp_path):
    root, texts = corpus
    out = tmp_path / "out"
    meta = prepare([root], out, vocab_size=VOCAB, val_fraction=0.3, num_proc=1)
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    _, read = load(out)
    decoded = {}
    for split in ("train", "val"):
        ids = read(f"{split}.bin", np.uint16)
        assert ids.max() < VOCAB
        decoded[split] = [sp.decode(d.tolist()) for d in split_docs(ids, meta["eos_id"])]
    # the first document of train is an input file exactly: identity normalization, byte fallback
    assert decoded["train"][0] in texts.values()
    # every file is one whole document, in exactly one split
    assert sorted(decoded["train"] + decoded["val"]) == sorted(texts.values())
    assert len(decoded["val"]) == meta["val_docs"] >= 1


def test_two_runs_are_identical(corpus, tmp_path):
    root, _ = corpus
    meta = prepare([root], tmp_path / "a", vocab_size=VOCAB, num_proc=1)
    # the second run in another process, so nothing rides on per-process state such as hash()'s salt
    r = subprocess.run([sys.executable, str(ROOT / "data_prep.py"), "--input", str(root), "--out_dir",
                        str(tmp_path / "b"), "--vocab_size", str(VOCAB), "--num_proc", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"train {meta['train_tokens']:,} tokens" in r.stdout
    names = sorted(os.listdir(tmp_path / "a"))
    assert names == ["meta.json", "tokenizer.model", "train.bin", "val.bin"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_num_proc_2_matches_num_proc_1(corpus, tmp_path, monkeypatch):
    root, _ = corpus
    write_jsonl(root / "data.jsonl")
    monkeypatch.setattr(data_prep, "CHUNK_CHARS", 300)  # many chunks, so both workers get several
    prepare([root], tmp_path / "one", vocab_size=VOCAB, num_proc=1)
    prepare([root], tmp_path / "two", vocab_size=VOCAB, num_proc=2)
    names = sorted(os.listdir(tmp_path / "one"))
    assert "train_mask.bin" in names
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_prompt_response_mask(tmp_path):
    records = write_jsonl(tmp_path / "sft.jsonl", n=60)
    out = tmp_path / "out"
    meta = prepare([tmp_path / "sft.jsonl"], out, vocab_size=VOCAB, val_fraction=0.2, num_proc=1)
    assert meta["has_mask"] and meta["train_docs"] + meta["val_docs"] == len(records)
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    _, read = load(out)
    seen = []
    for split in ("train", "val"):
        ids, mask = read(f"{split}.bin", np.uint16), read(f"{split}_mask.bin", np.uint8)
        assert len(mask) == len(ids) == meta[f"{split}_tokens"]
        start = 0
        for doc in split_docs(ids, meta["eos_id"]):
            m = mask[start:start + len(doc) + 1]
            start += len(doc) + 1
            n_prompt = int((m == 0).sum())
            assert m[-1] == 1 and (m[:n_prompt] == 0).all() and (m[n_prompt:] == 1).all()
            prompt, response = sp.decode(doc[:n_prompt].tolist()), sp.decode(doc[n_prompt:].tolist())
            assert sp.decode(doc.tolist()) == prompt + response  # the model sees the text as written
            # mask 0 covers exactly the prompt's tokens; plain "text" records are trained on throughout
            seen.append({"prompt": prompt, "response": response} if n_prompt else {"text": response})
            if n_prompt:
                assert n_prompt == len(sp.encode(prompt))
    key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
    assert sorted(map(key, seen)) == sorted(map(key, records))


def test_text_jsonl(tmp_path):
    records = write_jsonl(tmp_path / "t.jsonl", n=30, plain_every=1)
    out = tmp_path / "out"
    meta = prepare([tmp_path / "t.jsonl"], out, vocab_size=VOCAB, num_proc=1)
    assert not meta["has_mask"] and meta["train_docs"] + meta["val_docs"] == 30
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    first = split_docs(np.fromfile(out / "train.bin", dtype=np.uint16), meta["eos_id"])[0]
    assert sp.decode(first.tolist()) in [r["text"] for r in records]


def test_existing_tokenizer(corpus, tmp_path):
    root, _ = corpus
    prepare([root], tmp_path / "base", vocab_size=VOCAB, num_proc=1)
    model = tmp_path / "base" / "tokenizer.model"
    records = write_jsonl(tmp_path / "sft.jsonl", n=20)
    out = tmp_path / "sft"
    meta = prepare([tmp_path / "sft.jsonl"], out, tokenizer=model, num_proc=1)
    assert (out / "tokenizer.model").read_bytes() == model.read_bytes()
    assert meta["tokenizer_source"] == str(model) and meta["vocab_size"] == VOCAB and meta["has_mask"]
    sp = spm.SentencePieceProcessor(model_file=str(model))
    ids = np.fromfile(out / "train.bin", dtype=np.uint16)
    texts = [r.get("text") or r["prompt"] + r["response"] for r in records]
    assert sp.decode(split_docs(ids, meta["eos_id"])[0].tolist()) in texts


def test_val_gets_a_document_and_train_keeps_one(tmp_path):
    write_corpus(tmp_path / "two", n_files=2)
    for fraction in (0.001, 0.999):  # hashes alone would put both files in train, then both in val
        meta = prepare([tmp_path / "two"], tmp_path / f"out{fraction}", vocab_size=300,
                       val_fraction=fraction, num_proc=1)
        assert (meta["train_docs"], meta["val_docs"]) == (1, 1)


def test_single_document_is_cut_in_two(corpus, tmp_path):
    root, texts = corpus
    out = tmp_path / "out"
    meta = prepare([root / "doc1.txt"], out, vocab_size=300, val_fraction=0.2, num_proc=1)
    assert (meta["train_docs"], meta["val_docs"]) == (1, 1)
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    train, val = (sp.decode(split_docs(np.fromfile(out / f"{s}.bin", dtype=np.uint16), 2)[0].tolist())
                  for s in ("train", "val"))
    assert train + val == texts["doc1.txt"] and train.endswith("\n") and len(val) < len(train)


def test_long_file_is_cut_at_line_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(data_prep, "DOC_CHARS", 100)
    text = "".join(f"line {i} of a long file\n" for i in range(50))
    (tmp_path / "long.txt").write_text(text)
    docs = list(iter_documents(list_files([tmp_path / "long.txt"])))
    assert len(docs) > 5 and "".join(t for _, _, t in docs) == text
    assert all(t.endswith("\n") for _, _, t in docs) and len({k for k, _, _ in docs}) == len(docs)


def test_failed_run_keeps_old_outputs_and_a_new_one_replaces_them(corpus, tmp_path):
    root, _ = corpus
    out = tmp_path / "out"
    write_jsonl(tmp_path / "sft.jsonl")
    prepare([tmp_path / "sft.jsonl"], out, vocab_size=VOCAB, num_proc=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataPrepError):
        prepare([root, tmp_path / "bad.jsonl"], out, vocab_size=VOCAB, num_proc=1)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    prepare([root], out, vocab_size=VOCAB, num_proc=1)
    assert sorted(os.listdir(out)) == ["meta.json", "tokenizer.model", "train.bin", "val.bin"]  # old masks gone


@pytest.mark.parametrize("case, message", [
    ("missing", r"--input .*nowhere does not exist"),
    ("empty_folder", r"no text files in"),
    ("empty_file", r"no readable text in"),
    ("binary_only", r"no readable text in .*\(1 files skipped"),
    ("malformed_jsonl", r"bad\.jsonl line 3 is malformed JSON"),
    ("jsonl_fields", r'bad\.jsonl line 2 has neither a "text" string nor "prompt" and "response"'),
    ("vocab_too_large", r"--vocab_size 5000 is too large for this corpus, which supports at most \d+"),
    ("vocab_too_small", r"--vocab_size 100 is too small"),
    ("tokenizer_missing", r"--tokenizer .*none\.model does not exist"),
    ("tokenizer_not_a_model", r"--tokenizer .*fake\.model is not a SentencePiece model"),
    ("both_vocab_and_tokenizer", r"not both"),
    ("val_fraction", r"--val_fraction must be between 0 and 1"),
])
def test_errors(case, message, corpus, tmp_path):
    root, _ = corpus
    kw = dict(vocab_size=VOCAB)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "fake.model").write_text("not a model\n")
    bad = tmp_path / "bad.jsonl"
    inputs = {
        "missing": [root, tmp_path / "nowhere"],
        "empty_folder": [tmp_path / "empty"],
        "empty_file": [tmp_path / "empty.txt"],
        "binary_only": [root / "image.txt"],
        "malformed_jsonl": [bad],
        "jsonl_fields": [bad],
    }.get(case, [root])
    if case == "malformed_jsonl":
        bad.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c",,}\n')
    if case == "jsonl_fields":
        bad.write_text('{"text": "a"}\n{"prompt": "only a prompt"}\n')
    kw.update({
        "vocab_too_large": dict(vocab_size=5000),
        "vocab_too_small": dict(vocab_size=100),
        "tokenizer_missing": dict(vocab_size=None, tokenizer=tmp_path / "none.model"),
        "tokenizer_not_a_model": dict(vocab_size=None, tokenizer=tmp_path / "fake.model"),
        "both_vocab_and_tokenizer": dict(tokenizer=tmp_path / "fake.model"),
        "val_fraction": dict(val_fraction=1.0),
    }.get(case, {}))
    out = tmp_path / "out"
    with pytest.raises(DataPrepError, match=message):
        prepare(inputs, out, num_proc=1, **kw)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folder left


@pytest.mark.parametrize("case", ["malformed_jsonl", "vocab_too_large"])
def test_cli_error_is_one_line(case, corpus, tmp_path):
    root, _ = corpus
    if case == "malformed_jsonl":
        (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"\n')
        args = ["--input", str(tmp_path / "bad.jsonl"), "--vocab_size", "300"]
    else:
        args = ["--input", str(root), "--vocab_size", "5000"]
    out = tmp_path / "new" / "out"
    r = subprocess.run([sys.executable, str(ROOT / "data_prep.py"), *args, "--out_dir", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("data_prep.py: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not out.exists() and not out.parent.exists()
