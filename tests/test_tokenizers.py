"""Each tokenizer kind built tiny and offline, prepared data decoded back, and the loader's refusals."""
import base64
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import sentencepiece as spm
import pytest
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import data_prep  # noqa: E402
from data_prep import (DataPrepError, iter_documents, list_files, load_data_meta, load_tokenizer, prepare,  # noqa: E402
                       remove_tokenizer_files, tokenizer_mismatch, train_tokenizer)

TEXTS = {
    "a.txt": "def f(x):\n    return x + 1  # done\n" * 20,
    "b.md": "# Café naïve résumé\n\nThe quick brown fox, 42 times. ✓\n" * 15,
    "c.txt": "tabs\tand\r\nwindows lines <|begin_of_text|> </s> <s> literal specials\n" * 10,
    "d.txt": "one long line without a newline at its end " * 30,
}
LLAMA3_MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"er", b"an", b"re", b"on", b" a", b"  ", b"    ",
                 b"de", b"def", b"re", b"ur", b"rn", b"urn", b"ret", b"return"]


def write_corpus(root):
    root.mkdir()
    for name, text in TEXTS.items():
        (root / name).write_text(text, encoding="utf-8", newline="")
    return root


def write_tiktoken(path, merges=LLAMA3_MERGES, n_pairs=0, n=128_000):
    """A tiktoken BPE file as Meta ships Llama 3's: the 256 bytes, then merges (or all byte pairs
    up to n_pairs), one "base64 rank" per line, n tokens in all (Llama 3's 128,000): the rest are
    tokens no text forms (they start with 0xF8, a byte UTF-8 never holds)."""
    tokens = [bytes([b]) for b in range(256)]
    tokens += list(dict.fromkeys(m for m in merges if len(m) > 1))
    tokens += [bytes([a, b]) for a in range(256) for b in range(256)][:n_pairs]
    tokens = list(dict.fromkeys(tokens))
    tokens += [b"\xf8" + i.to_bytes(3, "big") for i in range(n - len(tokens))]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return path, len(tokens)


def write_sentencepiece(path, text=None, vocab_size=340):
    lines = (text or "".join(TEXTS.values())).splitlines()
    path.write_bytes(train_tokenizer(lines, vocab_size))
    return path


