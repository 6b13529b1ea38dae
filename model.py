"""
A Llama-family decoder (Llama 2, TinyLlama, Mistral with its sliding window), small enough to
read in one sitting.

- Built on the meta device and initialized afterwards (`init_weights` works after `to_empty`):
  the training scripts build every rank's model empty, load the weights on rank 0 only, and
  let FSDP broadcast and shard them.
- Parameter names follow Meta's checkpoints (tok_embeddings, layers.N.attention.wq, ...), so a
  Meta directory loads without renaming; Hugging Face names are mapped in `hf_to_meta`.
- `forward(tokens, targets)` returns the summed or mean cross-entropy computed in chunks: at
  vocab 32000 and 16k tokens a step, full fp32 logits would take 16384 * 32000 * 4 B = 2.1 GB,
  and their softmax gradient as much again; chunks of LOGITS_PER_CHUNK elements (1048 tokens at
  vocab 32000) keep 134 MB alive at a time, and each chunk's logits are recomputed in backward
  instead of stored. Batches whose logits fit in one chunk skip the recomputation.
- LoRA adapters on chosen projections, with helpers to train only them, save them and merge.
"""

import json
import math
import os
import pickle
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from glob import glob
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # targets with this value take no part in the loss
LOGITS_PER_CHUNK = 2 ** 25  # fp32 logits materialized at once by the chunked losses: 128 MiB


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None  # grouped-query attention; None = n_heads
    vocab_size: int = 32000
    multiple_of: int = 256  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    sliding_window: Optional[int] = None  # attend to at most this many previous positions; None = all
    # LoRA; rank 0 means none
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple = ("wq", "wk", "wv", "wo")

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        self.lora_targets = tuple(self.lora_targets)
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.tie_embeddings and self.lora_rank and "output" in self.lora_targets:
            raise ValueError("LoRA on 'output' needs untied embeddings (tie_embeddings=False)")
        unknown = set(self.lora_targets) - set(LORA_TARGETS)
        if unknown:
            raise ValueError(f"unknown lora_targets {sorted(unknown)}; choose from {LORA_TARGETS}")

    @property
    def head_dim(self):
        return self.dim // self.n_heads

    @property
    def hidden_dim(self):
        # Llama's rule: 2/3 of 4*dim, scaled, rounded up to multiple_of
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")

PRESETS = {
    # real sizes (vocab of the Llama 2 tokenizer)
    "llama2-7b": dict(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, max_seq_len=4096),
    "llama2-13b": dict(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, max_seq_len=4096),
    "tinyllama-1.1b": dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000,
                           multiple_of=256, norm_eps=1e-5, max_seq_len=2048),
    # tiny ones for a CPU; the vocab comes from the data
    "tiny": dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=64, max_seq_len=512),
    "tiny-student": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=64, max_seq_len=512),
    "toy": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=256),
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalize in fp32: bf16 sums of squares lose too much precision
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class LoRALinear(nn.Module):
    """base(x) + (alpha / rank) * B(A(dropout(x))), with B starting at zero so training starts
    from the base model. The base stays an nn.Linear so QAT can swap it for a fake-quantized one."""

    def __init__(self, in_features, out_features, rank, alpha, dropout):
        super().__init__()
        self.base = nn.Linear(in_features, out_features, bias=False)
        self.lora_a = nn.Parameter(torch.empty(rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout)

    @property
    def weight(self):
        return self.base.weight

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b) * self.scale


def linear(args, name, in_features, out_features):
    if args.lora_rank > 0 and name in args.lora_targets:
        return LoRALinear(in_features, out_features, args.lora_rank, args.lora_alpha, args.lora_dropout)
    return nn.Linear(in_features, out_features, bias=False)


def rope_tables(head_dim, max_seq_len, theta, device=None):
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()  # (T, D/2) each


