"""The forward path beyond one plain causal sequence: packed samples with document masking, the
sliding window (against transformers' Mistral), and generate with a KV cache."""

import logging
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model import IGNORE_INDEX, ModelArgs, Transformer  # noqa: E402

VOCAB = 61


def tiny_args(**kw):
    # widths divisible by 32, so that torchao's group size 32 fits every linear
    return ModelArgs(**{**dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=32,
                               max_seq_len=64), **kw})


@torch.no_grad()
def build(args, seed=0):
    # O(1) activations and uneven norm weights: init_weights' near-uniform logits hide mistakes
    model = Transformer(args)
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        else:
            scale = 1 if "tok_embeddings" in name else 1 / math.sqrt(p.shape[1])
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def tokens_for(B, T, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# document masking

@pytest.mark.parametrize("sliding_window", [None, 3])
def test_packed_sample_equals_sample_alone(sliding_window):
    model = build(tiny_args(sliding_window=sliding_window))
    # row 0 starts mid-sample (positions 4..8), then two whole samples; row 1 packs three others
    rows = [[(4, 5), (0, 7), (0, 4)], [(0, 3), (0, 6), (0, 7)]]
    tokens, input_pos, pieces = [], [], []
    for b, row in enumerate(rows):
        toks, pos = [], []
        for s, (first, n) in enumerate(row):
            t = tokens_for(1, n, seed=10 * b + s)[0]
            pieces.append((b, sum(len(x) for x in toks), t, torch.arange(first, first + n)))
            toks.append(t)
            pos.append(torch.arange(first, first + n))
        tokens.append(torch.cat(toks))
        input_pos.append(torch.cat(pos))
    tokens, input_pos = torch.stack(tokens), torch.stack(input_pos)  # (2, 16)
    assert tokens.shape == (2, 16)
    with torch.no_grad():
        logits = model(tokens, input_pos=input_pos)
        for b, offset, t, pos in pieces:
            n = len(t)
            alone = model(t[None], input_pos=pos[None])[0]
            torch.testing.assert_close(logits[b, offset:offset + n], alone, atol=1e-5, rtol=1e-5)
            # the loss of this sample's tokens only, every other target ignored
            targets = torch.full_like(tokens, IGNORE_INDEX)
            targets[b, offset:offset + n - 1] = t[1:]
            packed_loss = model(tokens, targets, input_pos=input_pos)
            alone_loss = model(t[None], targets[b:b + 1, offset:offset + n], input_pos=pos[None])
            assert abs(packed_loss.item() - alone_loss.item()) <= 1e-5
        # without the positions the samples see each other: the comparison above can fail
        assert not torch.allclose(model(tokens)[1, 3:9], model(tokens[1:, 3:9])[0], atol=1e-3)


def test_input_pos_arange_equals_none():
    model = build(tiny_args())
    tokens = tokens_for(2, 20)
    targets = tokens_for(2, 20, seed=1)
    pos = torch.arange(20).expand(2, 20)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, input_pos=pos), model(tokens), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.hidden(tokens, input_pos=pos), model.hidden(tokens), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(tokens, targets, input_pos=pos), model(tokens, targets), atol=1e-6, rtol=1e-6)


def test_input_pos_gradients_stay_within_samples():
    model = build(tiny_args())
    tokens = tokens_for(1, 10)
    input_pos = torch.cat((torch.arange(6), torch.arange(4)))[None]
    h = model.tok_embeddings(tokens).detach().requires_grad_()
    model.tok_embeddings.register_forward_hook(lambda module, args, out: h)  # h: the leaf we read grads of
    model(tokens, input_pos=input_pos)[0, 8].sum().backward()  # a token of the second sample
    assert h.grad[0, :6].abs().sum() == 0 and (h.grad[0, 6:9].abs().sum(-1) > 0).all()


# ---------------------------------------------------------------------------------------------
# sliding window against transformers' Mistral

HF_TO_META = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output",
              "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
              "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
              "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
              "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
              "post_attention_layernorm": "ffn_norm"}