def write_hf(folder, config=None, template=True):
    """A byte-level BPE tokenizer.json with <s> and </s>, and a tokenizer_config.json naming them."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS.values(), trainer)
    if template:  # BOS added by the tokenizer itself, as Llama 3's tokenizer.json does; or the template given
        template = "<s> $A" if template is True else template
        tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[
            (t, i) for i, t in enumerate(("<unk>", "<s>", "</s>")) if t in template.split()])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True} if config is None else config
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def documents(ids, bos_id, eos_id):
    """A flat stream cut at each EOS; every document starts with BOS when the tokenizer has one."""
    ends = np.flatnonzero(ids == eos_id)
    assert len(ids) and ends[-1] == len(ids) - 1, "a stream ends with EOS"
    docs = [d[:-1].tolist() for d in np.split(ids, ends + 1)[:-1]]
    if bos_id is not None:
        assert all(d[:1] == [bos_id] and bos_id not in d[1:] for d in docs)
        docs = [d[1:] for d in docs]
    return docs


def decode_documents(out, tok):
    """The input texts read back from train.bin and val.bin: whole documents, and heads joined to tails."""
    meta = json.loads((out / "meta.json").read_text())
    docs = {s: [tok.decode(d) for d in documents(np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]),
                                                 tok.bos_id, tok.eos_id)] for s in ("train", "val")}
    whole = [d for s in docs.values() for d in s if d in TEXTS.values()]
    heads = [d for d in docs["train"] if d not in TEXTS.values()]
    tails = [d for d in docs["val"] if d not in TEXTS.values()]
    assert len(heads) == len(tails) == meta["cut_docs"]
    return whole + [h + t for h, t in zip(heads, tails)]


@pytest.mark.parametrize("kind", ["sentencepiece", "hf", "tiktoken"])
def test_round_trip_and_special_ids(kind, tmp_path):
    if kind == "sentencepiece":
        path, ids = write_sentencepiece(tmp_path / "sp.model"), (1, 2)
    elif kind == "hf":
        path = write_hf(tmp_path / "hf")
        vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
        ids = (vocab["<s>"], vocab["</s>"])
    else:
        path, n = write_tiktoken(tmp_path / "tokenizer.model")
        ids = (n, n + 1)  # <|begin_of_text|>, <|end_of_text|>: 128000 and 128001 for Llama 3's 128000 pieces
    tok = load_tokenizer(path)
    assert tok.kind == kind and (tok.bos_id, tok.eos_id) == ids
    out = tmp_path / "out"
    meta = prepare([write_corpus(tmp_path / "corpus")], out, tokenizer=path, val_fraction=0.2, num_proc=1)
    assert (meta["bos_id"], meta["eos_id"]) == ids and meta["dtype"] == ("uint32" if kind == "tiktoken" else "uint16")
    assert sorted(decode_documents(out, tok)) == sorted(TEXTS.values())
    # out_dir's copy is the same tokenizer, found by the folder alone
    fp = load_tokenizer(out).fingerprint()
    assert {k: v for k, v in meta["tokenizer"].items() if k != "files"} == fp == tok.fingerprint()
    assert meta["tokenizer"]["files"] == (["tokenizer.json", "tokenizer_config.json"] if kind == "hf"
                                          else ["tokenizer.model"])


def test_llama3_specials_and_literal_special_text(tmp_path, capsys):
    path, n = write_tiktoken(tmp_path / "tokenizer.model")
    tok = load_tokenizer(path)
    # a file of Llama 3's size that is not Meta's (this test's own) is read as Llama 3's, with a warning, once
    load_tokenizer(path)
    assert capsys.readouterr().err.count(f"warning: tokenizer {path} is a tiktoken file of 128,000 tokens but not "
                                         f"Meta's Llama 3 tokenizer.model") == 1
    assert tok.vocab_size == n + 256
    assert tok.encode("<|eot_id|>") != [n + 9] and tok.decode(tok.encode("<|eot_id|>")) == "<|eot_id|>"
    assert tok.decode([n + 9]) == "<|eot_id|>" and tok.decode([n + 255]) == "<|reserved_special_token_246|>"
    # Meta's split keeps digits in threes and a space with the word after it
    assert [tok.decode([i]) for i in tok.encode("12345 the")][:2] == ["1", "2"]  # no digit merges in this vocabulary
    assert tok.decode(tok.encode(" " * 30_000 + "x")) == " " * 30_000 + "x"  # long runs are split, as Meta's
    # another model's tiktoken file (Llama 4's 200,000 tokens, OpenAI's) has other specials and splits: refused
    other, _ = write_tiktoken(tmp_path / "other.model", n=200_000)
    with pytest.raises(DataPrepError, match="is a tiktoken file of 200,000 tokens, which is read as Meta's Llama 3 "
                                            "tokenizer.model only with Llama 3's 128,000"):
        load_tokenizer(other)


def write_sentencepiece_user_eos(folder):
    """write_sentencepiece's model with a user-defined piece "<|im_end|>" (which SentencePiece matches in
    text) that a tokenizer_config.json names as EOS, as some chat models' tokenizers do."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    folder.mkdir()
    proto = pb.ModelProto.FromString(write_sentencepiece(folder / "tokenizer.model").read_bytes())
    proto.pieces.add(piece="<|im_end|>", score=0.0, type=pb.ModelProto.SentencePiece.USER_DEFINED)
    (folder / "tokenizer.model").write_bytes(proto.SerializeToString())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return folder


def write_hf_loose_eos(folder):
    """write_hf's tokenizer with its BOS and EOS added tokens not marked special, which tokenizers
    matches in text; BOS named by the post-processor alone."""
    write_hf(folder, config={"eos_token": "</s>"})
    spec = json.loads((folder / "tokenizer.json").read_text())
    for t in spec["added_tokens"]:
        t["special"] = t["special"] and t["content"] not in ("<s>", "</s>")
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