def apply_rope(x, cos, sin):
    # Meta's layout: consecutive pairs (x0, x1), (x2, x3), ... are rotated together
    x = x.float().unflatten(-1, (-1, 2))  # (B, T, H, D/2, 2)
    x0, x1 = x.unbind(-1)
    cos, sin = cos[..., None, :], sin[..., None, :]  # (T, 1, D/2), or (B, T, 1, D/2) per-token positions
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = linear(args, "wq", args.dim, args.n_heads * args.head_dim)
        self.wk = linear(args, "wk", args.dim, args.n_kv_heads * args.head_dim)
        self.wv = linear(args, "wv", args.dim, args.n_kv_heads * args.head_dim)
        self.wo = linear(args, "wo", args.n_heads * args.head_dim, args.dim)

    def forward(self, x, cos, sin, mask=None, cache=None, start=0):
        """mask: bool, broadcastable to (B, H, T, keys), True where a query may attend a key; None
        is plain causal attention. cache: a KVCache that x's keys and values are written into at
        positions start..start+T-1, and that attention then reads every key up to them from."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin).type_as(v), apply_rope(k, cos, sin).type_as(v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        if cache is not None:
            k, v = cache.update(k, v, start)  # (B, H, start + T, D)
        # is_causal only without a mask: it is exact only when queries and keys are the same positions
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class KVCache:
    """One layer's keys and values (B, n_kv_heads, max_len, head_dim) during generate, allocated at
    the first write so that they take the activations' dtype and device."""

    def __init__(self, max_len):
        self.max_len, self.k, self.v = max_len, None, None

    def update(self, k, v, start):
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"a KV cache of {self.max_len} positions cannot hold position {end - 1}")
        if self.k is None:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
        self.k[:, :, start:end], self.v[:, :, start:end] = k, v
        return self.k[:, :, :end], self.v[:, :, :end]


