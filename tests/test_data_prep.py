import hashlib
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import data_prep  # noqa: E402
from data_prep import DataPrepError, dtype_for_vocab, iter_documents, list_files, load_tokenizer, prepare  # noqa: E402

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


def split_docs(ids, eos_id, bos_id=1):
    """The documents of a flat token stream, each without its BOS and EOS (which it must have)."""
    ends = np.flatnonzero(ids == eos_id)
    assert len(ids) and ends[-1] == len(ids) - 1, "the stream must end with EOS"
    docs = np.split(ids, ends + 1)[:-1]
    assert all(d[0] == bos_id and bos_id not in d[1:-1] for d in docs), "every document starts with BOS"
    return [d[1:-1] for d in docs]


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    return root, write_corpus(root)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """A tokenizer trained once, so tests that only split or pack skip training their own."""
    root = tmp_path_factory.mktemp("base")
    write_corpus(root / "corpus", n_files=20)
    prepare([root / "corpus"], root / "out", vocab_size=VOCAB, num_proc=1)
    return root / "out" / "tokenizer.model"


def test_dtype_for_vocab():
    assert dtype_for_vocab(4096) == np.uint16
    assert dtype_for_vocab(65536) == np.uint16  # ids 0..65535 still fit
    assert dtype_for_vocab(65537) == np.uint32
    with pytest.raises(DataPrepError, match="uint32"):
        dtype_for_vocab(2**32 + 1)