@pytest.mark.parametrize("kind", ["sentencepiece", "sentencepiece-user-eos", "hf", "hf-loose-eos", "tiktoken"])
def test_chat_markers_in_the_data_are_named(kind, tmp_path, capsys):
    # prompt/response samples with a chat format written in: encoded as text (as every text is),
    # which prepare says, naming one; a corpus with one stray marker in a hundred documents is not a format
    path = {"sentencepiece": lambda: write_sentencepiece(tmp_path / "sp.model"), "hf": lambda: write_hf(tmp_path / "hf"),
            "hf-loose-eos": lambda: write_hf_loose_eos(tmp_path / "hf"),
            "sentencepiece-user-eos": lambda: write_sentencepiece_user_eos(tmp_path / "sp"),
            "tiktoken": lambda: write_tiktoken(tmp_path / "tokenizer.model")[0]}[kind]()
    marker = {"sentencepiece": "</s>", "sentencepiece-user-eos": "<|im_end|>", "hf": "</s>", "hf-loose-eos": "</s>",
              "tiktoken": "<|eot_id|>"}[kind]
    tok = load_tokenizer(str(path))
    assert tok.eos_id not in tok.encode(f"a{marker} b")  # text, not the end of a document
    assert tok.bos_id is None or tok.bos_id not in tok.encode("a<s> b<|begin_of_text|>")
    sft = tmp_path / "chat.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"user: hi {i}{marker}", "response": f"hello {i}{marker}"}) + "\n"
                           for i in range(40)))
    prepare([sft], tmp_path / "out", tokenizer=path, val_fraction=0.2, num_proc=1, block_size=64)
    assert (f"warning: 40 of the 40 documents or samples hold strings of the tokenizer's special tokens (the first: "
            f"{marker!r}), encoded as plain text") in capsys.readouterr().out
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(150):
        (corpus / f"{i}.txt").write_text(f"document {i} " * 5 + (marker if i == 7 else ""))
    prepare([corpus], tmp_path / "out2", tokenizer=path, val_fraction=0.2, num_proc=1)
    assert "special tokens" not in capsys.readouterr().out


def test_hf_bos_semantics(tmp_path):
    from transformers import AutoTokenizer
    names = {"bos_token": "<s>", "eos_token": "</s>"}
    # the post-processor decides, as in transformers; add_bos_token may say the same
    for name, config, template, bos in (("tmpl", names, True, 1), ("on", {**names, "add_bos_token": True}, True, 1),
                                        ("none", names, False, None), ("off", {**names, "add_bos_token": False}, False, None),
                                        # no config names a BOS, yet the post-processor puts one before every text
                                        ("tmpl_only", {"eos_token": "</s>"}, True, 1)):
        tok = load_tokenizer(write_hf(tmp_path / name, config, template))
        assert (tok.bos_id, tok.eos_id) == (bos, 2)
        assert AutoTokenizer.from_pretrained(tmp_path / name)("a b").input_ids == [bos] * (bos is not None) + tok.encode("a b")
    # saying otherwise: transformers 4's LlamaTokenizerFast would follow the config, 5 the post-processor
    for template, said in ((True, False), (False, True)):
        with pytest.raises(DataPrepError, match=f"says add_bos_token {said}, yet .* set add_bos_token to {str(not said).lower()}"):
            load_tokenizer(write_hf(tmp_path / f"disagree{said}", {**names, "add_bos_token": said}, template))
    # special_tokens_map.json alone names them too, and is copied along
    folder = write_hf(tmp_path / "map", {}, template=False)
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}</s>{% endfor %}")
    tok = load_tokenizer(folder / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id) == (None, 2)  # no add_bos_token and no template: no BOS
    meta = prepare([write_corpus(tmp_path / "corpus")], tmp_path / "out", tokenizer=folder, num_proc=1)
    assert meta["bos_id"] is None and sorted(decode_documents(tmp_path / "out", tok)) == sorted(TEXTS.values())
    # the chat template in a file of its own (transformers 4.4x on) goes along too, into every export
    assert sorted(meta["tokenizer"]["files"]) == ["chat_template.jinja", "special_tokens_map.json", "tokenizer.json",
                                                  "tokenizer_config.json"]
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == (folder / "chat_template.jinja").read_text()
    # the two files naming other tokens: transformers 5 lets the map win unless the config lists its added tokens
    folder = write_hf(tmp_path / "both", names)
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<s>"}}))
    with pytest.raises(DataPrepError, match=r"tokenizer_config\.json names eos_token '</s>', .*special_tokens_map\.json '<s>', "
                                            r"which transformers versions read differently"):
        load_tokenizer(folder)
    with pytest.raises(DataPrepError, match="no eos_token"):
        load_tokenizer(write_hf(tmp_path / "noeos", {"bos_token": "<s>"}))
    # a post-processor that also ends a text with the EOS: as the data ends each document
    tok = load_tokenizer(write_hf(tmp_path / "bos_eos", names, "<s> $A </s>"))
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert AutoTokenizer.from_pretrained(tmp_path / "bos_eos")("a b").input_ids == [1] + tok.encode("a b") + [2]
    # a post-processor adding another token than the named BOS, or more than one: transformers would
    # put it into every prompt, where the data holds the named BOS alone
    for name, template in (("other", "<unk> $A"), ("two", "<s> <unk> $A"), ("suffix", "<s> $A <unk>")):
        with pytest.raises(DataPrepError, match=r"post-processor puts \[.*\] before a text and \[.*\] after it, where the "
                                                r"data would hold each document as \['<s>'\] text \['</s>'\]"):
            load_tokenizer(write_hf(tmp_path / name, names, template))
    with pytest.raises(DataPrepError, match="names eos_token '<eos>', which"):
        load_tokenizer(write_hf(tmp_path / "bad", {"eos_token": "<eos>"}))