class FeedForward(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.w1 = linear(args, "w1", args.dim, args.hidden_dim)  # gate
        self.w2 = linear(args, "w2", args.hidden_dim, args.dim)  # down
        self.w3 = linear(args, "w3", args.dim, args.hidden_dim)  # up

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, mask=None, cache=None, start=0):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache, start)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = linear(args, "output", args.dim, args.vocab_size)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # recomputed by init_weights, never saved: they are a function of the args
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed=None):
        """Fills every parameter and buffer in place, so it also works after `to_empty` on a
        model built on the meta device (and on FSDP-sharded parameters: each rank fills its
        shard). Residual projections get std scaled by depth, as in GPT-2."""
        if self.args.tie_embeddings:  # to_empty gives the two names separate storage: re-tie
            self.output.weight = self.tok_embeddings.weight
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        std, depth_std = 0.02, 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("lora_b"):
                p.zero_()
            elif name.endswith("lora_a"):
                nn.init.kaiming_uniform_(p, a=math.sqrt(5), generator=gen)
            elif p.ndim == 1:  # norm weights
                p.fill_(1.0)
            else:
                s = depth_std if re.search(r"\.(wo|w2)\.", name + ".") else std
                nn.init.normal_(p, 0.0, s, generator=gen)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self, device=None):
        """Recomputes the RoPE tables on `device` (default: where the weights are), in fp32
        whatever the weights' dtype: rounding the angles to bf16 would blur long positions."""
        if device is None:
            device = self.norm.weight.device
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device)
        self.rope_cos, self.rope_sin = cos, sin  # still non-persistent buffers

    def hidden(self, tokens, input_pos=None):
        """Final normalized hidden states (B, T, C) of tokens (B, T), for losses that apply the
        output layer themselves (distillation); input_pos as in forward. Under FSDP register it with
        register_fsdp_forward_method, so that it gathers parameters like forward does."""
        return self._hidden(tokens, input_pos)

    def attention_mask(self, T, input_pos=None, start=0, device=None):
        """The bool mask (True = may attend) of T queries at positions start..start+T-1 over keys
        0..start+T-1, built once per forward and shared by all layers: causal, within
        sliding_window, and with input_pos within the query's own sample. None where plain causal
        attention is exact, so that SDPA takes its fast is_causal path."""
        window = self.args.sliding_window
        if window is not None and window < 1:
            raise ValueError(f"sliding_window={window} leaves nothing to attend to; set None or a positive size")
        if input_pos is None and start == 0 and (window is None or window >= T):
            return None
        q = torch.arange(start, start + T, device=device)[:, None]
        k = torch.arange(start + T, device=device)
        mask = k <= q  # (T, S)
        if window is not None:
            mask = mask & (q - k < window)  # the query itself is one of the window's keys
        if input_pos is not None:
            # a sample starts wherever the position is 0; tokens before the first start (a window
            # that begins mid-sample) are sample 0
            sample = (input_pos == 0).cumsum(1)  # (B, T)
            mask = (mask & (sample[:, :, None] == sample[:, None, :]))[:, None]  # (B, 1, T, T)
        return mask

    def _hidden(self, tokens, input_pos=None, caches=None, start=0):
        T = tokens.shape[1]
        if start + T > self.args.max_seq_len:
            raise ValueError(f"sequence of {start + T} tokens is longer than max_seq_len={self.args.max_seq_len}")
        if input_pos is not None and (input_pos.shape != tokens.shape or caches is not None):
            raise ValueError(f"input_pos of shape {tuple(input_pos.shape)} must match tokens' {tuple(tokens.shape)}, "
                             f"and cannot be combined with a KV cache")
        h = self.tok_embeddings(tokens)
        if input_pos is None:
            cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]  # (T, D/2)
        else:
            cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # (B, T, D/2)
        mask = self.attention_mask(T, input_pos, start, tokens.device)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, mask, None if caches is None else caches[i], start)
        return self.norm(h)

    def forward(self, tokens, targets=None, reduction="mean", loss_chunk=None, input_pos=None):
        """Logits (B, T, V) without targets; with targets (B, T), the cross-entropy over positions
        whose target is not IGNORE_INDEX: its mean, or its sum when reduction='sum' (callers that
        normalize over several micro-batches and ranks divide by the global count themselves).
        input_pos (B, T), for rows packed with several samples: each token's position within its
        own sample (0 at the sample's first token); attention then stays within each sample.
        None: one sequence per row at positions 0..T-1."""
        h = self._hidden(tokens, input_pos)  # not self.hidden: its FSDP hooks must not nest in forward's
        if targets is None:
            return self.output(h)
        chunk = loss_chunk or max(1, LOGITS_PER_CHUNK // self.args.vocab_size)  # tokens per chunk
        loss = chunked_cross_entropy(h.flatten(0, 1), self.output, targets.flatten(), chunk)
        if reduction == "sum":
            return loss
        return loss / (targets != IGNORE_INDEX).sum().clamp(min=1)

    @torch.no_grad()
    def generate(self, tokens, max_new_tokens, temperature=1.0, top_k=None, eos_id=None, generator=None,
                 use_cache=True):
        """Samples max_new_tokens after tokens (B, T); temperature 0 is greedy. With use_cache the
        prompt runs once and every later step runs only the newest token, reading earlier keys and
        values from per-layer caches that live only during this call. A context longer than
        max_seq_len has positions beyond the RoPE tables: from then on each step re-runs the last
        max_seq_len tokens from position 0, as use_cache=False does at every step, so a long
        generation slows down rather than fails."""
        L = self.args.max_seq_len
        caches = None
        for _ in range(max_new_tokens):
            T = tokens.shape[1]
            if use_cache and caches is not None and T <= L:
                h = self._hidden(tokens[:, -1:], caches=caches, start=T - 1)
            elif use_cache and T <= L:  # prefill
                caches = [KVCache(min(T + max_new_tokens, L)) for _ in self.layers]
                h = self._hidden(tokens, caches=caches)
            else:
                h = self._hidden(tokens[:, -L:])
            logits = self.output(h[:, -1]).float()  # (B, V)
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits[logits < kth] = -float("inf")
                nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
            tokens = torch.cat((tokens, nxt), 1)
            if eos_id is not None and (nxt == eos_id).all():
                break
        return tokens


def _ce_chunk(h, output, targets):
    logits = output(h).float()  # upcast one chunk at a time
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(h, output, targets, chunk=1024):
    """Summed cross-entropy of output(h) (N, V) against targets (N,), never holding more than
    `chunk` rows of fp32 logits. With several chunks each is checkpointed: backward recomputes
    its logits rather than keeping all of them alive."""
    if h.shape[0] <= chunk:
        return _ce_chunk(h, output, targets)
    total = h.new_zeros((), dtype=torch.float32)
    for hc, tc in zip(h.split(chunk), targets.split(chunk)):
        total = total + checkpoint(_ce_chunk, hc, output, tc, use_reentrant=False)
    return total


def flops_per_token(args: ModelArgs, seq_len: int):
    """Training FLOPs per token: 6 per weight (forward + backward) plus attention's QK^T and AV,
    12 * layers * dim * seq_len (PaLM appendix B; causal masking not discounted, as usual)."""
    d, h, L = args.dim, args.hidden_dim, args.n_layers
    kv = args.n_kv_heads * args.head_dim
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * h
    n = L * per_layer + args.vocab_size * d  # the output projection; embedding lookups are free
    return 6 * n + 12 * L * d * seq_len


# dense bf16 FLOP/s per device (float32 runs on TF32 tensor cores at half of it)
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def peak_flops(device, dtype):
    """Per-device peak FLOP/s behind MFU, and where it came from. GPUs: the table above. CPUs:
    the best rate of a 1024^3 matmul in `dtype` on the current threads, over several tries, since
    one timing in a busy moment would set the bar low. The scripts measure it again whenever a
    run goes faster than it (the machine was busy at start-up), so MFU never exceeds 100%."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, flops in GPU_PEAK_FLOPS.items():
            if key in name:
                return (flops if dtype == torch.bfloat16 else flops / 2), f"table ({name})"
        return float("nan"), f"unknown GPU {name}; set peak_flops"
    # a generator of its own: drawing from the global one would shift the RNG state resume restores
    a = torch.randn(1024, 1024, dtype=dtype, generator=torch.Generator().manual_seed(0))
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        for _ in range(4):
            a @ a
        best = min(best, time.perf_counter() - t0)
    return 4 * 2 * 1024 ** 3 / best, f"measured {str(dtype).removeprefix('torch.')} matmul"


# ---------------------------------------------------------------------------------------------
# LoRA helpers

def mark_only_lora_trainable(model):
    for n, p in model.named_parameters():
        p.requires_grad_(n.endswith(("lora_a", "lora_b")))


def adapter_state_dict(state_dict):
    return {k: v for k, v in state_dict.items() if k.endswith(("lora_a", "lora_b"))}


def merge_lora(state_dict, args: ModelArgs):
    """A plain (LoRA-free) state dict from a LoRA model's full state dict: W + scale * B @ A."""
    scale = args.lora_alpha / max(args.lora_rank, 1)
    out = {}
    for k, v in state_dict.items():
        if k.endswith(("lora_a", "lora_b")):
            continue
        if k.endswith(".base.weight"):
            prefix = k[: -len("base.weight")]
            a, b = state_dict[prefix + "lora_a"], state_dict[prefix + "lora_b"]
            v = (v.float() + scale * (b.float() @ a.float())).to(v.dtype)
            k = prefix + "weight"
        out[k] = v
    return out


def to_lora_keys(state_dict, model):
    """Renames plain weights (wq.weight) to the LoRA model's base weights (wq.base.weight)."""
    names = set(model.state_dict().keys())
    out = {}
    for k, v in state_dict.items():
        alt = k[: -len("weight")] + "base.weight" if k.endswith(".weight") else k
        out[alt if k not in names and alt in names else k] = v
    return out


# ---------------------------------------------------------------------------------------------
# Checkpoints: Meta and Hugging Face directories, in and out

# Meta module name -> Hugging Face module name; {} is the layer number
HF_NAMES = {
    "tok_embeddings": "model.embed_tokens",
    "layers.{}.attention.wq": "model.layers.{}.self_attn.q_proj",
    "layers.{}.attention.wk": "model.layers.{}.self_attn.k_proj",
    "layers.{}.attention.wv": "model.layers.{}.self_attn.v_proj",
    "layers.{}.attention.wo": "model.layers.{}.self_attn.o_proj",
    "layers.{}.feed_forward.w1": "model.layers.{}.mlp.gate_proj",
    "layers.{}.feed_forward.w2": "model.layers.{}.mlp.down_proj",
    "layers.{}.feed_forward.w3": "model.layers.{}.mlp.up_proj",
    "layers.{}.attention_norm": "model.layers.{}.input_layernorm",
    "layers.{}.ffn_norm": "model.layers.{}.post_attention_layernorm",
    "norm": "model.norm",
    "output": "lm_head",
}
META_NAMES = {hf: meta for meta, hf in HF_NAMES.items()}
# The dim along which Meta's model-parallel layers split a weight across consolidated.NN.pth:
# column-parallel ones their outputs (0), row-parallel ones their inputs (1), Llama 2's
# ParallelEmbedding the embedding dim (1). Norms are replicated.
META_SHARD_DIM = {"tok_embeddings": 1, "wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1}
# what Meta's own ModelArgs accepts; not max_seq_len, which its loader passes separately
META_PARAMS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier",
               "norm_eps", "rope_theta")
NOT_A_CHECKPOINT = ("init_from={!r} is neither a nanotune checkpoint nor a Meta (params.json) or Hugging Face "
                    "(config.json) directory")


def load_checkpoint(path, weights=True):
    """(ModelArgs, state dict) from a nanotune checkpoint (a file, or a directory holding ckpt.pt),
    a Meta directory (params.json + consolidated.NN.pth) or a Hugging Face Llama directory
    (config.json + model*.safetensors or pytorch_model*.bin). Tensors stay memory-mapped where
    they can: load them with load_state_dict(assign=True) to avoid a copy. weights=False gives
    meta tensors (shapes only): what every process but the one that broadcasts the weights needs,
    without merging shards or permuting in memory."""
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, "ckpt.pt")):
        return _load_nanotune(path if os.path.isfile(path) else os.path.join(path, "ckpt.pt"))
    if os.path.isfile(os.path.join(path, "params.json")) and glob(os.path.join(path, "consolidated.*.pth")):
        return _load_meta(path, weights)
    if os.path.isfile(os.path.join(path, "config.json")):
        return _load_hf(path, weights)
    raise ValueError(NOT_A_CHECKPOINT.format(path))


