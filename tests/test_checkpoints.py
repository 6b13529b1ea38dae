import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checkpoint import (  # noqa: E402
    check_resume, checkpoint_digest, export_hf, export_meta, ffn_settings, load_adapter, load_checkpoint, remove_earlier_outputs, save_adapter,
    leave_mark, mark_wait, scales_without_state, sees_mark, set_aside_checkpoint, source_stop_ids, stop_ids,
)
from model import PRESETS, ModelArgs, Transformer, merge_lora  # noqa: E402

TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))


def toy_args(**kw):
    return ModelArgs(**{**PRESETS["toy"], "vocab_size": 64, **kw})


def build(args, seed=0):
    model = Transformer(args)
    model.init_weights(seed)
    # norms start at 1 and lora_b at 0, which would hide a mix-up of their names
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim == 1 or n.endswith("lora_b"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


@torch.no_grad()
def logits_of(args, state_dict):
    model = Transformer(args)
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model.eval()(TOKENS)


def same_shape_args(a, b):
    for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "norm_eps", "rope_theta",
              "tie_embeddings"):
        assert getattr(a, f) == getattr(b, f), f


def hf_reference_logits(sd, cfg, tokens):
    """Llama as transformers computes it: rotate_half RoPE on q/k rows in HF's order, GQA by
    repeating each kv head, explicit causal softmax. Written independently of model.py."""
    D, H, KV, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    hd, (B, T) = D // H, tokens.shape
    inv_freq = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    emb = torch.outer(torch.arange(T).float(), inv_freq).repeat(1, 2)  # (T, hd): cat(freqs, freqs)
    cos, sin = emb.cos(), emb.sin()

    def rotate_half(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat((-x2, x1), -1)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    x = sd["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        w = {k.removeprefix(f"model.layers.{i}."): v for k, v in sd.items() if k.startswith(f"model.layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"])
        q = (h @ w["self_attn.q_proj.weight"].T).view(B, T, H, hd).transpose(1, 2)
        k = (h @ w["self_attn.k_proj.weight"].T).view(B, T, KV, hd).transpose(1, 2)
        v = (h @ w["self_attn.v_proj.weight"].T).view(B, T, KV, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        x = x + (att @ v).transpose(1, 2).reshape(B, T, D) @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"])
        gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return rms(x, sd["model.norm.weight"]) @ head.T


def test_meta_round_trip(tmp_path):
    args = toy_args(max_seq_len=4096)
    model = build(args)
    export_meta(model.state_dict(), args, tmp_path / "meta")
    args2, sd = load_checkpoint(str(tmp_path / "meta"))
    same_shape_args(args, args2)
    assert args2.max_seq_len == 4096  # kept in nanotune.json: not a params.json key Meta's loader accepts
    assert "max_seq_len" not in json.loads((tmp_path / "meta" / "params.json").read_text())
    assert torch.equal(logits_of(args2, sd), model(TOKENS))
    # exporting again replaces the directory and leaves no temp directories behind
    export_meta(model.state_dict(), args, tmp_path / "meta")
    assert sorted(os.listdir(tmp_path)) == ["meta"]


def test_meta_two_shards(tmp_path):
    # split as Meta's model-parallel layers do: column-parallel on dim 0, row-parallel and the
    # embedding on dim 1, norms replicated; plus the rope.freqs buffer and vocab_size -1
    args = toy_args()
    model = build(args)
    column, row = ("wq", "wk", "wv", "w1", "w3", "output"), ("wo", "w2", "tok_embeddings")
    shards = [{"rope.freqs": torch.zeros(8)}, {"rope.freqs": torch.zeros(8)}]
    for k, v in model.state_dict().items():
        name = k.split(".")[-2]
        parts = v.chunk(2, 0) if name in column else v.chunk(2, 1) if name in row else (v, v)
        for shard, part in zip(shards, parts):
            shard[k] = part.clone()
    d = tmp_path / "meta2"
    d.mkdir()
    for i, shard in enumerate(shards):
        torch.save(shard, d / f"consolidated.{i:02d}.pth")
    params = {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "norm_eps")}
    (d / "params.json").write_text(json.dumps({**params, "vocab_size": -1}))
    # Llama 1 and 2 files do not say their context (2048, 4096), and cannot be told apart: refused until told
    with pytest.raises(ValueError, match=r"does not say the model's context length.*max_seq_len.*nanotune\.json"):
        load_checkpoint(str(d))
    (d / "nanotune.json").write_text(json.dumps({"max_seq_len": 4096}))
    args2, sd = load_checkpoint(str(d))
    assert args2.vocab_size == 64 and "rope.freqs" not in sd and args2.max_seq_len == 4096
    assert torch.equal(logits_of(args2, sd), model(TOKENS))


def test_hf_round_trip_and_reference(tmp_path):
    # GQA and a SwiGLU size (100) no multiple_of=256 rule would give
    args = toy_args(n_heads=8, n_kv_heads=2, **ffn_settings(64, 100))
    assert args.hidden_dim == 100
    model = build(args)
    export_hf(model.state_dict(), args, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["intermediate_size"] == 100 and cfg["num_key_value_heads"] == 2 and cfg["torch_dtype"] == "float32"
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], model.layers[0].attention.wq.weight)
    # the HF layout of the weights, run as transformers runs it, gives the Meta layout's logits
    ref = hf_reference_logits(hf, cfg, TOKENS)
    torch.testing.assert_close(ref, model(TOKENS), atol=1e-5, rtol=1e-5)
    args2, sd = load_checkpoint(str(tmp_path / "hf"))
    same_shape_args(args, args2)
    assert args2.max_seq_len == args.max_seq_len
    assert torch.equal(logits_of(args2, sd), model(TOKENS))


@pytest.mark.parametrize("tied", [False, True])
def test_hf_directory_not_written_by_nanotune(tmp_path, tied):
    # random weights in HF's layout straight from a config: loading must undo the permutation
    # on its own, not merely invert export_hf
    cfg = dict(model_type="llama", hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
               intermediate_size=77, vocab_size=50, rms_norm_eps=1e-6, rope_theta=500.0,
               max_position_embeddings=64, tie_word_embeddings=tied)
    gen = torch.Generator().manual_seed(3)
    shapes = {"model.embed_tokens.weight": (50, 48), "model.norm.weight": (48,)}
    if not tied:
        shapes["lm_head.weight"] = (50, 48)
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (48, 48), p + "self_attn.k_proj.weight": (24, 48),
                       p + "self_attn.v_proj.weight": (24, 48), p + "self_attn.o_proj.weight": (48, 48),
                       p + "mlp.gate_proj.weight": (77, 48), p + "mlp.up_proj.weight": (77, 48),
                       p + "mlp.down_proj.weight": (48, 77), p + "input_layernorm.weight": (48,),
                       p + "post_attention_layernorm.weight": (48,)})
    hf = {k: (1.0 if len(s) == 1 else 0.0) + 0.1 * torch.randn(s, generator=gen) for k, s in shapes.items()}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(hf, tmp_path / "model.safetensors")
    args, sd = load_checkpoint(str(tmp_path))
    assert args.hidden_dim == 77 and args.n_kv_heads == 3 and args.tie_embeddings == tied
    tokens = TOKENS % 50
    model = Transformer(args)
    model.load_state_dict(sd, strict=True, assign=True)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_reference_logits(hf, cfg, tokens), atol=1e-5, rtol=1e-5)