def hf_to_nanotune(sd, args):
    out = {}
    for k, v in sd.items():
        k = k.removesuffix(".weight").replace("model.layers.", "layers.")
        for hf, meta in HF_TO_META.items():
            k = k.replace(hf, meta)
        heads = {"wq": args.n_heads, "wk": args.n_kv_heads}.get(k.rsplit(".", 1)[-1])
        if heads:  # HF keeps each head's even RoPE rows first, then the odd ones; Meta interleaves them
            v = v.unflatten(0, (heads, 2, -1)).transpose(1, 2).flatten(0, 2)
        out[k + ".weight"] = v
    return out


def test_sliding_window_matches_transformers_mistral():
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    window, T = 5, 24
    args = tiny_args(n_layers=3, sliding_window=window)
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=args.dim, intermediate_size=args.hidden_dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        sliding_window=window, tie_word_embeddings=False, attn_implementation="sdpa")
    hf = transformers.MistralForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # O(1) activations, as build() gives nanotune's models
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1 if "embed" in name else 1 / math.sqrt(p.shape[1])))
    ours = Transformer(args).eval()
    ours.load_state_dict(hf_to_nanotune(hf.state_dict(), args))
    tokens = tokens_for(2, T)
    with torch.no_grad():
        ref = hf(tokens).logits
        assert (ours(tokens) - ref).abs().max() <= 1e-4
        ours.args.sliding_window = None  # the window changes the logits: the comparison can fail
        assert (ours(tokens) - ref).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------
# generate with a KV cache

def convert_8da4w(model):
    logging.getLogger("torchao").setLevel(logging.ERROR)
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup, quantize_
    quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)))
    assert "torchao" in type(model.layers[0].attention.wq.weight).__module__
    return model


def module_state(model):
    # every attribute of every module: generate must leave none behind (no cache living on past it)
    return {name: sorted(vars(m)) for name, m in model.named_modules()}


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("sliding_window", [None, 4])
def test_cached_greedy_equals_uncached(quantized, batch, sliding_window):
    model = build(tiny_args(max_seq_len=40, sliding_window=sliding_window))
    if quantized:
        model = convert_8da4w(model)
    prompt = tokens_for(batch, 7)
    before = module_state(model)
    with torch.no_grad():
        logits = model(prompt)
    cached = model.generate(prompt, 20, temperature=0)
    uncached = model.generate(prompt, 20, temperature=0, use_cache=False)
    assert cached.shape == (batch, 27) and torch.equal(cached, uncached)
    assert module_state(model) == before
    with torch.no_grad():
        assert torch.equal(model(prompt), logits)


def forward_lengths(model, prompt, n, **kw):
    lengths = []
    hook = model.layers[0].register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    out = model.generate(prompt, n, temperature=0, **kw)
    hook.remove()
    return out, lengths


def test_cached_generate_runs_one_token_per_step():
    model = build(tiny_args())
    out, lengths = forward_lengths(model, tokens_for(1, 6), 5)
    assert lengths == [6, 1, 1, 1, 1]
    uncached, lengths = forward_lengths(model, tokens_for(1, 6), 5, use_cache=False)
    assert lengths == [6, 7, 8, 9, 10] and torch.equal(out, uncached)


def test_cached_generate_past_max_seq_len_reruns_the_last_window():
    model = build(tiny_args(max_seq_len=8))
    out, lengths = forward_lengths(model, tokens_for(2, 6), 5)
    assert lengths == [6, 1, 1, 8, 8]  # positions 0..7 fit the cache; then the last 8 tokens each step
    assert torch.equal(out, model.generate(tokens_for(2, 6), 5, temperature=0, use_cache=False))


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_generate_never_draws_the_embeddings_padding_rows(temperature):
    # a pretrained embedding is often padded past its tokenizer's last id (to a multiple of 64, say):
    # those rows are untrained, and an id drawn from them has no text to decode to
    model = build(tiny_args())
    n_ids = model.args.vocab_size - 5
    favour_padding = torch.zeros(model.args.vocab_size)
    favour_padding[n_ids:] = 1e4
    model.output.register_forward_hook(lambda module, args, out: out + favour_padding)
    prompt = tokens_for(2, 6)
    gen = torch.Generator().manual_seed(0)
    assert (model.generate(prompt, 4, temperature=temperature, generator=gen)[:, 6:] >= n_ids).all()
    out = model.generate(prompt, 8, temperature=temperature, generator=gen, n_ids=n_ids)
    assert out.shape == (2, 14) and (out[:, 6:] < n_ids).all()