def test_counts_match_files(corpus, tmp_path, capsys):
    root, texts = corpus
    out = tmp_path / "out"
    meta = prepare([root], out, vocab_size=VOCAB, num_proc=1)
    printed = capsys.readouterr().out
    assert f"warning: 1 binary files (NUL bytes) skipped: {root / 'image.txt'}\n" in printed
    assert f"note: 1 files in the input folders are not of a text extension and were left out: {root / 'ignored.bin'}\n" in printed
    assert meta == json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == VOCAB and meta["dtype"] == "uint16"
    assert (meta["bos_id"], meta["eos_id"], meta["has_mask"], meta["packed"]) == (1, 2, False, False)
    assert meta["tokenizer"]["kind"] == "sentencepiece" and meta["tokenizer"]["files"] == ["tokenizer.model"]
    for split in ("train", "val"):
        data = (out / f"{split}.bin").read_bytes()
        assert len(data) == 2 * meta[f"{split}_tokens"] > 0
        assert meta["data"][f"{split}.bin"] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert meta["val_share"] == meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"])
    assert meta["train_docs"] + meta["val_docs"] - meta["cut_docs"] == len(texts) and meta["val_docs"] >= 1
    assert meta["skipped_files"] == 1  # image.txt
    assert sorted(os.listdir(out)) == ["meta.json", "tokenizer.model", "train.bin", "val.bin"]
    assert load_tokenizer(out).fingerprint()["sha256"] == meta["tokenizer"]["sha256"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folder left
    # bins unlike their meta.json (changed, or copied in part) are refused by the trainers' loader
    assert data_prep.load_data_meta(out, 32) == meta
    with open(out / "val.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataPrepError, match=r"val\.bin is [\d,]+ bytes where .*meta\.json says [\d,]+ bytes: the data was changed"):
        data_prep.load_data_meta(out, 32)
    (out / "meta.json").write_text(json.dumps(meta)[:-9])  # cut short (a copy interrupted): one line, not a traceback
    with pytest.raises(DataPrepError, match=r"meta\.json is not JSON \(.*\); run data_prep\.py --out_dir"):
        data_prep.load_data_meta(out, 32)


def test_link_in_a_folder_is_read_once_and_a_bom_is_not_text(corpus, tmp_path):
    # a symlink beside its target (README.md -> docs/index.md) is one document, not two to split apart;
    # so is a hard link, whose path resolves to itself
    root, texts = corpus
    copy = tmp_path / "c"
    shutil.copytree(root, copy)
    (copy / "link.txt").symlink_to(copy / "doc1.txt")
    os.link(copy / "doc2.txt", copy / "hard.txt")
    meta = prepare([copy], tmp_path / "out", vocab_size=VOCAB, num_proc=1)
    assert meta["train_docs"] + meta["val_docs"] - meta["cut_docs"] == len(texts)
    # a JSON array of records saved with a byte order mark parses as one
    rng = random.Random(3)
    records = [{"text": sentence(rng, 12)} for _ in range(40)]
    (tmp_path / "r.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(records).encode())
    meta = prepare([tmp_path / "r.json"], tmp_path / "out2", tokenizer=tmp_path / "out" / "tokenizer.model", num_proc=1)
    assert meta["train_docs"] + meta["val_docs"] - meta["cut_docs"] == 40


def test_documents_have_bos_and_eos_and_stay_whole(tmp_path):
    texts = write_corpus(tmp_path / "corpus", n_files=60)  # many small files: none is cut
    bom = tmp_path / "corpus" / "doc5.txt"  # saved with a byte order mark, as Windows editors do: not text
    bom.write_bytes(b"\xef\xbb\xbf" + bom.read_bytes())
    out = tmp_path / "out"
    meta = prepare([tmp_path / "corpus"], out, vocab_size=VOCAB, val_fraction=0.1, num_proc=1)
    assert meta["cut_docs"] == 0
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    _, read = load(out)
    decoded = {}
    for split in ("train", "val"):
        ids = read(f"{split}.bin", np.uint16)
        assert ids.max() < VOCAB
        decoded[split] = [sp.decode(d.tolist()) for d in split_docs(ids, meta["eos_id"], meta["bos_id"])]
    assert decoded["train"][0] in texts.values()  # identity normalization, byte fallback: the file exactly
    assert sorted(decoded["train"] + decoded["val"]) == sorted(texts.values())
    assert len(decoded["val"]) == meta["val_docs"] >= 1


def write_shape(root, shape, rng):
    """Inputs of one corpus shape; returns (inputs, prepare kwargs)."""
    root.mkdir()
    if shape == "one_small_file":
        (root / "input.txt").write_text("".join(sentence(rng) + "\n" for _ in range(60)))
    elif shape == "one_large_file":  # read in many pieces, as a 5 MB input.txt is with the real DOC_CHARS
        (root / "input.txt").write_text("".join(sentence(rng) + "\n" for _ in range(2000)))
    elif shape == "few_large_files":
        for i, n in enumerate((300, 900, 1500, 3)):
            (root / f"f{i}.txt").write_text("".join(sentence(rng) + "\n" for _ in range(n)))
    elif shape == "many_small_files":
        for i in range(300):
            (root / f"f{i}.txt").write_text("".join(sentence(rng) + "\n" for _ in range(rng.randint(1, 6))))
    elif shape == "jsonl_text":
        (root / "t.jsonl").write_text("".join(json.dumps({"text": sentence(rng, rng.randint(3, 40))}) + "\n"
                                              for _ in range(400)))
    elif shape == "jsonl_sft":
        write_jsonl(root / "sft.jsonl", n=400, plain_every=0)
        return [root / "sft.jsonl"], dict(block_size=64)
    return [root], {}


@pytest.mark.parametrize("val_fraction", [0.01, 0.05, 0.2])
@pytest.mark.parametrize("shape", ["one_small_file", "one_large_file", "few_large_files", "many_small_files",
                                   "jsonl_text", "jsonl_sft"])
def test_val_share_holds_for_every_shape(shape, val_fraction, sp_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data_prep, "DOC_CHARS", 2000)
    inputs, kw = write_shape(tmp_path / "in", shape, random.Random(shape))
    meta = prepare(inputs, tmp_path / "out", tokenizer=sp_model, val_fraction=val_fraction, num_proc=1, **kw)
    assert val_fraction / 2 <= meta["val_share"] <= 2 * val_fraction, meta
    assert meta["val_docs"] >= 1 and meta["train_docs"] >= 1
    assert f"val share {meta['val_share']:.2%} (asked {val_fraction:.2%})" in capsys.readouterr().out
    if shape.startswith("one"):
        assert meta["cut_docs"] == 1


def test_sentencepiece_meta_space_in_text_warns(sp_model, tmp_path, capsys):
    # SentencePiece writes a space as "\u2581": a text holding that character trains and decodes as a space
    texts = write_corpus(tmp_path / "corpus", n_files=20)
    assert not any("\u2581" in t for t in texts.values())
    prepare([tmp_path / "corpus"], tmp_path / "out", tokenizer=sp_model, num_proc=1)
    assert "U+2581" not in capsys.readouterr().out
    (tmp_path / "corpus" / "bar.txt").write_text("progress \u2581\u2582\u2583 done\n" * 3)
    prepare([tmp_path / "corpus"], tmp_path / "out2", tokenizer=sp_model, num_proc=1)
    assert re.search(r"warning: 1 documents or samples hold the character \u2581 \(U\+2581\), which this "
                     r"SentencePiece tokenizer reads as a space.*\(.*bar\.txt\)", capsys.readouterr().out)


def test_few_samples_warn_rather_than_empty_val(sp_model, tmp_path, capsys):
    write_jsonl(tmp_path / "sft.jsonl", n=3, plain_every=0)
    meta = prepare([tmp_path / "sft.jsonl"], tmp_path / "out", tokenizer=sp_model, block_size=64, num_proc=1)
    assert (meta["train_docs"], meta["val_docs"]) == (2, 1)
    assert "warning: val holds" in capsys.readouterr().out


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


def test_input_given_twice_reads_both(corpus, tmp_path):
    # --input a --input b is a and b, as --input a b; argparse's default keeps the last one alone
    root, _ = corpus
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "extra.txt").write_text("a file only the second --input holds\n" * 40)
    meta = prepare([root, tmp_path / "more"], tmp_path / "one", vocab_size=VOCAB, num_proc=1)
    data_prep.main(["--input", str(root), "--input", str(tmp_path / "more"), "--out_dir", str(tmp_path / "two"),
                    "--vocab_size", str(VOCAB), "--num_proc", "1"])
    for name in sorted(os.listdir(tmp_path / "one")):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    alone = prepare([root], tmp_path / "alone", vocab_size=VOCAB, num_proc=1)  # the second input adds a document
    assert meta["train_docs"] + meta["val_docs"] == alone["train_docs"] + alone["val_docs"] + 1


@pytest.mark.parametrize("packed", [False, True])
def test_num_proc_2_matches_num_proc_1(packed, corpus, tmp_path, monkeypatch):
    root, _ = corpus
    inputs = [tmp_path / "sft.jsonl"] if packed else [root]
    write_jsonl(tmp_path / "sft.jsonl", n=80)
    kw = dict(block_size=48) if packed else {}
    monkeypatch.setattr(data_prep, "CHUNK_CHARS", 300)  # many chunks, so both workers get several
    prepare(inputs, tmp_path / "one", vocab_size=VOCAB, num_proc=1, **kw)
    prepare(inputs, tmp_path / "two", vocab_size=VOCAB, num_proc=2, **kw)
    names = sorted(os.listdir(tmp_path / "one"))
    assert ("train_pos.bin" in names) == packed
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def write_sft(path, n=60, seed=3):
    """prompt/response samples of very different lengths; returns the records."""
    rng = random.Random(seed)
    records = [{"prompt": f"Q{i}: " + sentence(rng, rng.randint(1, 8)) + "\nA:",
                "response": " " + sentence(rng, rng.randint(1, 25)), "id": i} for i in range(n)]  # "id": ignored
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


@pytest.mark.parametrize("long_samples", ["truncate", "skip"])
def test_packed_rows(long_samples, sp_model, tmp_path, capsys):
    N = 80
    records = write_sft(tmp_path / "sft.jsonl")
    out = tmp_path / "out"
    meta = prepare([tmp_path / "sft.jsonl"], out, tokenizer=sp_model, val_fraction=0.2, num_proc=1,
                   block_size=N, long_samples=long_samples)
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    lengths = [2 + len(sp.encode(r["prompt"])) + len(sp.encode(r["response"])) for r in records]
    n_long = sum(n > N for n in lengths)
    assert 0 < n_long < len(records) // 2
    assert meta["packed"] and meta["has_mask"] and meta["has_pos"] and meta["block_size"] == N
    assert (meta["truncated_samples"], meta["skipped_samples"]) == ((n_long, 0) if long_samples == "truncate" else (0, n_long))
    assert f"{n_long:,} {'samples truncated' if long_samples == 'truncate' else 'skipped'}" in capsys.readouterr().out
    _, read = load(out)
    texts, n_pad = [], 0
    for split in ("train", "val"):
        ids, mask, pos = read(f"{split}.bin", np.uint16), read(f"{split}_mask.bin", np.uint8), read(f"{split}_pos.bin", np.uint16)
        rows = meta[f"{split}_rows"]
        assert len(ids) == len(mask) == len(pos) == rows * N + 1 == meta[f"{split}_tokens"]
        assert (ids[-1], mask[-1], pos[-1]) == (2, 0, 0)  # the extra token, so the last window is whole
        for r in range(rows):
            window = ids[r * N:r * N + N + 1]  # how the trainers read it
            assert len(window) == N + 1 and pos[r * N] == 0  # every row starts a sample: none is split
            starts = list(np.flatnonzero(pos[r * N:(r + 1) * N] == 0)) + [N]
            for a, b in zip(starts, starts[1:]):
                t, m, p = ids[r * N + a:r * N + b], mask[r * N + a:r * N + b], pos[r * N + a:r * N + b]
                assert (p == np.arange(b - a)).all()
                if t[0] != 1:  # padding: eos, never trained
                    assert (t == 2).all() and not m.any()
                    n_pad += len(t)
                    continue
                n_prompt = int((m == 0).sum())
                assert (m[:n_prompt] == 0).all() and (m[n_prompt:] == 1).all()  # BOS and prompt 0, response 1
                full = t[-1] == 2
                assert full or len(t) == N  # a sample without its EOS was truncated to a whole row
                texts.append((sp.decode(t[1:n_prompt].tolist()), sp.decode(t[n_prompt:len(t) - full].tolist()), full))
    assert n_pad == meta["pad_tokens"]
    kept = [(r["prompt"], r["response"]) for r, n in zip(records, lengths) if n <= N]
    assert sorted((p, q) for p, q, full in texts if full) == sorted(kept)
    truncated = [(p, q) for p, q, full in texts if not full]
    assert len(truncated) == meta["truncated_samples"]
    for p, q in truncated:  # the prompt whole, the response's head
        r = next(r for r in records if r["prompt"] == p)
        assert r["response"].startswith(q)  # its EOS at least is gone


def test_packed_sample_whose_prompt_fills_a_row_is_skipped(sp_model, tmp_path):
    # truncated to a row it would be all prompt, nothing to train: skipped and counted as such
    records = [{"prompt": f"Q: {i} alpha beta\nA:", "response": " gamma delta"} for i in range(20)]
    records.insert(3, {"prompt": "alpha beta gamma " * 40, "response": " delta"})
    with open(tmp_path / "sft.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    meta = prepare([tmp_path / "sft.jsonl"], tmp_path / "out", tokenizer=sp_model, val_fraction=0.2, num_proc=1,
                   block_size=32, long_samples="truncate")
    assert (meta["truncated_samples"], meta["skipped_samples"]) == (0, 1)
    assert meta["train_docs"] + meta["val_docs"] == 20


def test_json_files_are_records(sp_model, tmp_path, capsys):
    records = [{"text": f"document {i} " + "words " * i} for i in range(30)]
    (tmp_path / "array.json").write_text(json.dumps(records, indent=1))  # an array across many lines
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in records))
    for name in ("array.json", "lines.json"):
        meta = prepare([tmp_path / name], tmp_path / name.split(".")[0], tokenizer=sp_model, num_proc=1)
        assert meta["train_docs"] + meta["val_docs"] - meta["cut_docs"] == 30 and not meta["packed"]
        ids = np.fromfile(tmp_path / name.split(".")[0] / "train.bin", dtype=np.uint16)
        sp = spm.SentencePieceProcessor(model_file=str(sp_model))
        assert "{" not in sp.decode(ids.tolist()) and sp.decode(split_docs(ids, 2)[0].tolist()).startswith("document")
    # records with nothing to train on are left out, and counted
    (tmp_path / "empty.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records + [{"text": ""}, {"text": ""}]))
    meta = prepare([tmp_path / "empty.jsonl"], tmp_path / "empty", tokenizer=sp_model, num_proc=1)
    assert meta["train_docs"] + meta["val_docs"] - meta["cut_docs"] == 30
    assert "note: 2 records with nothing in them left out: " in capsys.readouterr().out


def test_long_file_is_read_in_pieces_at_line_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(data_prep, "DOC_CHARS", 100)
    text = "".join(f"line {i} of a long file\n" for i in range(50))
    (tmp_path / "long.txt").write_text(text)
    docs = list(iter_documents(list_files([tmp_path / "long.txt"])))
    assert len(docs) > 5 and "".join(t for _, _, t, _, _ in docs) == text
    assert all(t.endswith("\n") for _, _, t, _, _ in docs) and len({k for k, *_ in docs}) == 1
    assert [(f, last) for *_, f, last in docs] == [(True, False)] + [(False, False)] * (len(docs) - 2) + [(False, True)]


def test_long_file_in_pieces_decodes_back_with_a_dummy_prefix_tokenizer(tmp_path, monkeypatch):
    # a Llama 2 style SentencePiece model puts a space in front of every text it encodes: the pieces
    # of a long file after the first must not get one, or the file no longer decodes back
    text = "".join(f"line {i} hello world foo bar\n" for i in range(600))
    (tmp_path / "a.txt").write_text(text)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_writer=model, vocab_size=300,
                                   model_type="bpe", byte_fallback=True, add_dummy_prefix=True,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    (tmp_path / "llama2ish.model").write_bytes(model.getvalue())
    monkeypatch.setattr(data_prep, "DOC_CHARS", 2000)  # about ten pieces
    meta = prepare([tmp_path / "a.txt"], tmp_path / "out", tokenizer=tmp_path / "llama2ish.model", num_proc=1,
                   val_fraction=0.05)
    tok = data_prep.load_tokenizer(tmp_path / "out")
    assert tok.encode("a") != tok.encode("\na")[len(tok.encode("\n")):]  # the dummy prefix is there
    (train,), (val,) = (split_docs(np.fromfile(tmp_path / "out" / f"{s}.bin", dtype=meta["dtype"]), tok.eos_id, tok.bos_id)
                        for s in ("train", "val"))
    # the val part is a document of its own: encoded alone, it starts with the dummy space
    assert tok.decode(train.tolist()) + tok.decode(val.tolist()) == text


def test_a_response_takes_no_dummy_prefix_space(tmp_path):
    # a Llama 2 style tokenizer puts a space piece in front of every text it encodes: a response encoded
    # so would train a piece the whole text never has (the model would answer with a double space)
    lines = [f"Q: what is {i} plus one\nA: {i + 1} is the answer" for i in range(300)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=320, model_type="bpe",
                                   byte_fallback=True, add_dummy_prefix=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, minloglevel=2)
    (tmp_path / "llama2ish.model").write_bytes(model.getvalue())
    records = [{"prompt": f"Q: what is {i} plus one\nA:", "response": f" {i + 1} is the answer"} for i in range(40)]
    # prompts that end in a space, whose last piece merges with the response's first
    records += [{"prompt": f"Q: what is {i} plus one\nA: ", "response": f"the answer is {i + 1}"} for i in range(40)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = prepare([tmp_path / "sft.jsonl"], tmp_path / "out", tokenizer=tmp_path / "llama2ish.model", num_proc=1,
                   val_fraction=0.2, block_size=64)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "llama2ish.model"))
    _, read = load(tmp_path / "out")
    ids, mask = read("train.bin", np.uint16), read("train_mask.bin", np.uint8)
    starts = np.flatnonzero(ids == sp.bos_id())
    for a, b in zip(starts, list(starts[1:]) + [len(ids)]):
        t, m = ids[a:b].tolist(), mask[a:b]
        end = t.index(sp.eos_id())
        n_prompt = int((m[:end] == 0).sum())
        joint = sp.encode(sp.decode(t[1:end]))
        assert t[1:end] == joint and sp.id_to_piece(t[n_prompt]) != "\u2581"  # as the whole text encodes, no lone space
        # and the response is all trained on: a piece merged across the boundary belongs to it
        assert "  " not in sp.decode(t[1:end]) and sp.decode(t[n_prompt:end]).lstrip()[:1] in "t123456789"
    assert meta["train_docs"] + meta["val_docs"] == 80