def test_hf_bos_or_eos_text_can_make_is_refused(tmp_path):
    # a BOS or EOS that is an ordinary entry of the vocabulary, not an added token: text holding its
    # string would start or end a document (an added one not marked special is made special: above)
    folder = write_hf(tmp_path / "hf", template=False)
    vocab = HFTokenizer.from_file(str(folder / "tokenizer.json")).get_vocab()
    piece = next(t for t, i in sorted(vocab.items(), key=lambda kv: -kv[1]) if t.isascii() and t.isalpha())
    for key in ("eos_token", "bos_token"):
        (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", key: piece,
                                                                 "add_bos_token": False}))
        if key == "bos_token":  # a BOS no text starts with is never written
            assert load_tokenizer(folder).bos_id is None
            continue
        with pytest.raises(DataPrepError, match=f"holds eos_token {piece!r} as an ordinary entry of its vocabulary"):
            load_tokenizer(folder)


def test_sentencepiece_folder_follows_its_tokenizer_config(tmp_path):
    # a transformers folder with only tokenizer.model: its tokenizer_config.json decides BOS, as
    # for a tokenizer.json, and travels with the data
    folder = tmp_path / "sp"
    folder.mkdir()
    plain = load_tokenizer(write_sentencepiece(folder / "tokenizer.model"))
    assert plain.bos_id == 1
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "</s>"}))
    tok = load_tokenizer(folder)
    assert (tok.bos_id, tok.eos_id) == (None, plain.eos_id)
    meta = prepare([write_corpus(tmp_path / "corpus")], tmp_path / "out", tokenizer=folder, num_proc=1)
    assert meta["bos_id"] is None and sorted(decode_documents(tmp_path / "out", tok)) == sorted(TEXTS.values())
    assert sorted(meta["tokenizer"]["files"]) == ["tokenizer.model", "tokenizer_config.json"]
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    with pytest.raises(DataPrepError, match="names eos_token '<eos>', which"):
        load_tokenizer(folder)
    # a piece that text is cut into cannot end documents (a user-defined one is made a control piece: above)
    for piece in ("<unk>", spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).id_to_piece(300)):
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": piece}))
        with pytest.raises(DataPrepError, match=f"names eos_token {re.escape(repr(piece))}, which .* holds as a piece of "
                                                f"ordinary text"):
            load_tokenizer(folder)


