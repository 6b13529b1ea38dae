"""Hugging Face and Meta checkpoints against transformers itself: tiny random models in the shapes
of Llama 2, Llama 3 and Llama 3.2 (and a Mistral), saved by transformers in its 5.x config style
and rewritten in the 4.x style, must give transformers' logits in nanotune, and nanotune's
exports must give nanotune's logits in transformers. transformers is a test dependency only."""

import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file as safe_load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checkpoint import export_hf, export_meta, hf_to_meta, load_checkpoint, load_provenance  # noqa: E402
from model import ModelArgs, Transformer, rope_tables  # noqa: E402

transformers.logging.set_verbosity_error()
logging.getLogger("transformers").setLevel(logging.ERROR)

T = 48  # tokens per test sequence: below the Mistral window, long enough for RoPE to matter
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128,
            bos_token_id=1, eos_token_id=2)
SHAPES = {
    "llama2": dict(num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5,
                   rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "llama3": dict(num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5,
                   rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
    # tied, scaled RoPE, and a head_dim other than hidden/heads; an original context of 64 puts
    # the head's frequencies in all three bands of the scaling (kept, blended, stretched)
    "llama3.2": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                     rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=64)),
}
TOKENS = torch.randint(0, 300, (2, T), generator=torch.Generator().manual_seed(0))


