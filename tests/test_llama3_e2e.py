"""The Llama 3 path end to end, as a user takes it: a Hugging Face directory written by
transformers (Llama-3.2 shape: tied embeddings, llama3 RoPE scaling, its own tokenizer.json),
data prepared with that tokenizer, a QAT finetune exporting an HF directory, and transformers
loading that export with nanotune's logits and generating from it. Also the tokenizer checks
where a model and data meet."""

import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checkpoint import load_checkpoint  # noqa: E402
from conftest import run  # noqa: E402
from data_prep import prepare  # noqa: E402
from model import Transformer  # noqa: E402
from test_tokenizers import TEXTS, write_hf, write_sentencepiece  # noqa: E402

transformers.logging.set_verbosity_error()
logging.getLogger("transformers").setLevel(logging.ERROR)

TRAIN = dict(block_size=32, batch_size=4, max_iters=2, warmup_iters=1, learning_rate=1e-3, eval_interval=1000,
             eval_iters=1, log_interval=1, ckpt_interval=1000, quantizer="8da4w", group_size=32)


SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}  # Llama 3.1 Instruct's
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


@pytest.fixture(scope="module")
def llama32(tmp_path_factory):
    """An HF directory: a random tied Llama-3.2-shaped model and a byte-level BPE tokenizer.json."""
    d = tmp_path_factory.mktemp("llama32")
    write_hf(d)
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # in a file of its own, as transformers 4.4x on saves it
    vocab = json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                                   max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                                   rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                                        low_freq_factor=1.0, high_freq_factor=4.0,
                                                        original_max_position_embeddings=64))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    corpus = tmp_path_factory.mktemp("corpus")
    for i in range(12):  # enough text for a few windows of 32 tokens in each split
        for name, text in TEXTS.items():
            (corpus / f"{i}_{name}").write_text(text)
    data = tmp_path_factory.mktemp("data")
    prepare(inputs=[str(corpus)], out_dir=str(data), tokenizer=str(d), val_fraction=0.2)
    return d, data


def test_qat_from_hf_directory_exports_what_transformers_loads(llama32, tmp_path):
    hf_dir, data = llama32
    # an Instruct model's generation config stops at several ids (Llama 3.1: end of text, of a tool call, of a turn)
    hf_dir = Path(shutil.copytree(hf_dir, tmp_path / "instruct"))
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    (hf_dir / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [5, 2], **SAMPLING}))
    out = tmp_path / "out"
    run("qat_train.py", init_from=str(hf_dir), data_dir=str(data), out_dir=str(out), export_format="hf", **TRAIN)
    export = out / "export_hf"
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["tie_word_embeddings"] and cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["head_dim"] == 32
    # the data's EOS first, then the source's other stop ids: carried through the checkpoint to the export
    assert cfg["eos_token_id"] == json.loads((export / "generation_config.json").read_text())["eos_token_id"] == [2, 5]
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["stop_ids"] == [5, 2] and {k: ckpt["generation"].get(k) for k in SAMPLING} == SAMPLING
    # and its sampling defaults, so that transformers and vLLM sample from the export as from the source
    exported = json.loads((export / "generation_config.json").read_text())
    assert {k: exported.get(k) for k in (*SAMPLING, "bos_token_id", "eos_token_id")} == {**SAMPLING, "bos_token_id": 1,
                                                                                          "eos_token_id": [2, 5]}
    assert transformers.GenerationConfig.from_pretrained(export).temperature == 0.6
    assert (export / "tokenizer.json").exists() and (export / "generation_config.json").exists()
    # the source's chat template comes along, so the export chats in transformers as the source did
    chat = transformers.AutoTokenizer.from_pretrained(export).apply_chat_template([{"role": "user", "content": "hi"}],
                                                                                   tokenize=False)
    assert chat == "<s>user: hi</s>"
    # the export computes what the trained checkpoint computes, in transformers
    args, sd = load_checkpoint(str(out / "ckpt.pt"))
    assert args.tie_embeddings and torch.equal(sd["output.weight"], sd["tok_embeddings.weight"])  # still tied
    ours = Transformer(args)
    ours.load_state_dict(sd, assign=True)
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.eval()(tokens), rtol=0, atol=1e-4)
        # the export is the trained model, not the starting one
        start = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        assert (start(tokens).logits - theirs(tokens).logits).abs().max() > 1e-4
        out_ids = theirs.generate(tokens[:1, :8], max_new_tokens=6, do_sample=False)
    assert out_ids.shape == (1, 14)
    assert torch.equal(out_ids, ours.generate(tokens[:1, :8], 6, temperature=0))
    # and the converted model and the copy of the tokenizer are beside the checkpoint
    assert (out / "quantized.pt").exists() and (out / "tokenizer.json").exists()


