"""
Tokenize a text corpus into the token memmaps the nanotune training scripts read.

    # default corpus, offline on any machine: the .py files of this Python's standard library
    python data_prep.py                                    # -> data/stdlib, BPE tokenizer of 4096

    # a folder of text (searched recursively for .txt .md .py ... and .jsonl/.json record files)
    python data_prep.py --input ~/notes --out_dir data/notes --vocab_size 8192

    # the tokenizer of a model: a SentencePiece .model (Llama 2), a Hugging Face tokenizer.json or
    # model folder (tokenizer.json + tokenizer_config.json), or Meta's Llama 3 tokenizer.model (tiktoken)
    python data_prep.py --input books/ --out_dir data/books --tokenizer Meta-Llama-3.1-8B/

    # fine-tuning data: one {"prompt": ..., "response": ...} per JSON line (or a JSON array of them),
    # packed whole into rows of block_size tokens
    python data_prep.py --input sft.jsonl --out_dir data/sft --tokenizer Llama-3.2-1B/ --block_size 2048

Records (.jsonl, or .json holding an array of records or JSON lines; a .json is never read as
text): {"text": ...} is a document, {"prompt": ..., "response": ...} a fine-tuning sample. Other keys
beside these (id, url, ...) are ignored; a record with both shapes or neither is refused.

Plain text (no prompt/response anywhere in the input) is one flat stream per split, each document
as BOS, its tokens, EOS (no BOS if the tokenizer has none). A document cut by the split (below)
becomes two, its head in train and its tail in val, each with its BOS and EOS.

Packed (some input has prompt/response; --block_size N required): every record is a sample, BOS
prompt response EOS, packed whole and in order into rows of exactly N tokens, padded with eos_id.
A sample over N tokens is truncated (keeps the prompt and the head of the response, no EOS) or
skipped (--long_samples); one whose prompt alone fills N tokens is always skipped, as it leaves
nothing to train. Row r starts at token r*N, and one extra eos_id ends each file, so a
trainer reads window w as tokens[w*N : w*N+N+1]: the target of a row's last token is the next
row's first token, which is a sample's first token and never trained (mask 0).

What ends up in out_dir:

    train.bin, val.bin              token ids: np.uint16, or np.uint32 for vocabularies over 65536
    train_mask.bin, val_mask.bin    packed only, np.uint8 per token: 1 = train on it as a target (the
                                    response and its EOS), 0 = prompt, BOS, padding, each sample's first token
    train_pos.bin, val_pos.bin      packed only, the token's position in its sample (0 at its first
                                    token; padding is a sample of its own): np.uint16, or uint32 if N > 65536
    tokenizer.model | tokenizer.json (+ tokenizer_config.json, special_tokens_map.json)
                                    a copy of the tokenizer that made the ids
    meta.json                       vocab_size, dtype, bos_id, eos_id, tokenizer fingerprint, counts, split
                                    shares, and sha256 + size of every .bin file (hashed while written)

    meta = json.load(open(os.path.join(out_dir, "meta.json")))
    data = np.memmap(os.path.join(out_dir, "train.bin"), dtype=meta["dtype"], mode="r")

The split aims at val_fraction of the characters, whatever the corpus looks like. Let T be the
characters of the whole input. A plain-text document longer than val_fraction * T / 4, whose last
val_fraction is at least MIN_TAIL_CHARS, is large: that tail (cut at a line boundary) goes to val and
its head to train, so large documents give exactly their share (one big input.txt is split as
nanoGPT splits Shakespeare). Every other document, and every fine-tuning sample, stays whole: taken
in the order of a hash of its name (path in the input folder, plus record number), each goes to val
while the val characters of these documents stay within val_fraction of theirs. When that reaches
less than half of their share (too few documents, e.g. a single small file), the largest plain one
is cut for the rest. Val so gets between half and all of what was asked, in characters (about that
in tokens). Known bias: a document that would pass the goal is skipped for later ones that fit, so
val's whole documents run shorter than train's (0.67-0.69 of the mean length over 50 lognormal corpora
of 400-1000 samples at 1-2%; 0.91-0.98 with 2,000-5,000). Every figure in the README was measured on
this split, so it stays until they are measured again on an unbiased one. Only fine-tuning samples
too few or too big to split finely (say three at 1%) can miss:
val still gets one and train keeps the rest, and a warning is printed. The split is a pure function
of the input, so reruns give the same one; meta.json keeps the shares.

Outputs are built in a temporary folder next to out_dir and moved in at the end (meta.json last),
so a failed run never leaves a half-written out_dir, and an existing one is replaced only then.
"""

import argparse
import base64
import binascii
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
from array import array

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

# files a folder input is searched for; a file named directly is read whatever its extension
TEXT_EXTENSIONS = (".txt", ".md", ".rst", ".tex", ".py", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu",
                   ".rs", ".go", ".java", ".js", ".ts", ".sh", ".html", ".css", ".toml",
                   ".yaml", ".yml", ".cfg", ".ini")
RECORD_EXTENSIONS = (".jsonl", ".json")  # parsed as records, never read as text
# the default corpus leaves out the stdlib's tests (a third of it, and repetitive) and anything installed
STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
# longer text files are read in pieces of about this many characters, so encoding one stays small
DOC_CHARS = 1 << 22
# the tokenizer trains on a deterministic sample of at most about this many characters of the input
SAMPLE_CHARS = 16 << 20
# documents go to the encoding workers in chunks of about this many characters
CHUNK_CHARS = 1 << 20
# a document is cut for the split only if its val tail would be this long: shorter tails would be
# mostly BOS and EOS
MIN_TAIL_CHARS = 1000
# every name a tokenizer can have in out_dir: an older run's are removed, so one never shadows another
# a chat template lives in tokenizer_config.json, or since transformers 4.4x in a file of its own
CHAT_TEMPLATE_NAMES = ("chat_template.jinja", "chat_template.json")
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model") + CHAT_TEMPLATE_NAMES
BIN_NAMES = tuple(f"{s}{k}.bin" for s in ("train", "val") for k in ("", "_mask", "_pos"))
# the keys that identify a tokenizer; two fingerprints agree when these do
FINGERPRINT_KEYS = ("kind", "sha256", "bos_id", "eos_id", "vocab_size")


class DataPrepError(ValueError):
    """A mistake in the inputs or settings; main() prints it as one line, without a traceback."""


# ----------------------------------------------------------------------------- tokenizers

# Meta's Llama 3 tokenizer.py: its pre-tokenizer regex, and 256 special tokens numbered after the
# 128,000 base ones (every Llama 3, 3.1, 3.2 and 3.3 tokenizer.model)
LLAMA3_PIECES = 128_000
# Meta's tokenizer.model of Llama 3, 3.1, 3.2 and 3.3, one file (2,183,982 bytes)
LLAMA3_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
LLAMA3_SPECIALS += [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(LLAMA3_SPECIALS))]
# as Meta's tokenizer.py: tiktoken slows down badly on long inputs and on long runs of (non-)whitespace
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000