def _shapes_only(sd):
    return {k: torch.empty_like(v, device="meta") for k, v in sd.items()}


def _load_nanotune(file):
    try:
        # weights_only: unpickling arbitrary objects can run code, and a nanotune checkpoint holds
        # only tensors and plain Python values
        ckpt = torch.load(file, mmap=True, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise ValueError(f"{file} holds objects other than tensors and plain Python values, which "
                         f"torch.load(weights_only=True) refuses to unpickle") from e
    except RuntimeError as e:  # not a torch.save zip file
        raise ValueError(NOT_A_CHECKPOINT.format(file)) from e
    if not (isinstance(ckpt, dict) and "model" in ckpt and "model_args" in ckpt):
        raise ValueError(NOT_A_CHECKPOINT.format(file))
    return ModelArgs.from_dict(ckpt["model_args"]), ckpt["model"]


def _load_meta(path, weights=True):
    with open(os.path.join(path, "params.json")) as f:
        params = json.load(f)
    if params.get("use_scaled_rope"):
        raise ValueError(f"{path} uses Llama 3.1's scaled RoPE, which nanotune does not implement")
    shards = [torch.load(f, mmap=True, weights_only=True, map_location="cpu")
              for f in sorted(glob(os.path.join(path, "consolidated.*.pth")))]
    if not weights:
        shards = [_shapes_only(shard) for shard in shards]
    sd = {}
    for k, v in shards[0].items():
        if k == "rope.freqs":  # the original code's precomputed RoPE table; rebuilt from the args here
            continue
        dim = META_SHARD_DIM.get(k.split(".")[-2])
        if k == "tok_embeddings.weight" and v.shape[1] == params["dim"]:
            dim = 0  # Llama 3's VocabParallelEmbedding splits the vocab instead
        sd[k] = v if len(shards) == 1 or dim is None else torch.cat([s[k] for s in shards], dim)
    if params.get("vocab_size", -1) < 0:  # Llama 2 writes -1: the tokenizer decides
        params["vocab_size"] = sd["tok_embeddings.weight"].shape[0]
    return _args_for(params, sd), sd


def _load_hf(path, weights=True):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("rope_scaling"):
        raise ValueError(f"{path} uses RoPE scaling {cfg['rope_scaling']}, which nanotune does not implement")
    # model*, not *.safetensors: Mistral's directories also hold consolidated.safetensors in Meta's names
    files = sorted(glob(os.path.join(path, "model*.safetensors")))
    if files:
        hf = {k: v for f in files for k, v in load_file(f).items()}  # memory-mapped
    else:
        hf = {k: v for f in sorted(glob(os.path.join(path, "pytorch_model*.bin")))
              for k, v in torch.load(f, mmap=True, weights_only=True, map_location="cpu").items()}
    if not hf:
        raise ValueError(f"{path} has a config.json but no model*.safetensors or pytorch_model*.bin files")
    if not weights:
        hf = _shapes_only(hf)
    params = dict(dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                  n_kv_heads=cfg.get("num_key_value_heads"), vocab_size=cfg["vocab_size"],
                  norm_eps=cfg["rms_norm_eps"], rope_theta=cfg.get("rope_theta", 10000.0),
                  max_seq_len=cfg.get("max_position_embeddings", 2048))
    sd = hf_to_meta(hf, ModelArgs.from_dict(params))
    if cfg.get("tie_word_embeddings"):  # transformers then ignores any lm_head.weight in the files
        sd.pop("output.weight", None)
    return _args_for(params, sd), sd


def _args_for(params, sd):
    """ModelArgs that fit the weights: the SwiGLU size comes from w1's shape (HF stores only the
    number; Meta a rounding rule that need not match it), and a missing output means tied."""
    args = ModelArgs.from_dict({**params, "tie_embeddings": "output.weight" not in sd})
    hidden = sd["layers.0.feed_forward.w1.weight"].shape[0]
    if args.hidden_dim != hidden:
        args = ModelArgs.from_dict({**asdict(args), **ffn_settings(args.dim, hidden)})
    if args.tie_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]  # as a tied model's state_dict() has it
    return args