def hf_model(shape, seed=0, window=64):
    if shape == "mistral":
        cfg = transformers.MistralConfig(**BASE, num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                                         rope_parameters=dict(rope_type="default", rope_theta=1e6))
        model = transformers.MistralForCausalLM(cfg)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE, **SHAPES[shape]))
    # weights far from transformers' tiny init, so that any mistake shows in the logits
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((1.0 if p.ndim == 1 else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def save_hf(model, path, style):
    model.save_pretrained(path)
    if style == "4.x":  # top-level rope_theta and rope_scaling, torch_dtype: most Hub directories
        cfg = json.loads((path / "config.json").read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        cfg["torch_dtype"] = cfg.pop("dtype")
        (path / "config.json").write_text(json.dumps(cfg))
    return path


@torch.no_grad()
def nanotune_logits(args, sd, tokens=TOKENS):
    model = Transformer(args)
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval()(tokens)


@torch.no_grad()
def hf_logits(model, tokens=TOKENS):
    return model(tokens).logits


def max_err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("style", ["5.x", "4.x"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_hf_directory_loads_exactly(tmp_path, shape, style):
    model = hf_model(shape)
    path = save_hf(model, tmp_path / "hf", style)
    if style == "4.x":  # the rewritten config means the same model to transformers
        assert max_err(hf_logits(transformers.AutoModelForCausalLM.from_pretrained(path)), hf_logits(model)) == 0
    args, sd = load_checkpoint(str(path))
    rope = SHAPES[shape]["rope_parameters"]
    assert args.rope_theta == rope["rope_theta"] and args.n_kv_heads == SHAPES[shape]["num_key_value_heads"]
    assert args.tie_embeddings == (shape == "llama3.2")
    assert args.head_dim == SHAPES[shape].get("head_dim", 64 // args.n_heads)
    assert args.rope_scaling == (None if shape != "llama3.2" else (32.0, 1.0, 4.0, 64))
    ours = nanotune_logits(args, sd)
    assert max_err(ours, hf_logits(model)) <= 1e-4
    # and the test can fail: RoPE as nanotune read configs before (theta 10000, no scaling) is off
    if shape != "llama2":
        wrong = replace(args, rope_theta=10000.0, rope_scaling_factor=None)
        assert max_err(nanotune_logits(wrong, sd), ours) > 1e-2


@pytest.mark.parametrize("shape", list(SHAPES))
def test_export_hf_loads_in_transformers(tmp_path, shape):
    args, sd = load_checkpoint(str(save_hf(hf_model(shape), tmp_path / "src", "5.x")))
    ours = nanotune_logits(args, sd)
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"model": {"type": "BPE"}}')
    export_hf(sd, args, tmp_path / "out", tokenizer_files=[str(tok)], bos_id=1, eos_id=[2, 3],
              provenance={"tokenizer_sha256": "abc"})
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "nanotune.json",
                                       "tokenizer.json"]
    assert load_provenance(str(out)) == {"tokenizer_sha256": "abc"}
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": [2, 3]}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] == args.tie_embeddings and cfg["head_dim"] == args.head_dim
    with safe_open(out / "model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not args.tie_embeddings)  # tied stays tied, no copy
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.tie_word_embeddings == args.tie_embeddings
    rope = hf.config.rope_parameters  # transformers 5 read the 4.x-style config as written
    assert rope["rope_theta"] == args.rope_theta and rope.get("factor") == args.rope_scaling_factor
    assert max_err(hf_logits(hf), ours) <= 1e-4
    # greedy generation in transformers continues as nanotune's own argmax does
    prompt = TOKENS[:1, :8]
    out_ids = hf.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = prompt
    for _ in range(6):
        expected = torch.cat([expected, nanotune_logits(args, sd, expected)[:, -1:].argmax(-1)], 1)
    assert torch.equal(out_ids, expected)
    # and nanotune reads its own export back to the same settings
    args2, sd2 = load_checkpoint(str(out))
    assert args2 == args
    assert torch.equal(nanotune_logits(args2, sd2), ours)


def test_mistral_sliding_window(tmp_path):
    model = hf_model("mistral")
    path = save_hf(model, tmp_path / "hf", "5.x")
    args, sd = load_checkpoint(str(path))
    assert args.sliding_window == 64 and args.rope_theta == 1e6
    assert max_err(nanotune_logits(args, sd), hf_logits(model)) <= 1e-4  # T < window: the window never bites
    # a window shorter than the sequence, as transformers counts it (a window one shorter or longer is off)
    short = hf_model("mistral", window=16)
    args16, sd16 = load_checkpoint(str(save_hf(short, tmp_path / "hf16", "5.x")))
    assert args16.sliding_window == 16 and max_err(nanotune_logits(args16, sd16), hf_logits(short)) <= 1e-4
    assert all(max_err(nanotune_logits(replace(args16, sliding_window=w), sd16), hf_logits(short)) > 1e-2 for w in (15, 17))
    export_hf(sd, args, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "mistral" and cfg["sliding_window"] == 64
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.sliding_window == 64
    # a Mistral config without the key has transformers' default window, not none
    cfg = json.loads((path / "config.json").read_text())
    del cfg["sliding_window"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(str(path))[0].sliding_window == 4096


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gemma"), r"model_type='gemma', and nanotune implements only \['llama', 'mistral'\]"),
    (dict(architectures=["LlamaForSequenceClassification"]), r"architectures=\['LlamaForSequenceClassification'\]"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu', which nanotune does not implement \(only 'silu'\)"),
    (dict(attention_bias=True), r"attention_bias=True, which nanotune does not implement"),
    (dict(mlp_bias=True), r"mlp_bias=True"),
    (dict(attention_dropout=0.1), r"attention_dropout=0.1"),
    (dict(num_local_experts=8), r"num_local_experts=8"),
    (dict(quantization_config={"quant_method": "gptq"}), r"quantization_config="),
    # transformers 5 loads the file it names, not model.safetensors beside it
    (dict(transformers_weights="weights-v2.safetensors"), r"transformers_weights='weights-v2\.safetensors'"),
    (dict(sliding_window=4096), r"sliding_window=4096, which LlamaForCausalLM ignores"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)),
     r"rope_parameters.rope_type='yarn', which nanotune does not implement"),
    (dict(rope_scaling=dict(type="linear", factor=2.0)), r"rope_scaling.rope_type='linear'"),
    (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), r"rope_scaling.rope_type='dynamic'"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
     r"partial_rotary_factor=0.5"),
    (dict(rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0)), r"without low_freq_factor"),
])
def test_hf_refusals(tmp_path, change, message):
    path = save_hf(hf_model("llama3"), tmp_path / "hf", "5.x")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    (path / "model.safetensors").write_bytes(b"not read")  # refused before any tensor is read
    with pytest.raises(ValueError, match=message) as e:
        load_checkpoint(str(path))
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_hf_tied_config_with_its_own_lm_head(tmp_path):
    # tie_word_embeddings true beside an lm_head.weight unlike the embedding: transformers 4 ties
    # (drops it), 5 keeps it untied; loading either way would be wrong for one of them
    path = save_hf(hf_model("llama3"), tmp_path / "hf", "5.x")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match=r"tie_word_embeddings true, yet the weights hold an lm_head.weight") as e:
        load_checkpoint(str(path))
    assert "\n" not in str(e.value)


def test_hf_missing_shard(tmp_path, capsys):
    path = save_hf(hf_model("llama3"), tmp_path / "hf", "5.x")
    os.rename(path / "model.safetensors", path / "model-00001-of-00002.safetensors")
    with safe_open(path / "model-00001-of-00002.safetensors", "pt") as f:
        weight_map = {k: "model-00001-of-00002.safetensors" for k in f.keys()}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"names 1 weight files that are not in .*model-00002-of-00002") as e:
        load_checkpoint(str(path))
    assert "\n" not in str(e.value)
    # the other format complete beside it (repositories ship both indexes): that one is read
    args, sd = load_checkpoint(str(save_hf(hf_model("llama3"), tmp_path / "bin", "5.x")))
    torch.save(safe_load_file(tmp_path / "bin" / "model.safetensors"), path / "pytorch_model.bin")
    args2, sd2 = load_checkpoint(str(path))
    assert args2 == args and all(torch.equal(sd2[k], v) for k, v in sd.items())
    assert "model.safetensors.index.json names 1 weight files that are not in" in capsys.readouterr().out  # and says so