class Tokenizer:
    """A tokenizer of any supported library: encode(text) -> ids (no specials), decode(ids) -> text.

    kind is 'sentencepiece', 'hf' or 'tiktoken'; files are the paths that define it (the first is
    the vocabulary itself); bos_id is None when the tokenizer puts no BOS before a text."""

    def __init__(self, kind, files, vocab_size, bos_id, eos_id, encode, decode, specials=(), sha256=None):
        self.kind, self.files, self.vocab_size = kind, files, vocab_size
        self._sha256 = sha256  # the fingerprint's hash, where not the vocabulary file's own
        self.bos_id, self.eos_id = bos_id, eos_id
        self.encode, self.decode = encode, decode
        # the special tokens' strings, which encode() reads as plain text where a text holds them
        self.specials = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True)))) if specials else None
        # a tokenizer that puts a space in front of every text it encodes (SentencePiece's dummy
        # prefix: Llama 2, Mistral; ByteLevel's add_prefix_space) would put one inside a document at
        # each piece boundary too. The ids a newline takes before text are what "\na" and "\nb" begin
        # with alike ("\n" encoded alone may differ: " \n" can be one token where " ", "\n", "a" are three)
        probes = [encode("\n" + c) for c in "ab"]
        n = next((i for i, (x, y) in enumerate(zip(*probes)) if x != y), min(map(len, probes)))
        self._after_newline = probes[0][:n]
        self.prefixes = any(encode(c) != probe[n:] for c, probe in zip("ab", probes))

    def encode_rest(self, text):
        """encode(text) for a piece that continues a document just after a newline, as it
        tokenizes within the whole document: no space in front even where encode adds one."""
        if not self.prefixes:
            return self.encode(text)
        ids = self.encode("\n" + text)
        if ids[:len(self._after_newline)] != self._after_newline or not self.decode(self._after_newline).endswith("\n"):
            # the newline merged into the text (in this text, or in "\na" and "\nb" alike)
            raise DataPrepError(f"the tokenizer {self.files[0]} joins a newline with the text after it, so a long file "
                                f"cannot be encoded in pieces; split it into files under {DOC_CHARS:,} characters")
        return ids[len(self._after_newline):]

    def fingerprint(self):
        with open(self.files[0], "rb") as f:
            file_sha256 = hashlib.sha256(f.read()).hexdigest()
        sha256 = self._sha256 or file_sha256
        fp = dict(kind=self.kind, sha256=sha256, bos_id=self.bos_id, eos_id=self.eos_id, vocab_size=self.vocab_size)
        # the file's own hash too, which fingerprints written before 2026-12-02 hold as their sha256
        return fp if sha256 == file_sha256 else {**fp, "file_sha256": file_sha256}

    def save(self, out_dir):
        """Copy the defining files into out_dir under the names load_tokenizer(out_dir) finds; returns them."""
        names = ["tokenizer.json" if self.kind == "hf" else "tokenizer.model"]
        names += [os.path.basename(p) for p in self.files[1:]]
        for src, name in zip(self.files, names):
            shutil.copyfile(src, os.path.join(out_dir, name))
        return names


def remove_tokenizer_files(out_dir, keep=()):
    """Removes the tokenizer files in out_dir but `keep`: an earlier run's, of another tokenizer (or of
    one when this run's data has none), which load_tokenizer(out_dir) would read with or instead of this run's.
    A model's own directory (an HF or Meta one given as out_dir) keeps its files."""
    if any(os.path.isfile(os.path.join(out_dir, n)) for n in ("config.json", "params.json")):
        return
    for name in TOKENIZER_NAMES:
        if name not in keep and os.path.lexists(path := os.path.join(out_dir, name)):
            os.remove(path)
            print(f"removed {path}: an earlier run's tokenizer file, not this run's data's")


def tokenizer_mismatch(a, b):
    """'' when the fingerprints a and b (dicts such as meta.json's "tokenizer") agree, else what differs.
    Their hashes agree when any of each one's (the tokenizer's, the file's) match."""
    hashes = [{f.get("sha256"), f.get("file_sha256")} - {None} for f in (a, b)]
    return ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in FINGERPRINT_KEYS
                     if (not hashes[0] & hashes[1] if k == "sha256" else a.get(k) != b.get(k)))


def load_data_meta(data_dir, block_size):
    """The meta.json of prepared data, once its splits are known to exist and `block_size` (the
    training window) to fit it. Raises DataPrepError."""
    for name in ("train.bin", "val.bin", "meta.json"):
        if not os.path.exists(os.path.join(data_dir, name)):
            raise DataPrepError(f"{os.path.join(data_dir, name)} is missing; run data_prep.py --out_dir {data_dir} first")
    with open(os.path.join(data_dir, "meta.json")) as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as e:
            raise DataPrepError(f"{os.path.join(data_dir, 'meta.json')} is not JSON ({e}); run data_prep.py --out_dir "
                                f"{data_dir} again") from None
    for name, d in (meta.get("data") or {}).items():  # files that are not the ones meta.json describes
        size = os.path.getsize(p) if os.path.exists(p := os.path.join(data_dir, name)) else None
        if size != d["bytes"]:
            raise DataPrepError(f"{p} is {'missing' if size is None else f'{size:,} bytes'} where {data_dir}/meta.json "
                                f"says {d['bytes']:,} bytes: the data was changed or copied in part; run data_prep.py "
                                f"--out_dir {data_dir} again")
    if not meta.get("data"):  # data made by hand records no fingerprints: its files' sizes stand for them in
        # what a resume, a top-k store and the other nodes compare (a file rewritten at its size passes, as hashes would not)
        meta["data"] = {name: {"bytes": os.path.getsize(os.path.join(data_dir, name))}
                        for name in sorted(os.listdir(data_dir)) if name.endswith(".bin")}
    if meta.get("packed") and block_size != meta["block_size"]:  # SFT samples packed whole into rows
        raise DataPrepError(f"{data_dir} holds samples packed into rows of {meta['block_size']} tokens; "
                            f"set block_size={meta['block_size']}")
    # the tokenizer files beside the data, which the trainers copy beside every checkpoint and export,
    # are the tokenizer the data was made with (not edited since, nor read otherwise by this version)
    if (fp := meta.get("tokenizer")) and fp.get("files"):
        try:
            diff = tokenizer_mismatch(load_tokenizer(data_dir).fingerprint(), fp)
        except DataPrepError as e:
            diff = str(e)
        if diff:
            raise DataPrepError(f"the tokenizer files in {data_dir} are not read as the tokenizer its data was prepared "
                                f"with ({diff}); prepare the data again with data_prep.py")
    return meta


def load_topk_store(store_dir, data_meta, block_size, temperature):
    """The meta.json of a teacher top-k store (kd_train.py's topk_write) fit to train on: complete,
    and written from this data (its files and tokenizer) at this block_size and temperature, so
    that its rows are the targets of these windows. Raises DataPrepError."""
    path, write = os.path.join(store_dir, "meta.json"), "write a store for this data with topk_write=True"
    if not os.path.exists(path):
        raise DataPrepError(f"teacher_topk_dir={store_dir!r} holds no store (no meta.json); write one with topk_write=True")
    with open(path) as f:
        meta = json.load(f)
    tokenizer = data_meta.get("tokenizer")
    # by fingerprint: the files listed beside it (a chat template) do not make another tokenizer
    tok_diff = (tokenizer_mismatch(meta["tokenizer"], tokenizer) if meta["tokenizer"] and tokenizer
                else "one has none" if meta["tokenizer"] != tokenizer else "")
    rows = meta["n_windows"] * meta["block_size"]
    sizes = {"ids.bin": rows * meta["k"] * np.dtype(meta["ids_dtype"]).itemsize, "logprobs.bin": rows * meta["k"] * 2,
             **({"rest.bin": rows * 4} if meta.get("rest") else {})}  # the rest's log-mass: stores from 2026-12-06 on
    unlike = [name for name, size in sizes.items()
              if not os.path.isfile(p := os.path.join(store_dir, name)) or os.path.getsize(p) != size]
    problems = [
        (not meta["complete"], f"is incomplete ({meta['windows_done']} of {meta['n_windows']} windows); finish it by "
                               f"rerunning its topk_write=True command"),
        # (a store from before hand-made data's sizes were recorded has none: its windows are counted below)
        (meta["data"] is not None and meta["data"] != data_meta["data"], f"was written from other data (its files differ); {write}"),
        (tok_diff, f"was written with another tokenizer than the data ({tok_diff}); {write}"),
        (meta["vocab_size"] != data_meta["vocab_size"],
         f"has a vocabulary of {meta['vocab_size']} tokens, the data {data_meta['vocab_size']}; {write}"),
        (meta["block_size"] != block_size, f"holds windows of block_size={meta['block_size']}; set block_size to it"),
        (unlike, f"has {' and '.join(unlike)} missing or of another size than its meta.json says; {write}"),
        (meta["temperature"] != temperature,
         f"holds the teacher at temperature {meta['temperature']}, not kd_temperature={temperature} (the tail of a "
         f"top-k store cannot be re-tempered); set kd_temperature to it or write a store at this temperature"),
    ]
    for bad, message in problems:
        if bad:
            raise DataPrepError(f"the store in {store_dir} {message}")
    return meta