def test_hf_pytorch_model_bin(tmp_path):
    args = toy_args()
    model = build(args)
    export_hf(model.state_dict(), args, tmp_path / "hf")
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # old transformers saved it
    torch.save(hf, tmp_path / "hf" / "pytorch_model.bin")
    os.remove(tmp_path / "hf" / "model.safetensors")
    args2, sd = load_checkpoint(str(tmp_path / "hf"))
    assert torch.equal(logits_of(args2, sd), model(TOKENS))


def test_tied_embeddings(tmp_path):
    args = toy_args(tie_embeddings=True)
    model = build(args)
    export_hf(model.state_dict(), args, tmp_path / "hf")
    assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")
    args2, sd = load_checkpoint(str(tmp_path / "hf"))
    assert args2.tie_embeddings
    assert torch.equal(logits_of(args2, sd), model(TOKENS))


@pytest.mark.parametrize("dim", [48, 64, 2048, 4096, 5120, 8192])
def test_ffn_settings(dim):
    for hidden in [*range(2, 4 * dim, 7), 11008, 13824, 14336, 28672, 5632]:
        assert ModelArgs(dim=dim, n_heads=1, **ffn_settings(dim, hidden)).hidden_dim == hidden
    assert ffn_settings(4096, 11008) == dict(multiple_of=256, ffn_dim_multiplier=None)  # llama2-7b as Meta has it