def test_added_tokens_of_the_config_must_be_the_tokenizers(tmp_path):
    # transformers adds every token of tokenizer_config.json's added_tokens_decoder on load: one the
    # tokenizer does not hold there would give the deployed model ids and splits the data never had
    from transformers import AutoTokenizer
    folder = write_hf(tmp_path / "hf")
    tok, hf = load_tokenizer(folder), HFTokenizer.from_file(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    flags = dict(lstrip=False, rstrip=False, normalized=False, single_word=False, special=False)
    word = next(t for t in hf.get_vocab() if len(t) > 3)  # an ordinary entry of the vocabulary
    for entries, said in [({tok.vocab_size: "<tool>"}, "lists added token '<tool>' at id"),
                          ({2: "<eos>"}, "lists added token '<eos>' at id 2, where .* holds '</s>'"),
                          ({hf.token_to_id(word): word}, "as an ordinary entry of its vocabulary")]:
        decoder = {str(i): {"content": t, **flags} for i, t in entries.items()}
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "added_tokens_decoder": decoder}))
        with pytest.raises(DataPrepError, match=said):
            load_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "added_tokens_decoder": {
        "2": {"content": "</s>", **flags, "lstrip": True, "special": True}}}))
    with pytest.raises(DataPrepError, match="gives added token '</s>' {'lstrip': True"):
        load_tokenizer(folder)
    # the config transformers 4 wrote beside its tokenizer.json (every Llama 3 folder's) lists the tokenizer's own
    hf.add_tokens(["<tool>"])
    hf.save(str(folder / "tokenizer.json"))
    decoder = {str(i): {k: getattr(t, k) for k in ("content", *flags)} for i, t in hf.get_added_tokens_decoder().items()}
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "added_tokens_decoder": decoder}))
    assert len(decoder) == 4
    tok, reference = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    text = "call <tool> now\n" + TEXTS["a.txt"]
    assert tok.vocab_size == len(reference) and [tok.bos_id] + tok.encode(text) == reference(text)["input_ids"]
    # a SentencePiece model's config alike
    sp_folder = tmp_path / "sp"
    sp_folder.mkdir()
    write_sentencepiece(sp_folder / "tokenizer.model")
    (sp_folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "added_tokens_decoder": {
        "1": {"content": "<s>", **flags}, "2": {"content": "</s>", **flags}}}))
    assert load_tokenizer(sp_folder).eos_id == 2
    (sp_folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "added_tokens_decoder": {
        "340": {"content": "<tool>", **flags}}}))
    with pytest.raises(DataPrepError, match="lists added token '<tool>' at id 340, where .* holds None"):
        load_tokenizer(sp_folder)


def test_sentencepiece_bos_from_its_tokenizer_config(tmp_path):
    # the config's bos_token, not the model's own BOS, starts each document: the one transformers adds
    from sentencepiece import sentencepiece_model_pb2 as pb
    from transformers import AutoTokenizer
    folder = tmp_path / "sp"
    folder.mkdir()
    proto = pb.ModelProto.FromString(write_sentencepiece(folder / "tokenizer.model").read_bytes())
    proto.pieces.add(piece="<|begin_of_text|>", score=0.0, type=pb.ModelProto.SentencePiece.CONTROL)
    (folder / "tokenizer.model").write_bytes(proto.SerializeToString())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "</s>", "add_bos_token": True, "tokenizer_class": "LlamaTokenizer"}))
    tok = load_tokenizer(folder)
    reference = AutoTokenizer.from_pretrained(folder)
    assert tok.bos_id == reference.bos_token_id == len(proto.pieces) - 1 != 1
    assert reference("def f():")["input_ids"][0] == tok.bos_id
    meta = prepare([write_corpus(tmp_path / "corpus")], tmp_path / "out", tokenizer=folder, num_proc=1)
    assert meta["bos_id"] == tok.bos_id and sorted(decode_documents(tmp_path / "out", tok)) == sorted(TEXTS.values())
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "</s>"}))
    with pytest.raises(DataPrepError, match="names bos_token '<bos>', which"):
        load_tokenizer(folder)


def test_saved_truncation_and_padding_do_not_apply(tmp_path):
    # a tokenizer.json may carry a max_length and padding saved with it; documents are still
    # encoded whole and unpadded, as transformers does unless asked
    folder = write_hf(tmp_path / "hf")
    plain = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    saved = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    saved.enable_truncation(max_length=4)
    saved.enable_padding(length=64)
    saved.save(str(folder / "tokenizer.json"))
    tok = load_tokenizer(folder)
    for text in (TEXTS["a.txt"], "hi"):
        want = plain.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == want and len(want) not in (4, 64)