def test_a_prefix_space_tokenizer_whose_newline_alone_is_another_token(tmp_path, monkeypatch):
    # ByteLevel's add_prefix_space puts a space before every text; with " \n" in the vocabulary, "\n" alone
    # encodes as one token that "\na" does not begin with, which once hid the prefix from the check: the
    # pieces of a long file, and a response, got a space the whole text never has
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=True), decoders.ByteLevel()
    hf.train_from_iterator(["some words here \nand more words \n" * 50, "hello there\nhow are you\n" * 50],
                           trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    (tmp_path / "hf").mkdir()
    hf.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = load_tokenizer(tmp_path / "hf")
    assert tok.encode("\n") == [hf.token_to_id("ĠĊ")] and tok.encode("\na")[:2] == [hf.token_to_id("Ġ"), hf.token_to_id("Ċ")]
    assert tok.prefixes and tok.bos_id == 0
    text = "".join(f"line {i} of the file\n" for i in range(400))
    (tmp_path / "a.txt").write_text(text)
    monkeypatch.setattr(data_prep, "DOC_CHARS", 500)
    meta = prepare([tmp_path / "a.txt"], tmp_path / "out", tokenizer=tmp_path / "hf", num_proc=1, val_fraction=0.05)
    (train,), (val,) = (split_docs(np.fromfile(tmp_path / "out" / f"{s}.bin", dtype=meta["dtype"]), tok.eos_id, tok.bos_id)
                        for s in ("train", "val"))
    # each document, the train head and the val tail, decodes with the one prefix space it was encoded with
    head, tail = tok.decode(train.tolist()), tok.decode(val.tolist())
    assert head[:1] == tail[:1] == " " and head[1:] + tail[1:] == text
    records = [{"prompt": f"question {i}:\n", "response": "some words here"} for i in range(20)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = prepare([tmp_path / "sft.jsonl"], tmp_path / "sft", tokenizer=tmp_path / "hf", num_proc=1,
                   val_fraction=0.1, block_size=64)
    ids = np.fromfile(tmp_path / "sft" / "train.bin", dtype=meta["dtype"]).tolist()
    first = ids[1:ids.index(tok.eos_id)]
    assert ids[0] == tok.bos_id and first == tok.encode(tok.decode(first)) and tok.decode(first).endswith(":\nsome words here")


def test_a_linked_folder_is_read_and_a_loop_ends(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "corpus" / "own.txt").write_text("own\n")
    (tmp_path / "elsewhere" / "far.txt").write_text("far\n")
    (tmp_path / "corpus" / "linked").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "corpus" / "loop").symlink_to(tmp_path / "corpus")  # back to itself
    assert [key for _, key in list_files([tmp_path / "corpus"])] == ["own.txt", "linked/far.txt"]


def test_data_prepared_into_a_model_folder_keeps_its_files(corpus, sp_model, tmp_path):
    from test_tokenizers import write_hf
    # an HF folder with a tokenizer.model beside its tokenizer.json (Llama 2's have both): kept, and never read
    model = write_hf(tmp_path / "model", {"bos_token": "<s>", "eos_token": "</s>"})
    (model / "config.json").write_text("{}")
    shutil.copy(sp_model, model / "tokenizer.model")
    prepare([corpus[0]], model, tokenizer=model, num_proc=1)
    assert (model / "tokenizer.model").read_bytes() == sp_model.read_bytes()
    assert data_prep.load_data_meta(str(model), 8)["tokenizer"]["kind"] == "hf"  # the data reads as it was made
    # the data made with its tokenizer.model instead: its tokenizer.json would be read in its place
    with pytest.raises(DataPrepError, match=r"is a model's folder, whose tokenizer\.json would be "
                                            r"read with or instead of the tokenizer the data is made with \(tokenizer\.model\)"):
        prepare([corpus[0]], model, tokenizer=model / "tokenizer.model", num_proc=1)


def test_val_share_of_packed_samples_leaves_padding_out(sp_model, tmp_path, capsys):
    # short samples in long rows: most of each split is padding, which says nothing of the split
    records = [{"prompt": f"Q{i}: alpha beta\nA:", "response": " gamma delta"} for i in range(200)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = prepare([tmp_path / "sft.jsonl"], tmp_path / "out", tokenizer=sp_model, val_fraction=0.05, num_proc=1,
                   block_size=2048)
    assert meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"]) > 0.2  # rows: a whole one for a few samples
    assert meta["val_share"] == pytest.approx(meta["val_docs"] / 200, rel=0.1) and 0.025 <= meta["val_share"] <= 0.1
    assert "warning: val holds" not in capsys.readouterr().out


def test_split_at_a_piece_boundary_ends_and_starts_a_document(sp_model, tmp_path, monkeypatch):
    # the val split falling exactly where one piece of a long file ends and the next begins: the
    # train part still ends with EOS and the val part starts with BOS
    (tmp_path / "a.txt").write_text("".join(f"row {i:05d}\n" for i in range(110)))  # 110 lines of 10 characters
    monkeypatch.setattr(data_prep, "DOC_CHARS", 100)  # pieces of 100 characters and the line after: 110
    monkeypatch.setattr(data_prep, "MIN_TAIL_CHARS", 100)
    meta = prepare([tmp_path / "a.txt"], tmp_path / "out", tokenizer=sp_model, num_proc=1, val_fraction=0.1)
    tok = data_prep.load_tokenizer(tmp_path / "out")
    for s in ("train", "val"):
        assert len(split_docs(np.fromfile(tmp_path / "out" / f"{s}.bin", dtype=meta["dtype"]), tok.eos_id, tok.bos_id)) == 1


def test_failed_run_keeps_old_outputs_and_a_new_one_replaces_them(corpus, tmp_path):
    root, _ = corpus
    out = tmp_path / "out"
    write_jsonl(tmp_path / "sft.jsonl")
    prepare([tmp_path / "sft.jsonl"], out, vocab_size=VOCAB, num_proc=1, block_size=64)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataPrepError):
        prepare([root, tmp_path / "bad.jsonl"], out, vocab_size=VOCAB, num_proc=1)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    prepare([root], out, vocab_size=VOCAB, num_proc=1)
    assert sorted(os.listdir(out)) == ["meta.json", "tokenizer.model", "train.bin", "val.bin"]  # old masks gone
    assert not [e for e in os.listdir(tmp_path) if ".tmp" in e]  # no temp folder left, the failed run's neither


def test_killed_runs_temp_folder_is_named(corpus, tmp_path, capsys):
    # a SIGKILL leaves the hidden temp folder beside out_dir: the next run names it and its size
    root, _ = corpus
    left = tmp_path / ".out.tmp-x1y2"
    left.mkdir()
    (left / "train.bin").write_bytes(bytes(3 * 2 ** 20))
    prepare([root], tmp_path / "out", vocab_size=VOCAB, num_proc=1)
    assert f"warning: {left} (3.0 MiB) is the unfinished output of a data_prep.py that was killed" in capsys.readouterr().out
    assert left.exists()  # not removed: it may be another run's, still writing


@pytest.mark.parametrize("case, message", [
    ("missing", r"--input .*nowhere does not exist"),
    ("empty_folder", r"no text files in"),
    ("empty_file", r"no readable text in"),
    ("binary_only", r"no readable text in .*\(1 files skipped as binaries"),
    ("not_utf8", r"2 files are not UTF-8 text \(.*latin1\.txt, .*latin2\.txt\); convert them"),
    ("input_twice", r"--input reaches .*doc0\.md twice \(as .*corpus/sub/doc0\.md and .*sub/doc0\.md\); its copies would be split apart"),
    ("malformed_jsonl", r"bad\.jsonl line 3 is malformed JSON"),
    ("jsonl_fields", r'bad\.jsonl line 2 has keys prompt: a record needs a "text" string, or "prompt" and "response"'),
    ("both_shapes", r'bad\.jsonl line 1 has keys prompt, response, text: .* not both'),
    ("pair_and_other_text", r'bad\.jsonl line 2 has keys prompt, response, text: .* not both'),  # its text was dropped
    ("alpaca", r'bad\.jsonl line 1 has keys input, instruction, output'),
    ("lone_surrogate", r"bad\.jsonl line 2 holds a lone surrogate \(an escape such as \\ud83d without its pair\)"),
    ("json_neither", r"bad\.json line 1 is neither a JSON array of records nor JSON lines"),
    ("json_bad_array", r"bad\.json starts like a JSON array of records but does not parse"),
    ("sft_without_block_size", r"sft\.jsonl:1 is a prompt/response sample: give --block_size N"),
    ("block_size_on_text", r"--block_size packs prompt/response samples, and this input has none"),
    ("skip_on_text", r"--long_samples skip applies to prompt/response samples, and this input has none"),
    ("long_text_in_sft", r"long\.txt is over 100 characters: too long for one sample"),
    ("vocab_too_large", r"--vocab_size 5000 is too large for this corpus, which supports at most \d+"),
    ("vocab_too_small", r"--vocab_size 100 is too small"),
    ("tokenizer_missing", r"tokenizer .*none\.model does not exist"),
    ("tokenizer_not_a_model", r"tokenizer .*fake\.model is none of a SentencePiece model"),
    ("both_vocab_and_tokenizer", r"not both"),
    ("val_fraction", r"--val_fraction must be between 0 and 1"),
    ("long_samples", r"--long_samples must be 'truncate' or 'skip'"),
    ("num_proc_zero", r"--num_proc must be at least 1, got 0"),
])
def test_errors(case, message, corpus, tmp_path, monkeypatch):
    root, _ = corpus
    kw = dict(vocab_size=VOCAB)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "fake.model").write_text("not a model\n")
    (tmp_path / "latin1.txt").write_bytes("un café\n".encode("latin-1"))
    (tmp_path / "latin2.txt").write_bytes("une crème\n".encode("latin-1"))
    write_jsonl(tmp_path / "sft.jsonl", plain_every=0)
    bad = tmp_path / "bad.jsonl"
    inputs = {
        "missing": [root, tmp_path / "nowhere"],
        "empty_folder": [tmp_path / "empty"],
        "empty_file": [tmp_path / "empty.txt"],
        "binary_only": [root / "image.txt"],
        "not_utf8": [root, tmp_path / "latin1.txt", tmp_path / "latin2.txt"],
        "input_twice": [root, root / "sub"],
        "json_neither": [tmp_path / "bad.json"],
        "json_bad_array": [tmp_path / "bad.json"],
        "sft_without_block_size": [tmp_path / "sft.jsonl"],
        "long_text_in_sft": [tmp_path / "sft.jsonl", tmp_path / "long.txt"],
    }.get(case, [bad] if case in ("malformed_jsonl", "jsonl_fields", "both_shapes", "pair_and_other_text", "alpaca",
                                  "lone_surrogate") else [root])
    bad.write_text({
        "malformed_jsonl": '{"text": "a"}\n{"text": "b"}\n{"text": "c",,}\n',
        "jsonl_fields": '{"text": "a"}\n{"prompt": "only a prompt"}\n',
        "both_shapes": '{"text": "a", "prompt": "b", "response": "c"}\n',
        "pair_and_other_text": '{"text": "a"}\n{"prompt": "a", "response": "b", "text": 5}\n',
        "alpaca": '{"instruction": "a", "input": "", "output": "c"}\n',
        "lone_surrogate": '{"text": "a"}\n{"text": "half a pair: \\ud83d"}\n',
    }.get(case, ""))
    (tmp_path / "bad.json").write_text('{\n  "text": "pretty-printed single object"\n}\n' if case == "json_neither"
                                       else '[{"text": "a"},\n')
    if case == "long_text_in_sft":
        monkeypatch.setattr(data_prep, "DOC_CHARS", 100)
        (tmp_path / "long.txt").write_text("a line of text\n" * 30)
    kw.update({
        "block_size_on_text": dict(block_size=64),
        "skip_on_text": dict(long_samples="skip"),
        "long_text_in_sft": dict(block_size=64),
        "vocab_too_large": dict(vocab_size=5000),
        "vocab_too_small": dict(vocab_size=100),
        "tokenizer_missing": dict(vocab_size=None, tokenizer=tmp_path / "none.model"),
        "tokenizer_not_a_model": dict(vocab_size=None, tokenizer=tmp_path / "fake.model"),
        "both_vocab_and_tokenizer": dict(tokenizer=tmp_path / "fake.model"),
        "val_fraction": dict(val_fraction=1.0),
        "long_samples": dict(long_samples="drop"),
        "num_proc_zero": dict(num_proc=0),
    }.get(case, {}))
    out = tmp_path / "out"
    with pytest.raises(DataPrepError, match=message):
        prepare(inputs, out, **{"num_proc": 1, **kw})
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


def test_unreadable_folder_is_refused(tmp_path, monkeypatch):
    # os.walk leaves out a folder it cannot list, and everything below it; a corpus half missing is refused
    for sub in ("open", "locked"):
        (tmp_path / "in" / sub).mkdir(parents=True)
        (tmp_path / "in" / sub / "a.txt").write_text("text\n")
    scandir = os.scandir

    def denied(path="."):
        if os.path.basename(os.fspath(path)) == "locked":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)
    monkeypatch.setattr(os, "scandir", denied)
    with pytest.raises(DataPrepError, match=r"cannot read folder .*locked: Permission denied"):
        list_files([tmp_path / "in"])