def ffn_settings(dim, hidden_dim):
    """multiple_of and ffn_dim_multiplier for which Llama's rule (ModelArgs.hidden_dim) gives exactly
    hidden_dim: the usual 256 when that fits, else multiple_of=hidden_dim, which rounds any size in
    (0, hidden_dim] up to hidden_dim, with a multiplier shrinking 8*dim/3 into that range when it is
    larger (float rounding may land one below hidden_dim, which still rounds up)."""
    for multiple_of, mult in ((256, None), (hidden_dim, None), (hidden_dim, hidden_dim / int(8 * dim / 3))):
        if ModelArgs(dim=dim, n_heads=1, multiple_of=multiple_of, ffn_dim_multiplier=mult).hidden_dim == hidden_dim:
            return dict(multiple_of=multiple_of, ffn_dim_multiplier=mult)
    raise ValueError(f"no multiple_of/ffn_dim_multiplier give a SwiGLU size of {hidden_dim} at dim={dim}")


def _permute(w, n_heads):
    # Meta's RoPE rotates row pairs (0, 1), (2, 3), ... of each head; HF's rotate_half rotates rows
    # (i, i + head_dim/2), so HF stores each head's even rows first, then its odd ones
    return w.unflatten(0, (n_heads, -1, 2)).transpose(1, 2).flatten(0, 2)