def test_nanotune_checkpoint(tmp_path):
    args = toy_args(lora_rank=4, lora_targets=("wq", "w2"))
    model = build(args)
    ckpt = {"model": model.state_dict(), "model_args": asdict(args), "iter_num": 7, "config": {"lr": 1e-3},
            "rng": torch.get_rng_state(), "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3}]}}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    for path in (tmp_path, tmp_path / "ckpt.pt"):
        args2, sd = load_checkpoint(str(path))
        assert args2 == args
        assert torch.equal(logits_of(args2, sd), model(TOKENS))
    # another version's field, which could change the model this one would build: refused, not dropped
    torch.save({**ckpt, "model_args": {**asdict(args), "qk_norm": True}}, tmp_path / "newer.pt")
    with pytest.raises(ValueError, match=r"newer\.pt: its model_args hold qk_norm=True, which this version"):
        load_checkpoint(str(tmp_path / "newer.pt"))
    torch.save({**ckpt, "config": {"obj": object()}}, tmp_path / "unsafe.pt")
    with pytest.raises(ValueError, match="plain Python values"):
        load_checkpoint(str(tmp_path / "unsafe.pt"))


def test_checkpoint_digest(tmp_path):
    # a teacher's identity: its bytes, sampled; a run's out_dir is its ckpt.pt, not the logs and outputs beside it
    torch.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, tmp_path / "ckpt.pt")
    digest = checkpoint_digest(str(tmp_path))
    (tmp_path / "log.jsonl").write_text("{}\n")
    assert checkpoint_digest(str(tmp_path)) == digest == checkpoint_digest(str(tmp_path / "ckpt.pt"))
    torch.save({"w": torch.arange(1 << 20, dtype=torch.float32) + 1}, tmp_path / "ckpt.pt")  # retrained in place
    assert checkpoint_digest(str(tmp_path)) != digest


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    for path in (tmp_path, tmp_path / "missing", tmp_path / "notes.txt"):
        with pytest.raises(ValueError, match=r"init_from=.* is neither a nanotune checkpoint nor a Meta"):
            load_checkpoint(str(path))
    # Mistral's own layout: params.json beside consolidated.safetensors, which is not read
    (tmp_path / "params.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has a params.json but no consolidated.NN.pth weights \(Mistral's"):
        load_checkpoint(str(tmp_path))