def test_kd_student_export_keeps_its_sources_sampling_defaults(llama32, tmp_path):
    # a student finetuned from an Instruct directory, through a checkpoint and a resume, to its HF export
    hf_dir, data = llama32
    hf_dir = Path(shutil.copytree(hf_dir, tmp_path / "instruct"))
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    (hf_dir / "generation_config.json").write_text(json.dumps({**generation, **SAMPLING}))
    settings = {k: v for k, v in TRAIN.items() if k not in ("quantizer", "group_size")}
    common = dict(settings, init_from=str(hf_dir), teacher_init=str(hf_dir), data_dir=str(data), out_dir=str(tmp_path / "kd"))
    run("kd_train.py", **dict(common, max_iters=1))
    generation = torch.load(tmp_path / "kd" / "ckpt.pt", weights_only=True)["generation"]  # what the resume reads
    assert {k: generation.get(k) for k in SAMPLING} == SAMPLING
    run("kd_train.py", **dict(common, init_from="resume", export_format="hf"))
    exported = json.loads((tmp_path / "kd" / "export_hf" / "generation_config.json").read_text())
    assert {k: exported.get(k) for k in SAMPLING} == SAMPLING


def test_data_from_another_tokenizer_is_refused(llama32, tmp_path):
    hf_dir, _ = llama32
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in TEXTS.items():
        (corpus / name).write_text(text * 8)
    other = tmp_path / "other"
    prepare(inputs=[str(corpus)], out_dir=str(other), tokenizer=str(write_sentencepiece(tmp_path / "sp.model")),
            val_fraction=0.2)
    r = run("qat_train.py", check=False, init_from=str(hf_dir), data_dir=str(other), out_dir=str(tmp_path / "o"),
            **TRAIN)
    assert r.returncode == 2 and "another tokenizer" in r.stderr, r.stderr[-2000:]
    r = run("kd_train.py", check=False, init_from="scratch", preset="toy", teacher_init=str(hf_dir),
            data_dir=str(other), out_dir=str(tmp_path / "k"),
            **{**{k: v for k, v in TRAIN.items() if k != "group_size"}, "quantizer": "none"})
    assert r.returncode == 2 and "teacher_init" in r.stderr and "another tokenizer" in r.stderr, r.stderr[-2000:]
    # a model directory whose tokenizer cannot be read (no config names its EOS) is one line too
    unreadable = Path(shutil.copytree(hf_dir, tmp_path / "unreadable"))
    (unreadable / "tokenizer_config.json").unlink()
    r = run("qat_train.py", check=False, init_from=str(unreadable), data_dir=str(llama32[1]), out_dir=str(tmp_path / "u"),
            **TRAIN)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: ") and "eos_token" in r.stderr