def test_hf_weight_files_as_transformers_reads_them(tmp_path):
    # a single file beside an older save's shards and index: transformers reads the single file, so must we
    new, old = hf_model("llama3", seed=1), hf_model("llama3", seed=0)
    path = save_hf(new, tmp_path / "hf", "5.x")
    old.save_pretrained(tmp_path / "old", max_shard_size="20KB")
    shards = sorted(n for n in os.listdir(tmp_path / "old") if n.startswith("model-"))
    assert len(shards) > 2
    for n in shards + ["model.safetensors.index.json"]:
        (path / n).write_bytes((tmp_path / "old" / n).read_bytes())
    args, sd = load_checkpoint(str(path))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert max_err(nanotune_logits(args, sd), hf_logits(ref)) < 1e-4
    assert max_err(hf_logits(ref), hf_logits(old)) > 1  # the stale shards are another model
    # shards without their index: which of them make the model is not known, so refused, as transformers does
    os.remove(path / "model.safetensors")
    os.remove(path / "model.safetensors.index.json")
    with pytest.raises(ValueError, match=r"holds weight shards \(model-00001-of-.*\) without the index") as e:
        load_checkpoint(str(path))
    assert "\n" not in str(e.value)
    # an index whose shards hold one tensor twice: two saves mixed, refused rather than one silently kept
    index = json.loads((tmp_path / "old" / "model.safetensors.index.json").read_text())
    first = index["weight_map"]["model.embed_tokens.weight"]
    index["weight_map"]["model.norm.weight"] = first
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "model-99999-of-99999.safetensors").write_bytes((path / first).read_bytes())
    index["weight_map"]["model.embed_tokens.weight"] = "model-99999-of-99999.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"holds 1 tensors that an earlier weight file .* holds too "
                                         r"\(e.g. model.embed_tokens.weight\): the directory mixes two saves"):
        load_checkpoint(str(path))