def load_tokenizer(path):
    """The Tokenizer at path: a SentencePiece model, an HF tokenizer.json, a Meta Llama 3 tiktoken
    tokenizer.model (told apart by content), or a folder holding tokenizer.json or tokenizer.model."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model"):
            if os.path.isfile(os.path.join(path, name)):
                return load_tokenizer(os.path.join(path, name))
        raise DataPrepError(f"tokenizer folder {path} holds neither tokenizer.json nor tokenizer.model; "
                            f"give the tokenizer file itself")
    if not os.path.isfile(path):
        raise DataPrepError(f"tokenizer {path} does not exist")
    with open(path, "rb") as f:
        data = f.read()
    if data.lstrip()[:1] == b"{":
        return _hf_tokenizer(path, data)
    if (ranks := _tiktoken_ranks(data)) is not None:
        return _tiktoken_tokenizer(path, ranks, hashlib.sha256(data).hexdigest())
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(data)
    except RuntimeError:
        raise DataPrepError(f"tokenizer {path} is none of a SentencePiece model, a Hugging Face tokenizer.json "
                            f"or a Llama 3 tiktoken tokenizer.model") from None
    # a transformers folder's tokenizer_config.json may say otherwise than the model's own ids, and
    # transformers follows it: the data must hold the BOS and EOS that its tokenizer adds
    extras, config = _tokenizer_config(path)
    _check_added_tokens(config, path, lambda i: sp.id_to_piece(i) if 0 <= i < sp.vocab_size() else None, None)
    ids = {"bos": sp.bos_id(), "eos": sp.eos_id()}
    for key in ids:
        if (name := config.get(f"{key}_token")) is not None:
            name = name.get("content") if isinstance(name, dict) else name
            ids[key] = sp.piece_to_id(name)
            if sp.id_to_piece(ids[key]) != name:
                raise DataPrepError(f"{extras[0]} names {key}_token {name!r}, which {path} does not have")
    bos_id = ids["bos"] if ids["bos"] >= 0 and config.get("add_bos_token", True) else None
    eos_id = ids["eos"] if ids["eos"] >= 0 else None
    if specials := [(key, i) for key, i in (("bos", bos_id), ("eos", eos_id)) if i is not None and not sp.is_control(i)]:
        # SentencePiece matches a user-defined piece in text: "<|im_end|>" written in a document would
        # end it. Made a control piece here (its id stays), it is text, as every special's string is
        from sentencepiece import sentencepiece_model_pb2 as pb  # protobuf (requirements.txt)
        proto = pb.ModelProto.FromString(data)
        for key, i in specials:
            if proto.pieces[i].type != pb.ModelProto.SentencePiece.USER_DEFINED:  # <unk>, a byte, a piece of words
                where = {"bos": "start", "eos": "end"}[key]
                raise DataPrepError(f"{extras[0] if extras else path} names {key}_token {sp.id_to_piece(i)!r}, which "
                                    f"{path} holds as a piece of ordinary text (neither a control nor a user-defined "
                                    f"piece), so a document would {where} wherever text is cut into it; name the "
                                    f"model's {where}-of-text piece")
            proto.pieces[i].type = pb.ModelProto.SentencePiece.CONTROL
        sp = spm.SentencePieceProcessor()
        sp.LoadFromSerializedProto(proto.SerializeToString())
    controls = [sp.id_to_piece(i) for i in range(sp.vocab_size()) if sp.is_control(i)]
    return Tokenizer("sentencepiece", [path] + extras, sp.vocab_size(), bos_id, eos_id, sp.encode, sp.decode, controls)


def _tokenizer_config(path):
    """(files, settings) of the tokenizer_config.json and special_tokens_map.json beside the
    tokenizer file at path, the first winning where both set something, as in transformers; the
    files also name a chat template file there, which travels with the tokenizer into exports."""
    folder = os.path.dirname(path)
    extras = [p for p in (os.path.join(folder, n) for n in ("tokenizer_config.json", "special_tokens_map.json"))
              if os.path.isfile(p)]
    config, said = {}, []
    for p in reversed(extras):
        with open(p, encoding="utf-8") as f:
            said.append({k: v for k, v in json.load(f).items() if v is not None})
        config.update(said[-1])
    # transformers lets either file win, by version and by what else the config holds: they must agree
    def content(v):
        return v.get("content") if isinstance(v, dict) else v
    for key in ("bos_token", "eos_token") if len(said) == 2 else ():
        if key in said[0] and key in said[1] and content(said[0][key]) != content(said[1][key]):
            raise DataPrepError(f"{extras[0]} names {key} {content(said[1][key])!r}, {extras[1]} {content(said[0][key])!r}, "
                                f"which transformers versions read differently; make them agree")
    return extras + [p for p in (os.path.join(folder, n) for n in CHAT_TEMPLATE_NAMES) if os.path.isfile(p)], config


def _check_added_tokens(config, path, token_at, added):
    """Refuses a tokenizer_config.json whose added_tokens_decoder says other than the tokenizer at path:
    transformers adds each of its tokens on load (a new id, matched whole in text, with the config's
    lstrip and rstrip), so the deployed model would read ids or splits the data never held.
    token_at(id): the tokenizer's token there or None; added: its own added tokens by id (None: SentencePiece)."""
    folder = os.path.dirname(path) or "."
    for i, want in sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
        i, content = int(i), want.get("content")
        if token_at(i) != content:
            raise DataPrepError(f"{folder}/tokenizer_config.json lists added token {content!r} at id {i}, where {path} holds "
                                f"{token_at(i)!r}: transformers adds it on load, so the model would be given ids its "
                                f"training data never held; save the tokenizer again with transformers (save_pretrained "
                                f"writes its added tokens into tokenizer.json), or drop the entry from the config")
        if added is None:  # SentencePiece: its own control and user-defined pieces, as transformers reads them
            continue
        if (have := added.get(i)) is None:
            raise DataPrepError(f"{folder}/tokenizer_config.json lists {content!r} (id {i}) as an added token, which {path} "
                                f"holds as an ordinary entry of its vocabulary: transformers would match it whole in text, "
                                f"where the data split it as any text; list it in the file's added_tokens too, or drop "
                                f"the entry from the config")
        flags = {k: want[k] for k in ("lstrip", "rstrip", "single_word") if k in want}
        if flags != (own := {k: getattr(have, k) for k in flags}):
            raise DataPrepError(f"{folder}/tokenizer_config.json gives added token {content!r} {flags}, {path} "
                                f"{own}: transformers takes the config's, which split "
                                f"the text around it otherwise than the data was; make them agree")