def test_lora_export_merges(tmp_path):
    args = toy_args(lora_rank=4, lora_targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output"))
    model = build(args)
    with torch.no_grad():
        lora_logits = model(TOKENS)
        plain_logits = logits_of(toy_args(), merge_lora(model.state_dict(), args))
    assert not torch.allclose(lora_logits, logits_of(toy_args(), {
        k.replace(".base.", "."): v for k, v in model.state_dict().items() if "lora" not in k}), atol=1e-3)
    torch.testing.assert_close(plain_logits, lora_logits, atol=1e-5, rtol=0)
    for export in (export_meta, export_hf):
        export(model.state_dict(), args, tmp_path / export.__name__)
        args2, sd = load_checkpoint(str(tmp_path / export.__name__))
        assert args2.lora_rank == 0
        torch.testing.assert_close(logits_of(args2, sd), lora_logits, atol=1e-5, rtol=0)


def test_adapter_round_trip(tmp_path):
    args = toy_args(lora_rank=4, lora_alpha=8.0, lora_dropout=0.05, lora_targets=("wq", "wk", "wv", "output"))
    model = build(args)
    sd = model.state_dict()
    save_adapter(sd, args, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg == {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8.0, "lora_dropout": 0.05,
                   "target_modules": ["k_proj", "lm_head", "q_proj", "v_proj"], "bias": "none"}
    peft = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert {"base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight",
            "base_model.model.lm_head.lora_B.weight"} <= set(peft)
    assert len(peft) == 2 * (3 * args.n_layers + 1)
    # PEFT semantics: HF base weight + scale * B @ A equals the HF export of the merged model
    export_hf(sd, args, tmp_path / "merged")
    export_hf({k.replace(".base.", "."): v for k, v in sd.items() if "lora" not in k}, args, tmp_path / "base")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    base = load_file(tmp_path / "base" / "model.safetensors")
    for m in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "lm_head"):
        a, b = peft[f"base_model.model.{m}.lora_A.weight"], peft[f"base_model.model.{m}.lora_B.weight"]
        torch.testing.assert_close(base[m + ".weight"] + 8.0 / 4 * b @ a, merged[m + ".weight"], atol=1e-6, rtol=0)
    settings, adapter = load_adapter(tmp_path / "adapter", args)
    assert settings == dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.05, lora_targets=args.lora_targets)
    expected = {k: v for k, v in sd.items() if k.endswith(("lora_a", "lora_b"))}
    assert adapter.keys() == expected.keys()
    assert all(torch.equal(adapter[k], expected[k]) for k in expected)
    # a PEFT adapter on some layers alone, with biases or with whole modules saved is another model: refused
    cfg_path = tmp_path / "adapter" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    for odd, says in ((dict(layers_to_transform=[0]), "layers_to_transform=[0]"), (dict(bias="lora_only"), "bias='lora_only'"),
                      (dict(modules_to_save=["lm_head"]), "modules_to_save=['lm_head']")):
        cfg_path.write_text(json.dumps({**cfg, **odd}))
        with pytest.raises(ValueError, match=re.escape(says) + r", which nanotune's LoRA does not implement"):
            load_adapter(tmp_path / "adapter", args)


def test_meta_tied_layout(tmp_path):
    # Meta's Llama 3.2 files hold output.weight as a copy of the embedding: loaded tied, exported
    # the same way; an untied model whose output happens to share the embedding's first row is not
    args = toy_args(tie_embeddings=True)
    model = build(args)
    sd = {k: v.clone() for k, v in model.state_dict().items()}  # two separate copies, as in Meta's file
    d = tmp_path / "meta"
    d.mkdir()
    torch.save(sd, d / "consolidated.00.pth")
    params = {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
                                            "max_seq_len")}
    (d / "params.json").write_text(json.dumps(params))
    args2, sd2 = load_checkpoint(str(d))
    assert args2.tie_embeddings and sd2["output.weight"] is sd2["tok_embeddings.weight"]
    assert torch.equal(logits_of(args2, sd2), model(TOKENS))
    for weights in (True, False):  # every rank must reach the same args, with or without the weights
        assert load_checkpoint(str(d), weights=weights)[0] == args2
    sd["output.weight"][1:] += 1.0
    torch.save(sd, d / "consolidated.00.pth")
    assert not load_checkpoint(str(d))[0].tie_embeddings