def test_meta_scaled_rope(tmp_path):
    # Meta's use_scaled_rope is transformers' llama3 type with factor 8, low 1, high 4, context 8192
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**BASE, "intermediate_size": 256}, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_parameters=rope))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_((1.0 if p.ndim == 1 else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
    params = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, multiple_of=256, norm_eps=1e-5,
                  rope_theta=500000.0, use_scaled_rope=True)
    path = tmp_path / "meta"
    path.mkdir()
    torch.save(hf_to_meta(hf.state_dict(), ModelArgs(dim=64, n_heads=4, n_kv_heads=2)), path / "consolidated.00.pth")
    (path / "params.json").write_text(json.dumps(params))
    args, sd = load_checkpoint(str(path))
    assert args.rope_scaling == (8.0, 1.0, 4.0, 8192) and not args.tie_embeddings
    assert args.max_seq_len == 131072  # Llama 3.1's context: params.json leaves it to the caller
    (path / "params.json").write_text(json.dumps({k: v for k, v in params.items() if k != "use_scaled_rope"}))
    assert load_checkpoint(str(path), weights=False)[0].max_seq_len == 8192  # Llama 3's
    (path / "params.json").write_text(json.dumps(params))
    assert max_err(nanotune_logits(args, sd), hf_logits(hf.eval())) <= 1e-4
    params["quantization_args"] = {"group_size": 32}  # Meta's QAT releases: not plain weights
    (path / "params.json").write_text(json.dumps(params))
    with pytest.raises(ValueError, match=r"params.json has quantization_args=.*which nanotune does not implement"):
        load_checkpoint(str(path))


def test_meta_llama32_scaled_rope_is_factor_32(tmp_path):
    # Meta's Llama 3.2 1B/3B params.json says use_scaled_rope alone, and its code hard-codes factor 8;
    # these tied models were trained with 32 (their config.json), which the loader gives them
    args, sd = load_checkpoint(str(save_hf(hf_model("llama3.2"), tmp_path / "hf", "5.x")))
    assert args.tie_embeddings and args.rope_scaling[0] == 32.0
    args.rope_original_max_seq_len = 8192  # the real models' (the tiny one's context is shorter)
    export_meta(sd, args, tmp_path / "meta")
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    (tmp_path / "meta" / "params.json").write_text(json.dumps({k: v for k, v in params.items() if not k.startswith("rope_")
                                                                or k == "rope_theta"}))
    args2, sd2 = load_checkpoint(str(tmp_path / "meta"))
    assert args2.rope_scaling == (32.0, 1.0, 4.0, 8192) and torch.equal(nanotune_logits(args2, sd2), nanotune_logits(args, sd))
    # converters that leave a tied model's output.weight out: tied all the same, and factor 32
    shard = torch.load(tmp_path / "meta" / "consolidated.00.pth")
    del shard["output.weight"]
    torch.save(shard, tmp_path / "meta" / "consolidated.00.pth")
    args3, sd3 = load_checkpoint(str(tmp_path / "meta"))
    assert args3 == args2 and torch.equal(nanotune_logits(args3, sd3), nanotune_logits(args, sd))
    # a tied model with Meta's factor 8 says so in its export, and reads back with 8
    args.rope_scaling_factor = 8.0
    export_meta(sd, args, tmp_path / "meta8")
    assert load_checkpoint(str(tmp_path / "meta8"))[0].rope_scaling == (8.0, 1.0, 4.0, 8192)
    # so does an untied one whose output still equals its embedding (read back tied, the same logits)
    untied = replace(args, tie_embeddings=False)
    export_meta({**sd, "output.weight": sd["tok_embeddings.weight"].clone()}, untied, tmp_path / "untied")
    args4, sd4 = load_checkpoint(str(tmp_path / "untied"))
    assert args4.rope_scaling == (8.0, 1.0, 4.0, 8192) and torch.equal(nanotune_logits(args4, sd4), nanotune_logits(args, sd))


def test_export_meta_round_trip_keeps_scaling_and_tie(tmp_path):
    args, sd = load_checkpoint(str(save_hf(hf_model("llama3.2"), tmp_path / "hf", "5.x")))
    export_meta(sd, args, tmp_path / "meta", provenance={"kind": "test"})
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    assert params["use_scaled_rope"] and params["rope_scaling_factor"] == 32.0 and params["head_dim"] == 32
    saved = torch.load(tmp_path / "meta" / "consolidated.00.pth", weights_only=True)
    assert torch.equal(saved["output.weight"], saved["tok_embeddings.weight"])  # Meta's 3.2 layout keeps both names
    args2, sd2 = load_checkpoint(str(tmp_path / "meta"))
    assert args2.tie_embeddings and args2.rope_scaling == args.rope_scaling and args2.head_dim == 32
    assert torch.equal(nanotune_logits(args2, sd2), nanotune_logits(args, sd))
    assert load_provenance(str(tmp_path / "meta")) == {"kind": "test", "max_seq_len": args.max_seq_len}
    assert args2.max_seq_len == args.max_seq_len


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1 8B/70B/405B; Llama 3.2 1B/3B
def test_rope_frequencies_of_real_llama3_configs(factor):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                                   rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=factor,
                                                        low_freq_factor=1.0, high_freq_factor=4.0,
                                                        original_max_position_embeddings=8192))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    cos, sin = rope_tables(128, 2, 500000.0, scaling=(factor, 1.0, 4.0, 8192))
    ours = torch.atan2(sin[1], cos[1])  # position 1's angles are the frequencies themselves
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    cos, sin = rope_tables(128, 2, 500000.0)
    plain = torch.atan2(sin[1], cos[1])
    assert (ours < plain).sum() > 0 and (ours == plain).sum() > 0  # some stretched, some kept