def test_long_file_pieces_tokenize_as_the_whole_file(tmp_path, monkeypatch):
    # a long file is encoded piece by piece; a piece never starts inside a run of whitespace, so
    # a tokenizer that makes "\n\n" one token gives the whole file's ids
    tok = load_tokenizer(write_tiktoken(tmp_path / "tokenizer.model", merges=LLAMA3_MERGES + [b"\n\n"])[0])
    text = "".join("  indented\n\n\n" if i % 3 == 0 else "the return\n\n" for i in range(300))
    (tmp_path / "long.txt").write_text(text)
    monkeypatch.setattr(data_prep, "DOC_CHARS", 50)
    pieces = list(iter_documents(list_files([tmp_path / "long.txt"])))
    ids = [i for _, _, t, first, _ in pieces for i in (tok.encode(t) if first else tok.encode_rest(t))]
    assert len(pieces) > 20 and "".join(t for _, _, t, _, _ in pieces) == text
    assert all(t[:1] not in " \n" for _, _, t, _, _ in pieces[1:])  # the first is the file's start
    assert ids == tok.encode(text)


def test_tiktoken_slices_end_at_token_boundaries(tmp_path, monkeypatch):
    # Meta's code encodes in slices of 400,000 characters, cut anywhere (a word in two); transformers and
    # vLLM encode the whole text: the slices end where a line that starts with a visible character begins
    tok = load_tokenizer(write_tiktoken(tmp_path / "tokenizer.model")[0])
    text = "".join(f"    the return {i}\n\nthere  return\n" for i in range(200))
    whole = tok.encode(text)
    monkeypatch.setattr(data_prep, "TIKTOKEN_MAX_ENCODE_CHARS", 45)  # slices of one to two lines
    assert tok.encode(text) == whole
    long_line = "the return " * 30  # no line boundary in a slice: cut inside the line, the text still whole
    assert tok.decode(tok.encode(long_line + text)) == long_line + text


def test_uint32_for_a_large_vocabulary(tmp_path):
    path, n = write_tiktoken(tmp_path / "big.model", merges=[], n_pairs=65_400)
    assert n > 65_536 - 256
    (tmp_path / "doc.txt").write_text("hello world\n" * 50)
    meta = prepare([tmp_path / "doc.txt"], tmp_path / "out", tokenizer=path, num_proc=1)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == n + 256 > 65_536 and meta["bos_id"] == n
    ids = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint32)
    assert ids[0] == n > 65_535 and (tmp_path / "out" / "train.bin").stat().st_size == 4 * meta["train_tokens"]
    tok = load_tokenizer(tmp_path / "out")
    train = tok.decode(ids[1:-1].tolist())  # the head, in train; its tail is in val
    val = tok.decode(np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint32)[1:-1].tolist())
    assert train + val == "hello world\n" * 50


def test_fingerprint_tells_equal_sizes_apart(tmp_path):
    a = load_tokenizer(write_sentencepiece(tmp_path / "a.model"))
    b = load_tokenizer(write_sentencepiece(tmp_path / "b.model", text="zebra quartz fjord\n" * 200 + "".join(TEXTS.values())))
    assert a.vocab_size == b.vocab_size and (a.bos_id, a.eos_id) == (b.bos_id, b.eos_id)
    assert a.fingerprint()["sha256"] != b.fingerprint()["sha256"]
    assert tokenizer_mismatch(a.fingerprint(), b.fingerprint()).startswith("sha256 ")
    shutil.copyfile(tmp_path / "a.model", tmp_path / "copy.model")
    assert tokenizer_mismatch(a.fingerprint(), load_tokenizer(tmp_path / "copy.model").fingerprint()) == ""