def _hf_tokenizer(path, data):
    from tokenizers import AddedToken, Tokenizer as HFTokenizer
    try:
        tok = HFTokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception for a JSON it cannot read
        raise DataPrepError(f"tokenizer {path} is JSON but not a Hugging Face tokenizer.json ({e})") from None
    # the fingerprint hashes what the tokenizer is, not how its file was written: save_pretrained
    # and newer tokenizers versions write the same tokenizer with other spacing, default fields
    # spelled out and merges as pairs, which a hash of the file would tell apart from the original.
    # to_str() writes it again in this tokenizers' own way (merges as pairs from 0.20 on)
    canonical = json.loads(tok.to_str())
    for key in ("version", "truncation", "padding"):
        canonical.pop(key, None)
    sha256 = hashlib.sha256(json.dumps(canonical, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()
    tok.encode_special_tokens = True  # "</s>" written in a text is text, not an EOS
    tok.no_truncation()  # a tokenizer.json may carry a saved max_length or padding: documents are never cut or padded
    tok.no_padding()
    extras, config = _tokenizer_config(path)
    _check_added_tokens(config, path, tok.id_to_token, tok.get_added_tokens_decoder())

    def special_id(field):
        token = config.get(field)
        token = token.get("content") if isinstance(token, dict) else token
        if token is None:
            return None
        if (i := tok.token_to_id(token)) is None:
            raise DataPrepError(f"{extras[0]} names {field} {token!r}, which {path} does not have")
        return i

    bos_id, eos_id = special_id("bos_token"), special_id("eos_token")
    # what the post-processor puts around a text, as transformers' encode does too
    ids, text_ids = tok.encode("a").ids, tok.encode("a", add_special_tokens=False).ids
    at = next((k for k in range(len(ids) - len(text_ids) + 1) if ids[k:k + len(text_ids)] == text_ids), None)
    before, after = (ids, []) if at is None else (ids[:at], ids[at + len(text_ids):])
    if bos_id is None and len(before) == 1:
        bos_id = before[0]  # the post-processor puts a BOS before every text, though no config names it: as transformers does
    if eos_id is None:
        raise DataPrepError(f"tokenizer {path} has no eos_token: put the tokenizer_config.json (or "
                            f"special_tokens_map.json) that names it beside it")
    # the data holds each document as [BOS] text EOS: whatever else the post-processor adds, transformers
    # would put into every prompt and training never saw
    if at is None or before not in ([], [bos_id]) or after not in ([], [eos_id]):
        names = lambda t: [tok.id_to_token(i) for i in t]  # noqa: E731
        raise DataPrepError(f"tokenizer {path}'s post-processor puts {names(before)} before a text and {names(after)} "
                            f"after it, where the data would hold each document as {names([bos_id] * (bos_id is not None))} "
                            f"text {names([eos_id])} (the bos_token and eos_token its config names): transformers would "
                            f"encode prompts otherwise than training saw them; make the post-processor add at most that "
                            f"BOS before a text and that EOS after it, or name the BOS it adds as bos_token")
    # an added token not marked special is matched in text even so: a BOS or EOS of that kind would
    # turn "</s>" written in a document into the end of one. Marked special here (its id stays), it is text
    added = {t.content: t for t in tok.get_added_tokens_decoder().values()}
    tok.add_special_tokens([AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                                       normalized=t.normalized, special=True)
                            for t in (added.get(tok.id_to_token(i)) for i in {bos_id, eos_id} - {None}) if t and not t.special])
    # the post-processor decides whether a text starts with BOS, as in transformers 5 (and 4's
    # PreTrainedTokenizerFast, Llama 3's class); 4's LlamaTokenizerFast rebuilds it from add_bos_token
    # instead, so a config that says otherwise would train and deploy with different BOS
    add_bos = bos_id is not None and before == [bos_id]
    if config.get("add_bos_token", add_bos) != add_bos:
        raise DataPrepError(f"{os.path.dirname(path) or '.'}/tokenizer_config.json says add_bos_token "
                            f"{config['add_bos_token']}, yet {path}'s post-processor puts {'a' if add_bos else 'no'} BOS "
                            f"before a text; transformers 5 follows the post-processor, transformers 4's LlamaTokenizerFast "
                            f"the config: set add_bos_token to {str(add_bos).lower()} there so that both agree")
    # a BOS or EOS that is an ordinary entry of the vocabulary, not an added token, is what the model
    # makes of its string in text: a document would end wherever it holds "</s>"
    for key, i in (("bos", bos_id if add_bos else None), ("eos", eos_id)):
        if i is not None and i in tok.encode(tok.id_to_token(i), add_special_tokens=False).ids:
            raise DataPrepError(f"{path} holds {key}_token {tok.id_to_token(i)!r} as an ordinary entry of its vocabulary, "
                                f"not an added special token, so a document would {'start' if key == 'bos' else 'end'} "
                                f"wherever its text holds that string; list it in the file's added_tokens with special: true")
    return Tokenizer("hf", [path] + extras, max(tok.get_vocab(with_added_tokens=True).values()) + 1,
                     bos_id if add_bos else None, eos_id,
                     lambda text: tok.encode(text, add_special_tokens=False).ids,
                     lambda ids: tok.decode(list(ids), skip_special_tokens=False),
                     [t.content for t in tok.get_added_tokens_decoder().values() if t.special], sha256)


def _tiktoken_ranks(data):
    """{token bytes: rank} if data is a tiktoken BPE file (lines of "base64 rank"), else None."""
    ranks = {}
    try:
        for line in data.splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, binascii.Error):
        return None
    return ranks or None


_warned_tiktoken = set()  # paths already warned about: a script loads its tokenizer more than once


def _tiktoken_tokenizer(path, ranks, sha256):
    import tiktoken
    n = len(ranks)
    if n != LLAMA3_PIECES:  # Llama 4's and OpenAI's files are tiktoken files too, with other specials and splits
        raise DataPrepError(f"tokenizer {path} is a tiktoken file of {n:,} tokens, which is read as Meta's Llama 3 "
                            f"tokenizer.model only with Llama 3's {LLAMA3_PIECES:,} (its special tokens and split "
                            f"pattern are Llama 3's); give the model's Hugging Face tokenizer.json instead")
    if sorted(ranks.values()) != list(range(n)):
        raise DataPrepError(f"tokenizer {path} is a tiktoken file whose ranks are not 0..{n - 1}, so Llama 3's "
                            f"special tokens (numbered from {n}) would collide with them")
    if sha256 != LLAMA3_SHA256 and path not in _warned_tiktoken:  # another file of Llama 3's size: its specials and split may differ
        _warned_tiktoken.add(path)
        print(f"warning: tokenizer {path} is a tiktoken file of {n:,} tokens but not Meta's Llama 3 tokenizer.model "
              f"(sha256 {sha256[:12]}…, not {LLAMA3_SHA256[:12]}…); it is read with Llama 3's special tokens and split "
              f"pattern", file=sys.stderr)
    specials = {t: n + i for i, t in enumerate(LLAMA3_SPECIALS)}
    enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=LLAMA3_SPLIT, mergeable_ranks=ranks,
                            special_tokens=specials)

    def encode(text):
        ids, start = [], 0
        while start < len(text):
            # in slices as Meta's code, each ending where a line that starts with a visible character
            # begins (a token boundary of Llama 3's split), so that they encode as transformers and vLLM
            # encode the whole; cut anywhere only inside one such line
            end = start + TIKTOKEN_MAX_ENCODE_CHARS
            if end < len(text):
                cut = end
                while (cut := text.rfind("\n", start, cut)) >= 0 and text[cut + 1].isspace():
                    pass
                end = cut + 1 if cut >= 0 else end
            for part in _split_long_runs(text[start:end]):
                ids += enc.encode(part, allowed_special=set(), disallowed_special=())  # specials in text are text
            start = end
        return ids

    return Tokenizer("tiktoken", [path], n + len(specials), specials["<|begin_of_text|>"],
                     specials["<|end_of_text|>"], encode, lambda ids: enc.decode(list(ids)), list(specials))