@pytest.mark.parametrize("kind", ["sentencepiece", "sentencepiece-dummy-prefix", "sentencepiece-map-bos", "tiktoken",
                                  "sentencepiece-llama-class", "sentencepiece-dummy-prefix-llama-class",
                                  "sentencepiece-names-only", "sentencepiece-add-eos"])
def test_export_hf_tokenizer_model_encodes_in_transformers_as_in_training(tmp_path, kind, monkeypatch, capsys):
    # a tokenizer.model alone (data_prep's SentencePiece model, Llama 2's, Meta's Llama 3 tiktoken
    # file): the export adds the tokenizer_config.json without which AutoTokenizer drops the BOS
    # and, for tiktoken, the special tokens. A SentencePiece model's own config naming LlamaTokenizer
    # (which transformers 5 builds with a pipeline of its own: a space put before every text where the
    # model adds none) or saying legacy false (a leading space dropped) goes without them; one that
    # leaves add_bos_token unsaid (transformers 5: no BOS, where data_prep put one before every
    # document) or says add_eos_token (an EOS after every prompt) gets them said as the data holds them
    sys.path.insert(0, str(ROOT / "tests"))
    import sentencepiece as spm
    from data_prep import load_tokenizer
    from test_tokenizers import TEXTS, write_sentencepiece, write_tiktoken
    src = tmp_path / "tokenizer.model"
    # transformers reads a tiktoken file through tiktoken's cache, which is keyed by the path alone: an
    # earlier run's file at a reused pytest path would be read instead
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    if kind == "tiktoken":
        write_tiktoken(src)
    elif kind in ("sentencepiece", "sentencepiece-llama-class", "sentencepiece-names-only", "sentencepiece-add-eos"):
        write_sentencepiece(src)
    elif kind.startswith("sentencepiece-dummy-prefix"):  # as Llama 2's: a space put in front of every text
        spm.SentencePieceTrainer.train(sentence_iterator=iter("".join(TEXTS.values()).splitlines()), model_writer=open(src, "wb"),
                                       vocab_size=400, model_type="bpe", byte_fallback=True, add_dummy_prefix=True)
    else:  # a special_tokens_map.json beside the model names a BOS other than the model's own <s>
        from sentencepiece import sentencepiece_model_pb2 as pb
        proto = pb.ModelProto.FromString(write_sentencepiece(src).read_bytes())
        proto.pieces.add(piece="<|begin|>", score=0.0, type=pb.ModelProto.SentencePiece.USER_DEFINED)
        src.write_bytes(proto.SerializeToString())
        (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|begin|>"}))
    if kind.endswith("llama-class"):  # Llama 2's own config, less its add_bos_token (True when unsaid, to both sides)
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "legacy": False,
                                                                   "bos_token": "<s>", "eos_token": "</s>"}))
    elif kind.endswith(("names-only", "add-eos")):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                   **({"add_eos_token": True} if kind.endswith("eos") else {})}))
    ours = load_tokenizer(src)
    files = [str(p) for p in (src, tmp_path / "special_tokens_map.json", tmp_path / "tokenizer_config.json") if p.exists()]
    assert len(files) == 1 + (kind == "sentencepiece-map-bos" or kind.endswith(("llama-class", "names-only", "add-eos")))
    assert kind != "sentencepiece-map-bos" or ours.bos_id == len(proto.pieces) - 1
    args, sd = load_checkpoint(str(save_hf(hf_model("llama2"), tmp_path / "src", "5.x")))
    export_hf(sd, args, tmp_path / "out", tokenizer_files=files, bos_id=ours.bos_id, eos_id=ours.eos_id)
    out = capsys.readouterr().out
    assert ("without its tokenizer_class 'LlamaTokenizer', legacy False, with which" in out) == kind.endswith("llama-class")
    assert ("with add_eos_token False" in out) == kind.endswith("add-eos")
    if kind.endswith(("llama-class", "names-only", "add-eos")):
        assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text()) == {
            "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": False}
    if kind == "sentencepiece-map-bos":  # the config the export adds agrees with the map: which of the two files wins
        # differs across transformers versions (data_prep refuses them disagreeing)
        assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["bos_token"] == "<|begin|>"
    # readable by other users (a serving container), whatever mode safetensors writes its file with
    assert all(os.stat(tmp_path / "out" / n).st_mode & 0o777 == 0o644 for n in os.listdir(tmp_path / "out"))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    texts = [t for t in TEXTS.values() if "<|" not in t] + ["hello world", " a leading space", "x\n\ny"]
    for text in texts:  # (specials written in a text are text to data_prep, special tokens to transformers)
        assert hf(text).input_ids == [ours.bos_id] + ours.encode(text), text
    assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_id, ours.eos_id)
    assert hf.decode([ours.eos_id]) == ("<|end_of_text|>" if kind == "tiktoken" else "</s>")