def test_kd_holds_teacher_and_student_to_one_tokenizer(llama32, tmp_path):
    hf_dir, data = llama32
    settings = {**{k: v for k, v in TRAIN.items() if k != "group_size"}, "quantizer": "none", "max_iters": 1}
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    # a student whose tokenizer.json was written again (as save_pretrained does: merges as strings,
    # other spacing) has the data's tokenizer still
    student = Path(shutil.copytree(hf_dir, tmp_path / "student"))
    tokenizer["model"]["merges"] = [" ".join(m) for m in tokenizer["model"]["merges"]]
    (student / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1))
    run("kd_train.py", init_from=str(student), teacher_init=str(hf_dir), data_dir=str(data), out_dir=str(tmp_path / "k"),
        **settings)
    # one with a merge fewer has another, which data made by hand (no tokenizer recorded) does not catch
    tokenizer["model"]["merges"].pop()
    (student / "tokenizer.json").write_text(json.dumps(tokenizer))
    by_hand = Path(shutil.copytree(data, tmp_path / "by_hand"))
    meta = json.loads((by_hand / "meta.json").read_text())
    del meta["tokenizer"]
    (by_hand / "meta.json").write_text(json.dumps(meta))
    r = run("kd_train.py", check=False, init_from=str(student), teacher_init=str(hf_dir), data_dir=str(by_hand),
            out_dir=str(tmp_path / "k2"), **settings)
    assert r.returncode == 2 and "different tokenizers" in r.stderr, r.stderr[-2000:]
    # nor a teacher's tokenizer with more ids than such data says it uses: both models would be cut to them
    fewer = Path(shutil.copytree(by_hand, tmp_path / "fewer"))
    (fewer / "meta.json").write_text(json.dumps({**meta, "vocab_size": meta["vocab_size"] - 8}))
    r = run("kd_train.py", check=False, init_from="scratch", teacher_init=str(hf_dir), data_dir=str(fewer),
            out_dir=str(tmp_path / "k3"), **settings)
    assert r.returncode == 2 and (f"was trained with a tokenizer of {meta['vocab_size']} ids, and the data in {fewer}, "
                                  f"which records no tokenizer, uses {meta['vocab_size'] - 8}") in r.stderr, r.stderr[-2000:]
    # a student directory holding a tokenizer.model too (HF directories often hold both kinds) is
    # compared in the kind the teacher has, and refused the same
    write_sentencepiece(student / "tokenizer.model")
    r = run("kd_train.py", check=False, init_from=str(student), teacher_init=str(hf_dir), data_dir=str(by_hand),
            out_dir=str(tmp_path / "k2"), **settings)
    assert r.returncode == 2 and "different tokenizers" in r.stderr, r.stderr[-2000:]
    (student / "tokenizer.model").unlink()
    # a teacher's top-k store written from data made by hand records the teacher's tokenizer in each
    # kind its directory holds, and holds a student to it
    two_kinds = Path(shutil.copytree(hf_dir, tmp_path / "two_kinds"))
    write_sentencepiece(two_kinds / "tokenizer.model")
    store = tmp_path / "store"
    write = dict(teacher_init=str(two_kinds), data_dir=str(by_hand), out_dir=str(tmp_path / "w"), topk_write=True,
                 teacher_topk_dir=str(store), teacher_topk=8, block_size=settings["block_size"], batch_size=settings["batch_size"])
    run("kd_train.py", **write)
    learn = dict(settings, teacher_topk_dir=str(store), data_dir=str(by_hand))
    r = run("kd_train.py", check=False, init_from=str(student), out_dir=str(tmp_path / "k5"), **learn)
    assert r.returncode == 2 and "different tokenizers" in r.stderr and "the teacher of the store" in r.stderr, r.stderr[-2000:]
    # compared in the kind transformers reads first: tokenizer.json, the same here, whatever their .model
    same_json = Path(shutil.copytree(hf_dir, tmp_path / "same_json"))
    write_sentencepiece(same_json / "tokenizer.model", vocab_size=320)
    run("kd_train.py", init_from=str(same_json), out_dir=str(tmp_path / "k6"), **learn)
    # a store from before they were recorded says so, and its write command, run again, records them
    meta = json.loads((store / "meta.json").read_text())
    del meta["teacher_tokenizers"]
    (store / "meta.json").write_text(json.dumps(meta))
    r = run("kd_train.py", init_from=str(student), out_dir=str(tmp_path / "k7"), **learn)
    assert "predates recorded teacher tokenizers" in r.stdout, r.stdout[-2000:]
    run("kd_train.py", **write)
    r = run("kd_train.py", check=False, init_from=str(student), out_dir=str(tmp_path / "k8"), **learn)
    assert r.returncode == 2 and "different tokenizers" in r.stderr, r.stderr[-2000:]
    # a teacher whose tokenizer cannot be read (no config names its EOS): one line against data that
    # records a tokenizer; on data made by hand, which needs none, a warning that nothing is compared
    teacher = Path(shutil.copytree(hf_dir, tmp_path / "teacher"))
    (teacher / "tokenizer_config.json").unlink()
    r = run("kd_train.py", check=False, init_from=str(hf_dir), teacher_init=str(teacher), data_dir=str(data),
            out_dir=str(tmp_path / "k3"), **settings)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: teacher_init=") and "eos_token" in r.stderr
    r = run("kd_train.py", init_from=str(student), teacher_init=str(teacher), data_dir=str(by_hand),
            out_dir=str(tmp_path / "k4"), **settings)
    assert "has no readable tokenizer of the student's kind" in r.stdout, r.stdout[-2000:]