def test_meta_params_refusals_and_mistral_layout(tmp_path):
    args = toy_args(n_kv_heads=2, sliding_window=16)
    model = build(args)
    d = tmp_path / "meta"
    d.mkdir()
    torch.save(model.state_dict(), d / "consolidated.00.pth")
    # Mistral's params.json: head_dim, hidden_dim and sliding_window, no multiple_of
    params = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=args.hidden_dim, norm_eps=1e-5,
                  sliding_window=16, vocab_size=64, rope_theta=10000.0, max_seq_len=args.max_seq_len)
    (d / "params.json").write_text(json.dumps(params))
    args2, sd = load_checkpoint(str(d))
    assert args2.sliding_window == 16 and args2.hidden_dim == args.hidden_dim
    assert torch.equal(logits_of(args2, sd), model(TOKENS))
    for change, message in [(dict(moe={"num_experts": 8}), r"params.json has moe=\{'num_experts': 8\}, which nanotune"),
                            (dict(hidden_dim=args.hidden_dim + 2), r"gives a SwiGLU size of \d+ but the weights have"),
                            (dict(rope_theta=None), r"Mistral's layout but has no rope_theta"),
                            (dict(rope_scaling_factor=32.0), r"without use_scaled_rope=true"),
                            (dict(head_dim=8), r"wk.weight of shape \(32, 64\), but its settings imply \(16, 64\)")]:
        p = {k: v for k, v in {**params, **change}.items() if v is not None}
        (d / "params.json").write_text(json.dumps(p))
        with pytest.raises(ValueError, match=message):
            load_checkpoint(str(d))


def test_hf_config_inconsistent_with_weights(tmp_path):
    args = toy_args()
    export_hf(build(args).state_dict(), args, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    for change, message in [(dict(head_dim=8), r"k_proj.weight of shape \(32, 64\), but its settings imply \(16, 64\)"),
                            (dict(vocab_size=65), r"have lm_head.weight of shape \(64, 64\), but its settings imply"),
                            (dict(intermediate_size=100), r"gives a SwiGLU size of 100 but the weights have"),
                            (dict(num_hidden_layers=3), r"have no model.layers.2.self_attn.k_proj.weight, which")]:
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=message):
            load_checkpoint(str(tmp_path / "hf"))
    # tied, beside an lm_head unlike the embedding: transformers 4 drops it, 5 keeps it; refused
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="tie_word_embeddings true, yet the weights hold an lm_head.weight"):
        load_checkpoint(str(tmp_path / "hf"))


def test_export_refuses_missing_tokenizer_file(tmp_path):
    args = toy_args()
    for export, own_file in ((export_hf, "config.json"), (export_meta, "params.json")):
        with pytest.raises(ValueError, match=r"tokenizer file '.*nope.model' does not exist"):
            export(build(args).state_dict(), args, tmp_path / "out", tokenizer_files=[str(tmp_path / "nope.model")])
        (tmp_path / own_file).write_text("{}")
        with pytest.raises(ValueError, match=r"has the name of a file the export writes itself"):
            export(build(args).state_dict(), args, tmp_path / "out", tokenizer_files=[str(tmp_path / own_file)])
    assert sorted(os.listdir(tmp_path)) == ["config.json", "params.json"]  # nothing half-written


def test_exports_reach_the_disk_before_they_are_renamed_into_place(tmp_path, monkeypatch):
    # each file and the directory flushed before the rename, and the rename itself after it: a power
    # cut leaves the old export or the whole new one, never one of empty files
    events, fsync, rename = [], os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or fsync(fd))
    monkeypatch.setattr(os, "rename", lambda a, b: events.append(("rename", str(b))) or rename(a, b))
    args = toy_args()
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    for export, name in ((export_hf, "hf"), (export_meta, "meta")):
        events.clear()
        export(build(args).state_dict(), args, tmp_path / name, tokenizer_files=[str(tmp_path / "chat_template.jinja")])
        done = events.index(("rename", str(tmp_path / name)))
        flushed = {os.path.basename(p) for kind, p in events[:done] if kind == "fsync"}
        assert flushed >= set(os.listdir(tmp_path / name)) and any(b.startswith(f".{name}.tmp") for b in flushed)
        assert ("fsync", str(tmp_path)) in events[done:]