def _split_long_runs(s, limit=MAX_NO_WHITESPACES_CHARS):
    """s cut so that no part holds more than limit whitespace or non-whitespace characters in a row."""
    if not re.search(rf"\s{{{limit + 1}}}|\S{{{limit + 1}}}", s):
        yield s
        return
    start, run, space = 0, 0, s[:1].isspace()
    for i, c in enumerate(s):
        if c.isspace() != space:
            run, space = 1, not space
        else:
            run += 1
            if run > limit:
                yield s[start:i]
                start, run = i, 1
    yield s[start:]


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
            byte_fallback=True,  # any byte encodes, so no <unk>; every text decodes back exactly but "\u2581" (a space)
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


def dtype_for_vocab(vocab_size):
    """The smallest unsigned dtype that holds every token id below vocab_size."""
    if vocab_size <= 2**16:
        return np.uint16
    if vocab_size <= 2**32:
        return np.uint32
    raise DataPrepError(f"a vocabulary of {vocab_size} pieces does not fit in uint32 token ids; "
                        f"use a tokenizer with at most 2**32 pieces")


# ----------------------------------------------------------------------------- reading the input

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


def list_files(inputs, left_out=None):
    """(path, key) for every file to read; the key names a file independently of where the input lives.
    Files of a folder that are not of a text or record extension are appended to left_out."""
    files, seen = [], {}
    for inp in map(os.fspath, inputs):
        if not os.path.exists(inp):
            raise DataPrepError(f"--input {inp} does not exist")
        if not os.path.isdir(inp):
            found = [(inp, os.path.basename(inp))]
        else:
            found, walked = [], set()
            def unreadable(e):  # os.walk leaves out a folder it cannot list, and all below it, without a word
                raise DataPrepError(f"cannot read folder {e.filename}: {e.strerror}")
            for dirpath, dirnames, filenames in os.walk(inp, onerror=unreadable, followlinks=True):  # a linked folder is read too
                walked.add(os.path.realpath(dirpath))
                # hidden folders (.git, .venv) and caches are not text anyone meant to train on; a link back
                # to a folder already walked (its parent, say) would never end
                dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__"
                                     and os.path.realpath(os.path.join(dirpath, d)) not in walked)
                for name in sorted(filenames):
                    ext = os.path.splitext(name)[1].lower()
                    path = os.path.join(dirpath, name)
                    if not name.startswith(".") and ext in TEXT_EXTENSIONS + RECORD_EXTENSIONS:
                        found.append((path, os.path.relpath(path, inp).replace(os.sep, "/")))
                    elif not name.startswith(".") and left_out is not None:
                        left_out.append(path)
        for path, key in found:
            # a file read twice is split twice, by two keys: one copy could land in val, the other in train.
            # Within a folder it is a link to a file beside it (README.md -> docs/index.md): read once. A file
            # is known by its device and inode, which a symbolic link and a hard link share
            st = os.stat(path)
            if (ident := (st.st_dev, st.st_ino)) in seen and seen[ident][1] != inp:
                raise DataPrepError(f"--input reaches {os.path.realpath(path)} twice (as {seen[ident][0]} and {path}); its "
                                    f"copies would be split apart, val leaking into train: give each file once")
            if ident not in seen:
                seen[ident] = path, inp
                files.append((path, key))
    return files


def first_few(paths, n=3):
    """The first n paths, for a message about all of them."""
    return ", ".join(paths[:n]) + (", ..." if len(paths) > n else "")


def iter_documents(files, skipped=None, undecodable=None, empty=None):
    """Yield (key, prompt, text, first, last) per piece of each document of the (path, key) files.

    prompt is None for plain text. A text file is one document, read in pieces of about DOC_CHARS
    characters cut at line boundaries before a visible character; first and last say whether a
    piece starts or ends its document.
    Binaries (NUL bytes near the start) are skipped and appended to skipped; a text file that is
    not UTF-8 is appended to undecodable, or raises DataPrepError without it. A UTF-8 byte order
    mark starting a file is not text: left out. A record with nothing to train on (its text, or its
    prompt and response, empty) is left out and named in empty.
    """
    for path, key in files:
        if path.lower().endswith(RECORD_EXTENSIONS):
            for k, prompt, text in _record_documents(path, key, empty if empty is not None else []):
                yield k, prompt, text, True, True
        else:
            yield from _text_documents(path, key, skipped if skipped is not None else [], undecodable)


def _text_documents(path, key, skipped, undecodable):
    # newline="" keeps the text byte for byte, so decoding the tokens gives back the file
    try:
        with open(path, "rb") as f:
            binary = b"\x00" in f.read(1 << 16)
        if binary:
            skipped.append(path)
            return
        f = open(path, encoding="utf-8-sig", newline="")
        text = f.read(DOC_CHARS)
    except OSError as e:
        raise DataPrepError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        f.close()
        if undecodable is None:
            raise DataPrepError(f"{path} is not UTF-8 text; convert it (iconv -t UTF-8) or remove it from --input") from None
        undecodable.append(path)
        return
    with f:
        if "\x00" in text:
            skipped.append(path)
            return
        i = 0
        while text:
            try:
                # end the piece at a line boundary, before a line that starts with a visible character:
                # whitespace runs across lines ("\n\n", "\n    " in GPT-2's split) are single tokens
                # of some tokenizers, and must not straddle two pieces (a run of indented or blank
                # lines past DOC_CHARS is cut anyway)
                text += f.readline()
                line = f.readline()
                while line[:1].isspace() and len(text) < 2 * DOC_CHARS:
                    text, line = text + line, f.readline()
                next_text = line + f.read(DOC_CHARS)
            except UnicodeDecodeError:
                # its start was text, so this is a damaged file rather than a binary: say so
                raise DataPrepError(f"{path} is not valid UTF-8 after its first {DOC_CHARS * i:,} characters; "
                                    f"fix its encoding or remove it from --input") from None
            yield key, None, text, i == 0, not next_text
            text, i = next_text, i + 1


SURROGATE = re.compile("[\ud800-\udfff]")


def _record_documents(path, key, empty):
    """(key, prompt, text) per record of a .jsonl file, or of a .json file (one array, or JSON lines)."""
    try:
        with open(path, "rb") as f:  # bytes, so a decode error can name its line
            data = f.read().removeprefix(b"\xef\xbb\xbf")  # a byte order mark is not a record
    except OSError as e:
        raise DataPrepError(f"cannot read {path}: {e.strerror}") from None
    if path.lower().endswith(".json") and data.lstrip()[:1] == b"[":
        try:
            records = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataPrepError(f"{path} starts like a JSON array of records but does not parse ({e}); fix it") from None
        numbered = ((f"{path} record {i}", i, r) for i, r in enumerate(records, 1))
    else:
        numbered = ((f"{path} line {i}", i, line) for i, line in enumerate(data.splitlines(), 1) if line.strip())
    for where, i, record in numbered:
        if isinstance(record, bytes):
            try:
                record = json.loads(record)
            except UnicodeDecodeError:  # a ValueError too, so it comes first
                raise DataPrepError(f"{where} is not valid UTF-8") from None
            except json.JSONDecodeError as e:
                what = "is neither a JSON array of records nor JSON lines" if path.lower().endswith(".json") \
                    else "is malformed JSON"
                raise DataPrepError(f"{where} {what} ({e.msg}, column {e.colno})") from None
        keys = record.keys() if isinstance(record, dict) else ()
        text = isinstance(record, dict) and isinstance(record.get("text"), str)
        pair = isinstance(record, dict) and all(isinstance(record.get(k), str) for k in ("prompt", "response"))
        if text == pair or "text" in keys and keys & {"prompt", "response"}:
            raise DataPrepError(f'{where} has {"keys " + ", ".join(sorted(keys)) if keys else "no object"}: a record '
                                f'needs a "text" string, or "prompt" and "response" strings, not both')
        if any(SURROGATE.search(s) for s in ((record["text"],) if text else (record["prompt"], record["response"]))):
            # a JSON escape of half a pair: no character, which tokenizers fail on or replace without a word
            raise DataPrepError(f"{where} holds a lone surrogate (an escape such as \\ud83d without its pair), which is "
                                f"no character; fix the record")
        if text and record["text"]:
            yield f"{key}:{i}", None, record["text"]
        elif pair and (record["prompt"] or record["response"]):
            yield f"{key}:{i}", record["prompt"], record["response"]
        else:
            empty.append(where)