def test_export_hf_tokenizer_json_with_llama_class_encodes_as_in_training(tmp_path, capsys):
    # Llama 2's HF folder: a tokenizer.json that always puts a space before a text (as SentencePiece
    # did), its config naming LlamaTokenizer with legacy false. transformers 5 builds that class's own
    # pipeline instead of the file's, which drops a text's leading space: the export goes without them
    sys.path.insert(0, str(ROOT / "tests"))
    import sentencepiece as spm
    from data_prep import load_tokenizer
    from test_tokenizers import TEXTS
    sp_dir, folder = tmp_path / "sp", tmp_path / "llama2"
    sp_dir.mkdir()
    spm.SentencePieceTrainer.train(sentence_iterator=iter("".join(TEXTS.values()).splitlines()),
                                   model_writer=open(sp_dir / "tokenizer.model", "wb"), vocab_size=400, model_type="bpe",
                                   byte_fallback=True, add_dummy_prefix=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False)  # as Llama 2's
    (sp_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    transformers.AutoTokenizer.from_pretrained(sp_dir).save_pretrained(folder)  # transformers' own conversion
    for name in os.listdir(folder):
        if name not in ("tokenizer.json", "tokenizer_config.json"):
            os.remove(folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer", "legacy": False}))
    ours = load_tokenizer(folder)
    assert ours.kind == "hf" and ours.bos_id == 1
    args, sd = load_checkpoint(str(save_hf(hf_model("llama2"), tmp_path / "src", "5.x")))
    export_hf(sd, args, tmp_path / "out", tokenizer_files=ours.files, bos_id=ours.bos_id, eos_id=ours.eos_id)
    assert "without its tokenizer_class 'LlamaTokenizer', legacy False, with which" in capsys.readouterr().out
    assert "tokenizer_class" not in json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in [t for t in TEXTS.values() if "<" not in t] + ["hello world", " a leading space", "  two"]:
        assert hf(text).input_ids == [ours.bos_id] + ours.encode(text), text
    # the source folder as it was: transformers 5 encodes a leading space otherwise than the data
    source = transformers.AutoTokenizer.from_pretrained(folder)
    assert source(" a leading space").input_ids != [ours.bos_id] + ours.encode(" a leading space")
    # a class that reads the tokenizer.json as it is (Llama 3's) stays, legacy and all
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast", "legacy": False}))
    export_hf(sd, args, tmp_path / "out3", tokenizer_files=ours.files, bos_id=ours.bos_id, eos_id=ours.eos_id)
    assert "tokenizer_config.json written" not in capsys.readouterr().out
    assert (tmp_path / "out3" / "tokenizer_config.json").read_text() == (folder / "tokenizer_config.json").read_text()
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out3")(" a leading space").input_ids == \
        [ours.bos_id] + ours.encode(" a leading space")