def test_killed_runs_temp_files_go_only_when_out_dir_is_locked_and_not_an_input(tmp_path, capsys):
    for name in ("ckpt.pt.tmp", ".export_hf.tmpab", "ckpt.tmp"):
        (tmp_path / name).mkdir() if name != "ckpt.pt.tmp" else (tmp_path / name).write_bytes(b"half")
    remove_earlier_outputs(tmp_path, (), locked=False)  # no lock: they may be another run's, mid-write
    assert capsys.readouterr().out == "" and len(os.listdir(tmp_path)) == 3
    remove_earlier_outputs(tmp_path, (str(tmp_path / "ckpt.tmp"),), locked=True)  # this run's input stays
    assert sorted(os.listdir(tmp_path)) == ["ckpt.tmp"]
    assert capsys.readouterr().out.count("an unfinished write of a run that was killed") == 2


def test_set_aside_checkpoint_keeps_this_runs_input(tmp_path):
    # a sharded directory goes aside like a file; a checkpoint this run starts from stays, and so does
    # everything in an out_dir given as init_from itself
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "state.pt").write_bytes(b"shards")
    (tmp_path / "ckpt.pt").write_bytes(b"weights")
    set_aside_checkpoint(tmp_path, (str(tmp_path / "ckpt.pt"),))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.prev", "ckpt.pt"] and (tmp_path / "ckpt.prev" / "state.pt").exists()
    (tmp_path / "ckpt").mkdir()
    set_aside_checkpoint(tmp_path, (str(tmp_path),))
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.prev", "ckpt.pt"]
    # a set-aside checkpoint as this run's input: the run's first save would remove it
    for given in (tmp_path / "ckpt.prev", tmp_path / "ckpt.prev" / "state.pt"):
        with pytest.raises(ValueError, match=r"this run reads .*ckpt.prev, an earlier run.s checkpoint set aside"):
            set_aside_checkpoint(tmp_path, (str(given),))
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.prev", "ckpt.pt"]  # nothing moved


DATA = {"data": {"train.bin": {"bytes": 1024}}}  # what a checkpoint and the data's meta.json record of the data


@pytest.mark.parametrize("theirs, ours, asked, says", [
    # the decay's steps are lr_decay_iters where either run sets it: max_iters alone does not change them
    ({"lr_decay_iters": 1000}, {"max_iters": 800}, {"max_iters"}, "refused: lr_decay_iters=1000, and this run has the default (lr_decay_iters=0)"),
    ({"lr_decay_iters": 1000}, {"max_iters": 800, "lr_decay_iters": 1000}, {"max_iters", "lr_decay_iters"}, ""),
    ({}, {"max_iters": 800}, {"max_iters"}, "max_iters 500 -> 800"),  # lr_decay_iters 0: max_iters decides
    ({}, {"max_iters": 800}, set(), "refused: max_iters=500, and this run has the default (max_iters=800)"),
    ({}, {"lr_decay_iters": 500}, {"lr_decay_iters"}, ""),  # the same decay, said otherwise
    ({}, {"lr_decay_iters": 800}, {"lr_decay_iters"}, "lr_decay_iters 0 -> 800"),
    ({"learning_rate": 2e-3}, {}, set(), "refused: learning_rate=0.002, and this run has the default (learning_rate=0.001)"),
    ({"learning_rate": 2e-3, "min_lr": 0}, {}, {"learning_rate", "min_lr"}, "learning_rate 0.002 -> 0.001; min_lr 0 -> 0.0001"),
    # the optimizer's settings and the precision likewise; a setting this script does not have is not compared
    ({"beta2": 0.99, "range_lr_ratio": 0.01}, {}, set(), "refused: beta2=0.99, range_lr_ratio=0.01, and this run has the defaults (beta2=0.95, range_lr_ratio=1.0)"),
    ({"dtype": "bfloat16"}, {}, set(), "refused: dtype='bfloat16', and this run has the default (dtype='float32')"),
    ({"weight_decay": 0.0}, {}, {"weight_decay"}, "weight_decay 0.0 -> 0.1"),
    ({"optimizer_in_bwd": True}, {}, set(), ""),
])
def test_resume_changes_the_schedule_only_when_asked(theirs, ours, asked, says):
    base = {"learning_rate": 1e-3, "min_lr": 1e-4, "warmup_iters": 10, "lr_decay_iters": 0, "max_iters": 500,
            "weight_decay": 0.1, "beta2": 0.95, "range_lr_ratio": 1.0, "dtype": "float32"}
    try:
        said = check_resume({"config": {**base, **theirs}, "script": "qat_train.py", **DATA}, {**base, **ours}, (), DATA, "ckpt.pt",
                            "qat_train.py", asked=asked)
    except ValueError as e:
        said = f"refused: {str(e).removeprefix('ckpt.pt was trained with ')}"
    assert said.startswith(says) and bool(said) == bool(says)