def _unpermute(w, n_heads):
    return w.unflatten(0, (n_heads, 2, -1)).transpose(1, 2).flatten(0, 2)


def _rope_heads(module, args):
    # only q and k go through RoPE, so only their rows differ between the layouts
    return {"wq": args.n_heads, "wk": args.n_kv_heads}.get(module.rsplit(".", 1)[-1])


def _rename(module, table):
    generic = re.sub(r"\.\d+\.", ".{}.", module, count=1)
    if generic not in table:
        raise ValueError(f"unexpected tensor {module} in a Llama checkpoint")
    return table[generic].format(*re.findall(r"\.(\d+)\.", module))


def meta_to_hf(state_dict, args):
    out = {}
    for k, v in state_dict.items():
        module = k.removesuffix(".weight")
        heads = _rope_heads(module, args)
        out[_rename(module, HF_NAMES) + ".weight"] = v if heads is None else _permute(v, heads)
    return out


def hf_to_meta(state_dict, args):
    out = {}
    for k, v in state_dict.items():
        if k.endswith("rotary_emb.inv_freq"):  # a buffer old HF checkpoints saved; rebuilt from the args
            continue
        module = _rename(k.removesuffix(".weight"), META_NAMES)
        heads = _rope_heads(module, args)
        out[module + ".weight"] = v if heads is None else _unpermute(v, heads)
    return out