def test_hf_fingerprint_is_the_tokenizer_not_its_file(tmp_path):
    # the same tokenizer written as older files and save_pretrained write it: merges as "a b"
    # strings, other spacing, without the fields left at their defaults
    original = load_tokenizer(write_hf(tmp_path / "a"))
    d = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    d["model"]["merges"] = [" ".join(m) for m in d["model"]["merges"]]
    d["model"].pop("ignore_merges")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "tokenizer.json").write_text(json.dumps(d, indent=4))
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() != (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert tokenizer_mismatch(original.fingerprint(), load_tokenizer(tmp_path / "b").fingerprint()) == ""
    # a fingerprint written before 2026-12-02 holds the file's hash, which still matches it
    before = {**original.fingerprint(), "sha256": hashlib.sha256((tmp_path / "a" / "tokenizer.json").read_bytes()).hexdigest()}
    del before["file_sha256"]
    assert before["sha256"] != original.fingerprint()["sha256"] and tokenizer_mismatch(before, original.fingerprint()) == ""
    # one merge fewer is another tokenizer
    d["model"]["merges"].pop()
    (tmp_path / "b" / "tokenizer.json").write_text(json.dumps(d))
    assert tokenizer_mismatch(original.fingerprint(), load_tokenizer(tmp_path / "b").fingerprint()).startswith("sha256 ")
    # and so is one whose merges differ only in where a space sits inside them
    fingerprints = []
    for merge in (("a ", "b"), ("a", " b")):
        vocab = {"a": 0, " ": 1, "b": 2, "a ": 3, " b": 4, "a b": 5, "</s>": 6}
        tok = HFTokenizer(models.BPE(vocab, [("a", " "), (" ", "b"), merge]))
        folder = tmp_path / f"space{len(fingerprints)}"
        folder.mkdir()
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
        fingerprints.append(load_tokenizer(folder).fingerprint())
    assert tokenizer_mismatch(*fingerprints).startswith("sha256 ")


def test_unknown_files_are_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("just some text\n")
    (tmp_path / "random.model").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "empty").mkdir()
    for name in ("notes.txt", "random.model"):
        with pytest.raises(DataPrepError, match="is none of a SentencePiece model, a Hugging Face tokenizer.json"):
            load_tokenizer(tmp_path / name)
    with pytest.raises(DataPrepError, match="is JSON but not a Hugging Face tokenizer.json"):
        load_tokenizer(tmp_path / "config.json")
    with pytest.raises(DataPrepError, match="holds neither tokenizer.json nor tokenizer.model"):
        load_tokenizer(tmp_path / "empty")
    with pytest.raises(DataPrepError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere.model")


def test_remove_tokenizer_files_leaves_no_other_tokenizer_beside_one(tmp_path, capsys):
    # an HF tokenizer where an earlier run left another kind: load_tokenizer would read the old files
    # with the new (a tokenizer_config.json) or instead of them (a tokenizer.json before a tokenizer.model)
    out = tmp_path / "run"
    out.mkdir()
    load_tokenizer(write_hf(tmp_path / "hf", {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False},
                            template=False)).save(out)
    sp = load_tokenizer(write_sentencepiece(tmp_path / "sp.model"))
    remove_tokenizer_files(out, keep=sp.save(out))
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.model"]
    assert load_tokenizer(out).fingerprint() == sp.fingerprint() and sp.bos_id == 1
    assert capsys.readouterr().out.count("an earlier run's tokenizer file") == 2
    # a model's own directory given as out_dir keeps its files
    (out / "config.json").write_text("{}")
    remove_tokenizer_files(out, keep=load_tokenizer(tmp_path / "hf").save(out))
    assert {"tokenizer.model", "tokenizer.json"} <= {p.name for p in out.iterdir()}


def test_data_whose_tokenizer_files_changed_is_refused(tmp_path):
    # the trainers copy the data's tokenizer beside every checkpoint and export: it must be the one
    # the data was made with, not one edited since (or read otherwise by a newer nanotune)
    out = tmp_path / "out"
    prepare([write_corpus(tmp_path / "corpus")], out, tokenizer=write_hf(tmp_path / "hf"), num_proc=1)
    assert load_data_meta(out, 8)["bos_id"] == 1
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    with pytest.raises(DataPrepError, match="not read as the tokenizer its data was prepared with .*says add_bos_token False"):
        load_data_meta(out, 8)
    # the config set right, the post-processor taken out: a tokenizer without BOS, unlike the data
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    shutil.copyfile(write_hf(tmp_path / "nobos", template=False) / "tokenizer.json", out / "tokenizer.json")
    with pytest.raises(DataPrepError, match=r"prepared with \(.*bos_id 1 vs None|bos_id None vs 1"):
        load_data_meta(out, 8)