def unit_hash(s):
    """A number in [0, 1) fixed by s on every machine and run (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.md5(s.encode("utf-8", "surrogatepass")).digest()[:8], "big") / 2**64


# ----------------------------------------------------------------------------- the split

def assign_split(sizes, hashes, cuttable, val_fraction):
    """Where each document's val part starts, in characters: 0 = all val, its size = all train.

    sizes and hashes (in [0, 1)) per document; cuttable says which may be cut (plain text). See the
    module docstring for the rule."""
    sizes, hashes = np.asarray(sizes, np.int64), np.asarray(hashes, np.float64)
    cuttable = np.asarray(cuttable, bool)
    tails = np.maximum(1, np.round(val_fraction * sizes)).astype(np.int64)
    large = cuttable & (sizes > val_fraction * sizes.sum() / 4) & (tails >= MIN_TAIL_CHARS)
    val_start = sizes.copy()
    val_start[large] -= tails[large]
    small = np.flatnonzero(~large)
    goal, taken = val_fraction * sizes[small].sum(), 0
    for i in small[np.argsort(hashes[small], kind="stable")]:
        if taken + sizes[i] <= goal:
            val_start[i], taken = 0, taken + sizes[i]
    if taken >= goal / 2:
        return val_start
    # too few small documents to get near the goal whole: cut the largest plain one for the rest,
    # else (samples only) take one more sample, as long as train keeps one
    deficit = int(round(goal - taken))
    rest = [i for i in small if val_start[i] == sizes[i]]
    if plain := [i for i in rest if cuttable[i] and sizes[i] > deficit]:
        i = max(plain, key=lambda i: (sizes[i], -hashes[i]))
        val_start[i] -= max(1, deficit)
    elif len(rest) > 1 or large.any():
        i = min(rest, key=lambda i: (sizes[i], hashes[i]))
        if taken + sizes[i] <= 2 * goal or not (val_start < sizes).any():
            val_start[i] = 0
    return val_start


def line_cut(text, pos, tail):
    """Where to cut text near pos, the intended start of a val tail of tail characters: a line boundary
    if one is close enough to keep the tail between half and twice that long, else pos itself."""
    after, before = text.find("\n", pos) + 1, text.rfind("\n", 0, pos) + 1
    if 0 < after < len(text) and after - pos <= tail / 2:
        return after
    if 0 < before and pos - before <= tail:
        return before
    return min(max(pos, 1), len(text) - 1)


# ----------------------------------------------------------------------------- encoding and packing

# the encoder of this process, set by _init_encoder in each worker (or in this process for num_proc=1)
_encoder = None


def _init_encoder(tokenizer_path, dtype, packed):
    global _encoder
    _encoder = (load_tokenizer(tokenizer_path), dtype, packed)


def _specials_in(tok, units):
    """(how many of the units hold a special token's string, the first one found): encoded as plain text."""
    found = [m[0] for u in units if tok.specials and (m := [m for t in u[:2] if t for m in tok.specials.findall(t)])]
    return len(found), found[0] if found else None


def _encode_chunk(chunk):
    """Encode (prompt, text, is_val, first, last) units. Flat: ({is_val: ids}, n_units, specials), BOS
    before a document's first piece and EOS after its last. Packed: ([(is_val, BOS prompt response EOS,
    n_prompt)], specials). specials: _specials_in's count and example."""
    tok, dtype, packed = _encoder
    bos = [] if tok.bos_id is None else [tok.bos_id]
    specials = _specials_in(tok, chunk)
    if packed:
        out = []
        for prompt, text, is_val, _, _ in chunk:
            # the mask boundary falls exactly between them. A tokenizer that adds a dummy prefix (Llama 2's)
            # would start a response encoded alone with a space piece the whole sample never has (the model
            # would learn to answer with a double space): it takes the whole sample's encoding, the prompt
            # being as much of it as the prompt's own encoding begins; a piece that merged across the
            # boundary (a prompt ending in a space, "Answer: ") then belongs to the response
            p = tok.encode(prompt) if prompt else []
            r = tok.encode(text) if text else []
            if p and r and tok.prefixes:
                whole = tok.encode(prompt + text)
                k = next((i for i, (a, b) in enumerate(zip(p, whole)) if a != b), min(len(p), len(whole)))
                p, r = whole[:k], whole[k:]
            ids = bos + p + r + [tok.eos_id]
            out.append((is_val, np.array(ids, dtype), len(bos) + len(p)))
        return out, specials
    out = {False: [], True: []}
    for _, text, is_val, first, last in chunk:
        ids = out[is_val]
        ids += bos if first else []
        ids += tok.encode(text) if first else tok.encode_rest(text)  # a later piece starts after a newline
        ids += [tok.eos_id] if last else []
    return {k: np.array(v, dtype) for k, v in out.items()}, len(chunk), specials


class _Packer:
    """Packs one split's samples whole, in order, into rows of block_size tokens, and writes them."""

    def __init__(self, write, block_size, eos_id, dtype, pos_dtype, long_samples):
        self.write, self.block_size, self.eos_id = write, block_size, eos_id
        self.dtype, self.pos_dtype, self.long_samples = dtype, pos_dtype, long_samples
        self.row, self.used = [], 0  # (ids, mask, pos) of the samples in the row being filled
        self.rows = self.samples = self.truncated = self.skipped = self.pad_tokens = 0

    def add(self, ids, n_prompt):
        if len(ids) > self.block_size:
            # skipped, or truncated to a row: unless the prompt alone fills it, leaving nothing to train
            if self.long_samples == "skip" or n_prompt >= self.block_size:
                self.skipped += 1
                return
            # keep the prompt and the response's head; no EOS: the response did not end there
            ids, self.truncated = ids[:self.block_size], self.truncated + 1
        if self.used + len(ids) > self.block_size:
            self.flush()
        mask = np.zeros(len(ids), np.uint8)
        mask[max(n_prompt, 1):] = 1  # a sample's first token has nothing of its own sample before it
        self.row.append((ids, mask, np.arange(len(ids))))
        self.used += len(ids)
        self.samples += 1

    def flush(self):
        pad = self.block_size - self.used
        if pad:  # padding is a sample of its own, never trained
            self.row.append((np.full(pad, self.eos_id), np.zeros(pad, np.uint8), np.arange(pad)))
        for part, dtype, parts in zip(("", "_mask", "_pos"), (self.dtype, np.uint8, self.pos_dtype), zip(*self.row)):
            self.write(part, np.concatenate(parts).astype(dtype))
        self.rows, self.pad_tokens = self.rows + 1, self.pad_tokens + pad
        self.row, self.used = [], 0

    def close(self):
        if self.row:
            self.flush()
        # one token past the last row, so the last window's final target exists; mask 0, never trained
        for part, dtype, value in (("", self.dtype, self.eos_id), ("_mask", np.uint8, 0), ("_pos", self.pos_dtype, 0)):
            self.write(part, np.array([value], dtype))


def _chunks(units, size):
    chunk, n = [], 0
    for unit in units:
        chunk.append(unit)
        n += len(unit[0] or "") + len(unit[1])
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


# ----------------------------------------------------------------------------- prepare

def prepare(inputs=None, out_dir=None, vocab_size=None, tokenizer=None, val_fraction=0.01, num_proc=None,
            block_size=None, long_samples="truncate"):
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
    if block_size is not None and block_size < 2:
        raise DataPrepError(f"--block_size must be at least 2, got {block_size}")
    if long_samples not in ("truncate", "skip"):
        raise DataPrepError(f"--long_samples must be 'truncate' or 'skip', got {long_samples!r}")
    num_proc = min(os.cpu_count() or 1, 8) if num_proc is None else num_proc
    if num_proc < 1:
        raise DataPrepError(f"--num_proc must be at least 1, got {num_proc}")
    if tokenizer is not None:
        tokenizer = os.fspath(tokenizer)
        tok = load_tokenizer(tokenizer)
        if tok.eos_id is None:
            raise DataPrepError(f"--tokenizer {tokenizer} has no EOS token, which ends every document here")
        dtype_for_vocab(tok.vocab_size)
    else:
        vocab_size = 4096 if vocab_size is None else vocab_size
        dtype_for_vocab(vocab_size)
    left_out = []
    if inputs is None:
        files, sources = stdlib_files(), [f"default: python stdlib {sysconfig.get_paths()['stdlib']}"]
    else:
        files, sources = list_files(inputs, left_out), inputs
    if not files:
        raise DataPrepError(f"no text files in {' '.join(inputs)} (looked for {' '.join(RECORD_EXTENSIONS + TEXT_EXTENSIONS)})")

    # first pass: check every document parses and measure it, before training or writing anything,
    # and set aside the tokenizer's sample: documents picked by hash, at a rate aiming at SAMPLE_CHARS
    total_bytes = sum(os.path.getsize(path) for path, _ in files)
    sample_rate = min(1.0, SAMPLE_CHARS / max(total_bytes, 1))
    skipped = []
    sizes, hashes, cuttable = array("q"), array("d"), bytearray()  # per document
    n_units = 0
    meta_space = []  # documents holding "\u2581", which SentencePiece reads as its sign for a space
    packed = long_text = None
    with tempfile.TemporaryFile("w+", encoding="utf-8", newline="\n") as sample:  # lines end at "\n" only
        sample_chars = 0
        undecodable, empty = [], []
        for key, prompt, text, first, last in iter_documents(files, skipped, undecodable, empty):
            n_units += 1
            if prompt is not None and not packed:
                packed = True
                if block_size is None:
                    raise DataPrepError(f"{key} is a prompt/response sample: give --block_size N, the length of "
                                        f"the rows samples are packed into (the training block_size)")
            if first:
                sizes.append(0)
                hashes.append(unit_hash("split:" + key))
                cuttable.append(prompt is None)
            elif long_text is None:
                long_text = key
            sizes[-1] += len(prompt or "") + len(text)
            if ("\u2581" in text or prompt and "\u2581" in prompt) and meta_space[-1:] != [key]:
                meta_space.append(key)
            if tokenizer is None and sample_chars < SAMPLE_CHARS and (
                    not sample_chars or unit_hash("sample:" + key) < sample_rate):
                for part in (prompt, text):
                    if part:
                        sample.write(part if part.endswith("\n") else part + "\n")
                        sample_chars += len(part)
        if undecodable:  # all of them in one message, not one a run
            raise DataPrepError(f"{len(undecodable)} files are not UTF-8 text ({first_few(undecodable)}); convert them "
                                f"(iconv -t UTF-8) or remove them from --input")
        if not sizes:
            note = f" ({len(skipped)} files skipped as binaries)" if skipped else ""
            raise DataPrepError(f"no readable text in {' '.join(inputs or ['the stdlib'])}{note}")
        if packed and long_text is not None:
            raise DataPrepError(f"{long_text} is over {DOC_CHARS:,} characters: too long for one sample of packed "
                                f"prompt/response data; give it as JSONL records, or prepare it apart")
        if (block_size is not None or long_samples != "truncate") and not packed:
            raise DataPrepError(f"{'--block_size packs' if block_size is not None else '--long_samples skip applies to'} "
                                f"prompt/response samples, and this input has none; leave it out for plain text (a flat "
                                f"token stream)")
        if tokenizer is None:
            sample.seek(0)
            model = train_tokenizer((line.removesuffix("\n") for line in sample), vocab_size)
    packed = bool(packed)
    sizes = np.frombuffer(sizes, np.int64)
    val_start = assign_split(sizes, np.frombuffer(hashes, np.float64),
                             np.frombuffer(cuttable, np.uint8).astype(bool) & (not packed), val_fraction)
    is_cut = (val_start > 0) & (val_start < sizes)
    if not (val_start > 0).any() or not (val_start < sizes).any():
        raise DataPrepError("the input is too small to split into train and val: "
                            + ("give at least 2 prompt/response samples" if packed else "give more text"))

    def units():
        """(prompt, text, is_val, first, last) for the second pass: the pieces of the first, cut by the split."""
        i = offset = -1
        cut_here = False
        for _, prompt, text, first, last in iter_documents(files):
            if first:
                i, offset = i + 1, 0
            c, offset = val_start[i] - offset, offset + len(prompt or "") + len(text)
            first, cut_here = first or cut_here, c == len(text)  # the split falls at this piece's end
            if c <= 0 or c >= len(text):
                yield prompt, text, bool(c <= 0), first, last or cut_here
            else:
                j = line_cut(text, c, sizes[i] - val_start[i])
                yield None, text[:j], False, first, True  # each part a document of its own
                yield None, text[j:], True, True, last

    # second pass: encode into a temp folder beside out_dir (os.replace works within one file system)
    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    prefix = f".{os.path.basename(out_dir)}.tmp-"
    for left in sorted(e for e in os.listdir(os.path.dirname(out_dir)) if e.startswith(prefix)):
        left = os.path.join(os.path.dirname(out_dir), left)
        size = 0
        for d, _, fs in os.walk(left):
            for f in fs:
                with contextlib.suppress(OSError):  # another run may finish, and take it away, meanwhile
                    size += os.path.getsize(os.path.join(d, f))
        print(f"warning: {left} ({size / 2 ** 20:,.1f} MiB) is the unfinished output of a data_prep.py that was "
              f"killed, or of one still writing {out_dir}; remove it once none is")
    tmp_dir = tempfile.mkdtemp(prefix=prefix, dir=os.path.dirname(out_dir))
    try:
        if tokenizer is None:
            with open(os.path.join(tmp_dir, "tokenizer.model"), "wb") as f:
                f.write(model)
            tok_names = ["tokenizer.model"]
        else:
            tok_names = tok.save(tmp_dir)
        # a model's folder keeps its own tokenizer files (remove_tokenizer_files): one read before the data's
        # would make the data unreadable as made
        read = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # with, or instead of, the data's
        if any(os.path.isfile(os.path.join(out_dir, n)) for n in ("config.json", "params.json")) and (
                shadows := [n for n in read if n not in tok_names and os.path.isfile(os.path.join(out_dir, n))]):
            raise DataPrepError(f"{out_dir} is a model's folder, whose {', '.join(shadows)} would be read with or instead "
                                f"of the tokenizer the data is made with ({tok_names[0]}); give --tokenizer {out_dir} "
                                f"(the folder), or prepare the data into another folder")
        # the copy encodes, so out_dir's tokenizer is the one that made the ids
        tok_path = os.path.join(tmp_dir, tok_names[0])
        tok = load_tokenizer(tok_path)
        dtype = dtype_for_vocab(tok.vocab_size)
        pos_dtype = np.uint16 if packed and block_size <= 2**16 else np.uint32
        names = [f"{s}{p}.bin" for p in (("", "_mask", "_pos") if packed else ("",)) for s in ("train", "val")]
        digests = {name: hashlib.sha256() for name in names}
        with contextlib.ExitStack() as stack:
            outs = {name: stack.enter_context(open(os.path.join(tmp_dir, name), "wb")) for name in names}

            def write(name, a):
                outs[name].write(a.tobytes())
                digests[name].update(a.tobytes())

            chunks = _chunks(units(), CHUNK_CHARS)
            if num_proc == 1:
                _init_encoder(tok_path, dtype, packed)
                results = map(_encode_chunk, chunks)
            else:  # the pool before the progress bar, so no tqdm thread is running when it forks
                pool = stack.enter_context(multiprocessing.Pool(num_proc, _init_encoder, (tok_path, dtype, packed)))
                results = _imap_bounded(pool, _encode_chunk, chunks, 4 * num_proc)
            bar = stack.enter_context(tqdm(total=n_units + int(is_cut.sum()), unit="doc", desc="encoding",
                                           file=sys.stderr, disable=None))
            packers = {v: _Packer(lambda part, a, s=s: write(f"{s}{part}.bin", a), block_size, tok.eos_id, dtype,
                                  pos_dtype, long_samples) for v, s in ((False, "train"), (True, "val"))} if packed else {}
            n_specials, special = 0, None
            for *result, (n, example) in results:
                n_specials, special = n_specials + n, special or example
                if packed:
                    for is_val, ids, n_prompt in result[0]:
                        packers[is_val].add(ids, n_prompt)
                    bar.update(len(result[0]))
                else:
                    for is_val, ids in result[0].items():
                        write("val.bin" if is_val else "train.bin", ids)
                    bar.update(result[1])
            for split, p in zip(("train", "val"), packers.values()):
                if p.samples == 0:
                    raise DataPrepError(f"no {split} sample is left after skipping {p.skipped} longer than --block_size "
                                        f"{block_size} (or whose prompt fills it); raise --block_size, or use --long_samples truncate")
                p.close()

        data = {name: {"bytes": os.path.getsize(os.path.join(tmp_dir, name)), "sha256": digests[name].hexdigest()}
                for name in names}
        n_tokens = {s: data[f"{s}.bin"]["bytes"] // np.dtype(dtype).itemsize for s in ("train", "val")}
        train, val = packers.get(False), packers.get(True)
        # the share of the samples' own tokens: packed rows also hold padding, and one token past the last row
        own = {s: n - (p.pad_tokens + 1 if packed else 0) for (s, n), p in zip(n_tokens.items(), (train, val))}
        meta = {
            "vocab_size": tok.vocab_size,
            "dtype": np.dtype(dtype).name,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "tokenizer": {**tok.fingerprint(), "files": tok_names},
            "packed": packed,
            "block_size": block_size,
            "has_mask": packed,
            "mask_dtype": "uint8" if packed else None,
            "has_pos": packed,
            "pos_dtype": np.dtype(pos_dtype).name if packed else None,
            "train_tokens": n_tokens["train"],
            "val_tokens": n_tokens["val"],
            "val_share": own["val"] / (own["train"] + own["val"]),
            "val_fraction": val_fraction,
            # packed: samples in each split's rows (a skipped one is in neither)
            "train_docs": train.samples if packed else int((val_start > 0).sum()),
            "val_docs": val.samples if packed else int((val_start < sizes).sum()),
            "cut_docs": int(is_cut.sum()),
            "train_rows": train.rows if packed else None,
            "val_rows": val.rows if packed else None,
            "long_samples": long_samples if packed else None,
            "truncated_samples": train.truncated + val.truncated if packed else 0,
            "skipped_samples": train.skipped + val.skipped if packed else 0,
            "pad_tokens": train.pad_tokens + val.pad_tokens if packed else 0,
            "skipped_files": len(skipped),
            "tokenizer_source": tokenizer or f"trained here: BPE, byte fallback, {sample_chars:,} characters of the input",
            "sources": sources,
            "data": data,
        }
        with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)

        # move in: the old meta.json goes first and the new one comes last, so meta.json never describes
        # token files other than the ones beside it; an earlier run's masks and tokenizer files go too
        # (not a model's own, where out_dir is its folder)
        os.makedirs(out_dir, exist_ok=True)
        for name in ("meta.json",) + BIN_NAMES:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out_dir, name))
        remove_tokenizer_files(out_dir, keep=tok_names)
        for name in tok_names + names + ["meta.json"]:
            os.replace(os.path.join(tmp_dir, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)

    cut = f", {meta['cut_docs']} cut between them" if meta["cut_docs"] else ""
    print(f"wrote {out_dir}: train {meta['train_tokens']:,} tokens in {meta['train_docs']:,} docs, "
          f"val {meta['val_tokens']:,} tokens in {meta['val_docs']:,} docs{cut}; val share {meta['val_share']:.2%} "
          f"(asked {val_fraction:.2%}), {meta['dtype']}, vocab {tok.vocab_size:,}, {time.time() - t0:.1f}s")
    if left_out:  # a folder of .text or .markdown files would otherwise lose them without a word
        print(f"note: {len(left_out)} files in the input folders are not of a text extension and were left out: "
              f"{first_few(left_out)}")
    if skipped:
        print(f"warning: {len(skipped)} binary files (NUL bytes) skipped: {first_few(skipped)}")
    if empty:
        print(f"note: {len(empty)} records with nothing in them left out: {first_few(empty)}")
    if packed:
        print(f"packed into rows of {block_size}: {meta['train_rows']:,} train, {meta['val_rows']:,} val; "
              f"{meta['truncated_samples']:,} samples truncated, {meta['skipped_samples']:,} skipped (longer than "
              f"--block_size), {meta['pad_tokens']:,} padding tokens")
    n_pieces = n_units + int(is_cut.sum())  # as encoded: a document cut between the splits is two
    if n_specials > n_pieces / 100:  # a stray "<s>" in a corpus (HTML has them) is not a format
        print(f"warning: {n_specials:,} of the {n_pieces:,} documents or samples hold strings of the tokenizer's special "
              f"tokens (the first: {special!r}), encoded as plain text like the rest: a chat format written into the "
              f"data is learned as text, not as the special tokens a chat template puts there")
    if meta_space and tok.decode(tok.encode("a\u2581b")) != "a\u2581b":
        print(f"warning: {len(meta_space):,} documents or samples hold the character \u2581 (U+2581), which this "
              f"SentencePiece tokenizer reads as a space: it is trained on and decodes as one ({first_few(meta_space)})")
    if not val_fraction / 2 <= meta["val_share"] <= 2 * val_fraction:
        print(f"warning: val holds {meta['val_share']:.2%} of the tokens, not near the asked {val_fraction:.2%}: "
              f"the input has too few documents to split finer; give more, or change --val_fraction")
    return meta


def main(argv=None):
    parser = argparse.ArgumentParser(prog="data_prep.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", action="extend", metavar="PATH",
                        help="text files, folders (recursive), .jsonl and .json files; default: the Python stdlib")
    parser.add_argument("--out_dir", help="output folder; default data/stdlib without --input")
    vocab = parser.add_mutually_exclusive_group()
    vocab.add_argument("--vocab_size", type=int, help="train a BPE tokenizer of this many pieces (default 4096)")
    vocab.add_argument("--tokenizer", metavar="PATH", help="use this tokenizer: a SentencePiece .model, an HF "
                       "tokenizer.json or model folder, or Meta's Llama 3 tokenizer.model")
    parser.add_argument("--val_fraction", type=float, default=0.01, help="share of the text for val (default 0.01)")
    parser.add_argument("--block_size", type=int, help="packed prompt/response data: tokens per row (required there)")
    parser.add_argument("--long_samples", default="truncate", choices=("truncate", "skip"),
                        help="a sample longer than --block_size is truncated (default) or skipped")
    parser.add_argument("--num_proc", type=int, default=None, help="encoding processes (default min(cpus, 8))")
    args = parser.parse_args(argv)
    try:
        prepare(args.input, args.out_dir, args.vocab_size, args.tokenizer, args.val_fraction, args.num_proc,
                args.block_size, args.long_samples)
    except DataPrepError as e:
        print(f"data_prep.py: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