def test_sharded_resume_keeps_optimizer_in_bwd(tmp_path):
    # a sharded checkpoint's optimizer state is laid out per optimizer_in_bwd: DCP cannot map one
    # onto the other (it stopped with a traceback on every rank), so a switch is refused in one line
    (tmp_path / "ckpt").mkdir()
    for name in ("state.pt", ".metadata"):
        (tmp_path / "ckpt" / name).write_bytes(b"")
    config = {"learning_rate": 1e-3, "min_lr": 1e-4, "warmup_iters": 10, "lr_decay_iters": 0, "max_iters": 500,
              "optimizer_in_bwd": True}
    ckpt = {"config": config, "script": "qat_train.py", "iter_num": 5, **DATA}
    with pytest.raises(ValueError, match=r"optimizer state of optimizer_in_bwd=True, which a sharded checkpoint cannot "
                                         r"hand to optimizer_in_bwd=False; resume with optimizer_in_bwd=True$"):
        check_resume(ckpt, {**config, "optimizer_in_bwd": False}, (), DATA, str(tmp_path), "qat_train.py",
                     asked={"optimizer_in_bwd"})
    # a single file maps it: the switch is allowed there, when asked
    assert check_resume(ckpt, {**config, "optimizer_in_bwd": False}, (), DATA, "ckpt.pt", "qat_train.py",
                        asked={"optimizer_in_bwd"}) == "optimizer_in_bwd True -> False"


def test_a_resume_too_close_to_its_end_to_profile_is_refused():
    # the profiler counts the steps of this process, not of the run: resumed at step 495 of 500, a
    # run has 5 steps where the trace needs 10, and would write none without a word
    config = {"learning_rate": 1e-3, "min_lr": 1e-4, "warmup_iters": 10, "lr_decay_iters": 0, "max_iters": 500,
              "profile": True, "profile_wait": 5, "profile_warmup": 2, "profile_active": 3}
    ckpt = {"config": config, "script": "qat_train.py", "iter_num": 495, **DATA}
    with pytest.raises(ValueError, match=r"records steps 502 to 504 of a run resumed at step 495 .* past "
                                         r"max_iters=500: no trace would be written"):
        check_resume(ckpt, config, (), DATA, "ckpt.pt", "qat_train.py", asked=set())
    assert check_resume({**ckpt, "iter_num": 490}, config, (), DATA, "ckpt.pt", "qat_train.py", asked=set()) == ""
    assert check_resume(ckpt, {**config, "profile": False}, (), DATA, "ckpt.pt", "qat_train.py", asked=set()) == ""


def test_stop_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert source_stop_ids(str(tmp_path), None) == [7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))  # it wins, as in transformers
    assert source_stop_ids(str(tmp_path), None) == [9, 7] and source_stop_ids("ckpt.pt", {"stop_ids": [3]}) == [3]
    assert source_stop_ids(str(tmp_path / "nowhere"), None) == [] and source_stop_ids(str(tmp_path), {"iter_num": 1}) == []
    # a checkpoint from before stop ids were recorded: its source's; an export of ours: its nanotune.json's
    assert source_stop_ids("ckpt.pt", {"config": {"init_from": str(tmp_path)}}) == [9, 7]
    (tmp_path / "nanotune.json").write_text(json.dumps({"stop_ids": [4]}))
    assert source_stop_ids(str(tmp_path), None) == [4]
    plain = {"eos_id": 2, "vocab_size": 300, "tokenizer": {"kind": "sentencepiece"}}
    assert stop_ids(plain, []) == 2 and stop_ids(plain, [9, 2]) == [2, 9] and stop_ids({}, []) is None
    # Llama 3's tiktoken tokenizer: where Meta's code stops, end of text, of a tool call (eom) and of a turn (eot)
    tiktoken = {"eos_id": 128001, "vocab_size": 128256, "tokenizer": {"kind": "tiktoken"}}
    assert stop_ids(tiktoken, [128009]) == [128001, 128008, 128009]