def test_sample_decodes_with_the_checkpoints_tokenizer_only(llama32, tmp_path):
    hf_dir, data = llama32
    out = tmp_path / "out"
    run("qat_train.py", init_from=str(hf_dir), data_dir=str(data), out_dir=str(out), export_format="hf",
        **{**TRAIN, "max_iters": 1})
    # the tokenizer beside the checkpoint by default; another one is refused in one line
    r = run("sample.py", init_from=str(out / "ckpt.pt"), start="def f(x):", num_samples=1, max_new_tokens=5,
            temperature=0.0)
    assert re.search(r"tokens in [0-9.]+ s(, [0-9.]+ tokens/s after the first|, too few to time)", r.stdout), r.stdout
    assert "computing in float32" in r.stdout
    # a prompt file saved with a byte-order mark reads as its text, as data_prep.py reads files
    (tmp_path / "prompt.txt").write_text("\ufeffdef f(x):", encoding="utf-8")
    r2 = run("sample.py", init_from=str(out / "ckpt.pt"), start=f"FILE:{tmp_path / 'prompt.txt'}", num_samples=1,
             max_new_tokens=5, temperature=0.0)
    def text(r):  # what was sampled, the prompt included
        return r.stdout.split("computing in float32\n")[1].split("---------------")[0]
    assert text(r2) == text(r) and text(r).startswith("def f(x):"), (text(r2), text(r))
    # a checkpoint that is not there: one line
    r = run("sample.py", check=False, init_from=str(out / "typo.pt"))
    assert r.returncode != 0 and r.stderr.strip() == f"error: init_from={str(out / 'typo.pt')!r} does not exist", r.stderr[-2000:]
    # settings the run would not read, and a negative temperature (configurator.py's check), which would draw
    # the least likely tokens
    for bad, said in ((dict(temperature=0.0, top_k=5), "temperature=0 is greedy and draws nothing: top_k not read"),
                      (dict(temperature=-1.0), "temperature=-1.0 must be a number >= 0"),
                      (dict(export_pte=str(tmp_path / "m.pte"), max_new_tokens=3), "samples nothing: max_new_tokens not read")):
        r = run("sample.py", check=False, init_from=str(out / "ckpt.pt"), **bad)
        assert r.returncode != 0 and said in r.stderr, r.stderr[-2000:]
    # a prompt longer than the context would be read by its last max_seq_len tokens alone: refused
    r = run("sample.py", check=False, init_from=str(out / "ckpt.pt"), start="def f(x): " * 100, max_new_tokens=2)
    assert r.returncode != 0 and "longer than" in r.stderr and "context of 128" in r.stderr, r.stderr[-2000:]
    assert "warning" not in r.stderr
    # a special token's text in the prompt is plain text, as in the data, and said to be
    r = run("sample.py", init_from=str(out / "ckpt.pt"), start="<s>def f(x):", num_samples=1, max_new_tokens=2)
    assert "warning: --start holds '<s>', a special token's text, which is encoded as plain text" in r.stderr, r.stderr[-2000:]
    # a bfloat16 directory computes in the dtype asked for (float32 by default), not the file's
    bf16 = tmp_path / "bf16"
    transformers.LlamaForCausalLM.from_pretrained(hf_dir).to(torch.bfloat16).save_pretrained(bf16)
    for f in os.listdir(hf_dir):
        if f.startswith("tokenizer"):
            shutil.copy(hf_dir / f, bf16 / f)
    for dtype in ("float32", "bfloat16"):
        r = run("sample.py", init_from=str(bf16), dtype=dtype, start="def f(x):", num_samples=1, max_new_tokens=3)
        assert f"computing in {dtype}" in r.stdout, r.stdout
    # a converted model computes in the dtype it was converted in; another one asked for is refused
    r = run("sample.py", init_from=str(out / "quantized.pt"), start="def f(x):", num_samples=1, max_new_tokens=3)
    assert "quantized" in r.stdout and "computing in float32" in r.stdout, r.stdout
    # a model from scratch knows its training windows' positions alone: sampling past them is said to go where
    # it never trained; a finetune of an HF model takes that model's context (128 here) as known
    scratch = tmp_path / "scratch"
    run("qat_train.py", preset="toy", data_dir=str(data), out_dir=str(scratch), **{**TRAIN, "max_iters": 1})
    finetuned = torch.load(out / "ckpt.pt", weights_only=True)["trained_context"]
    assert torch.load(scratch / "ckpt.pt", weights_only=True)["trained_context"] == 32 and finetuned == 128
    for init, n, said in ((scratch / "quantized.pt", 40, True), (scratch / "quantized.pt", 5, False), (out / "ckpt.pt", 100, False)):
        r = run("sample.py", init_from=str(init), start="def f(x):", num_samples=1, max_new_tokens=n)
        assert ("trained on windows of at most 32 tokens" in r.stderr) == said, r.stderr[-2000:]
    r = run("sample.py", check=False, init_from=str(out / "quantized.pt"), dtype="bfloat16", max_new_tokens=3)
    assert r.returncode != 0 and "is a converted model, which computes in torch.float32; drop --dtype" in r.stderr, r.stderr[-2000:]
    r = run("sample.py", check=False, init_from=str(out / "quantized.pt"), dtype="float16")
    assert r.returncode != 0 and "dtype='float16' is not supported; use 'float32' or 'bfloat16'" in r.stderr, r.stderr[-2000:]
    r = run("sample.py", check=False, init_from=str(out / "quantized.pt"), pte_max_seq_len=64)
    assert r.returncode != 0 and "pte_max_seq_len sizes the cache of the --export_pte program" in r.stderr, r.stderr[-2000:]
    other = write_sentencepiece(tmp_path / "sp.model")
    r = run("sample.py", check=False, init_from=str(out / "ckpt.pt"), tokenizer=str(other), max_new_tokens=5)
    lines = [l for l in r.stderr.splitlines() if l.startswith("error")]
    assert r.returncode != 0 and len(lines) == 1 and "not the one" in lines[0], r.stderr[-2000:]
    # an export's weights copied without its tokenizer: the one its nanotune.json records is the one it takes
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors", "generation_config.json", "nanotune.json"):
        shutil.copy(out / "export_hf" / f, bare / f)
    r = run("sample.py", check=False, init_from=str(bare), tokenizer=str(other), max_new_tokens=2)
    assert r.returncode != 0 and "not the one" in r.stderr, r.stderr[-2000:]
    # weights alone, as downloaded, with a tokenizer far smaller than their vocabulary: another model's
    big = tmp_path / "big"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=64)).save_pretrained(big)
    r = run("sample.py", check=False, init_from=str(big), tokenizer=str(other), max_new_tokens=2)
    assert r.returncode != 0 and "2048 vocabulary rows but the tokenizer only 340" in r.stderr, r.stderr[-2000:]