def _plain(state_dict, args):
    # a LoRA model exports as the plain model it computes, W + scale * B @ A
    return merge_lora(state_dict, args) if any(k.endswith("lora_a") for k in state_dict) else state_dict


@contextmanager
def _atomic_dir(out_dir):
    """A temp directory beside out_dir, renamed into place once written, so a crash never leaves a
    half-written checkpoint; an existing out_dir is replaced."""
    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp", dir=os.path.dirname(out_dir))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would hide the export from other users
        if os.path.exists(out_dir):  # rename cannot replace a non-empty directory
            os.rename(out_dir, tmp + ".old")
        os.rename(tmp, out_dir)
        shutil.rmtree(tmp + ".old", ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_json(obj, path):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def export_meta(state_dict, args, out_dir):
    """params.json + consolidated.00.pth, as Meta's llama code loads them."""
    with _atomic_dir(out_dir) as tmp:
        _write_json({k: getattr(args, k) for k in META_PARAMS}, os.path.join(tmp, "params.json"))
        torch.save(_plain(state_dict, args), os.path.join(tmp, "consolidated.00.pth"))


def export_hf(state_dict, args, out_dir):
    """config.json + model.safetensors, as transformers' LlamaForCausalLM loads them."""
    sd = _plain(state_dict, args)
    if args.tie_embeddings:  # safetensors refuses shared tensors, and transformers re-ties them
        sd = {k: v for k, v in sd.items() if k != "output.weight"}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "torch_dtype": str(sd["tok_embeddings.weight"].dtype).removeprefix("torch."),
              "hidden_size": args.dim, "intermediate_size": args.hidden_dim, "num_hidden_layers": args.n_layers,
              "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
              "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
              "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings}
    with _atomic_dir(out_dir) as tmp:
        _write_json(config, os.path.join(tmp, "config.json"))
        # transformers refuses safetensors files without the format in their metadata
        save_file({k: v.contiguous() for k, v in meta_to_hf(sd, args).items()},
                  os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})


def save_adapter(state_dict, args, out_dir):
    """Only the LoRA weights, in PEFT's layout (adapter_model.safetensors + adapter_config.json),
    so peft can apply them to the export_hf directory of the base model."""
    tensors = {}
    for k, v in adapter_state_dict(state_dict).items():
        module, ab = k.rsplit(".", 1)
        heads = _rope_heads(module, args)
        if ab == "lora_b" and heads:  # B's rows are q/k's output rows, which HF permutes; A's input is not
            v = _permute(v, heads)
        tensors[f"base_model.model.{_rename(module, HF_NAMES)}.lora_{ab[-1].upper()}.weight"] = v.contiguous()
    if not tensors:
        raise ValueError("the state dict holds no LoRA weights: was lora_rank 0?")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": args.lora_rank, "lora_alpha": args.lora_alpha,
              "lora_dropout": args.lora_dropout, "target_modules": sorted({k.split(".")[-3] for k in tensors}),
              "bias": "none"}
    with _atomic_dir(out_dir) as tmp:
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        _write_json(config, os.path.join(tmp, "adapter_config.json"))


def load_adapter(path, args):
    """(LoRA settings for ModelArgs, adapter state dict in nanotune's names) from a PEFT directory;
    args are the base model's, whose head counts undo the q/k permutation of lora_b."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    if cfg.get("use_rslora") or cfg.get("use_dora") or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{path} uses rsLoRA, DoRA or per-module ranks, which nanotune's LoRA does not implement")
    sd = {}
    for k, v in load_file(os.path.join(path, "adapter_model.safetensors")).items():
        m = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", k)
        if m is None:
            raise ValueError(f"{k} in {path} is not a LoRA A or B weight")
        module = _rename(m[1], META_NAMES)
        heads = _rope_heads(module, args)
        sd[f"{module}.lora_{m[2].lower()}"] = _unpermute(v, heads) if m[2] == "B" and heads else v
    targets = {k.split(".")[-2] for k in sd}
    settings = dict(lora_rank=cfg["r"], lora_alpha=cfg["lora_alpha"], lora_dropout=cfg.get("lora_dropout", 0.0),
                    lora_targets=tuple(t for t in LORA_TARGETS if t in targets))
    return settings, sd