def test_two_sharded_saves_of_the_same_step_differ_in_state_pt(tmp_path):
    # processes compare a sharded checkpoint by its state.pt: two saves of one step, config and seed
    # (another node's copy of another run, say) must not read the same
    script = f"""
import sys, torch, torch.distributed as dist
sys.path.insert(0, {str(ROOT)!r})
from checkpoint import checkpoint_digest, save_training_checkpoint
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
digests = []
for run in ("a", "b"):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    save_training_checkpoint(model, [torch.optim.AdamW(model.parameters())], {{"iter_num": 3, "config": {{"seed": 1}}}},
                             {str(tmp_path)!r} + "/" + run, sharded=True)
    digests.append(checkpoint_digest({str(tmp_path)!r} + "/" + run + "/ckpt/state.pt"))
print(digests[0] != digests[1])
"""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "True"


def test_a_mark_is_seen_where_it_was_left(tmp_path, monkeypatch):
    name, error = leave_mark(str(tmp_path))
    assert error is None and os.listdir(tmp_path) == [name] and sees_mark(str(tmp_path), name, 0)
    assert leave_mark(str(tmp_path))[0] != name  # a name of its own each time
    (tmp_path / "other").mkdir()
    assert not sees_mark(str(tmp_path / "other"), name, 0)
    assert mark_wait() == 90
    monkeypatch.setenv("NANOTUNE_SHARED_WAIT", "2.5")
    assert mark_wait() == 2.5
    for bad in ("nan", "inf", "abc", "-1", "601"):  # a wait that never ends, or outlasts the process group's
        monkeypatch.setenv("NANOTUNE_SHARED_WAIT", bad)
        with pytest.raises(ValueError, match=f"NANOTUNE_SHARED_WAIT='{bad}' must be a number of seconds from 0 to 600"):
            mark_wait()
    # an error for every rank to print, not an exception on rank 0 alone
    assert leave_mark(str(tmp_path / "absent")) == (None, f"cannot write in {tmp_path / 'absent'} (No such file or "
                                                          f"directory); give this run a directory it can write")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in this one process
def test_scales_without_state_are_read_from_a_sharded_checkpoints_metadata(tmp_path):
    # a single file lists the optimizer's state; a sharded checkpoint's .metadata names every tensor
    import torch.distributed.checkpoint as dcp
    t, step = torch.ones(2), torch.zeros(())
    model = {"w": t, "a.learned_scale": t, "b.learned_scale": t}
    state = {"w": {"step": step, "exp_avg": t}, "b.learned_scale": {"step": step, "exp_avg": t}}
    assert scales_without_state({"model": model, "optimizer": {"state": state}}, "ckpt.pt") == ["a.learned_scale"]
    d = tmp_path / "ckpt"
    dcp.save({"model": model, "optimizer": {"state": state}}, checkpoint_id=d)
    torch.save({"iter_num": 1}, d / "state.pt")
    assert scales_without_state({"iter_num": 1}, str(d)) == ["a.learned_scale"]
    assert scales_without_state({"iter_num": 1}, str(tmp_path)) == ["a.learned_scale"]  # out_dir: its ckpt/
    state["a.learned_scale"] = {"step": step, "exp_avg": t}
    dcp.save({"model": model, "optimizer": {"state": state}}, checkpoint_id=tmp_path / "full")
    torch.save({"iter_num": 1}, tmp_path / "full" / "state.pt")
    assert scales_without_state({"iter_num": 1}, str(tmp_path / "full")) == []
