"""
A Llama-family decoder (Llama 2, TinyLlama, Mistral with its sliding window), small enough to
read in one sitting.

- Built on the meta device and initialized afterwards (`init_weights` works after `to_empty`):
  the training scripts build every rank's model empty, load the weights on rank 0 only, and
  let FSDP broadcast and shard them.
- Parameter names follow Meta's checkpoints (tok_embeddings, layers.N.attention.wq, ...), so a
  Meta directory loads without renaming; checkpoint.py reads and writes the formats.
- `forward(tokens, targets)` returns the summed or mean cross-entropy computed in chunks: at
  vocab 32000 and 16k tokens a step, full fp32 logits would take 16384 * 32000 * 4 B = 2.1 GB,
  and their softmax gradient as much again; chunks of LOGITS_PER_CHUNK elements (1048 tokens at
  vocab 32000) keep 134 MB alive at a time, and each chunk's logits are recomputed in backward
  instead of stored. Batches whose logits fit in one chunk skip the recomputation.
- LoRA adapters on chosen projections, with helpers to train only them, save them and merge.
"""

import logging
import math
import re
import time
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch._inductor.config
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

# torchao's import logs notes about GPU-only kernels and a torch deprecation: not the user's concern
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
from torchao.quantization import PerGroup
from torchao.quantization.granularity import PerToken
from torchao.quantization.qat import IntxFakeQuantizeConfig
from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer
from torchao.quantization.quant_primitives import _DTYPE_TO_BIT_WIDTH, _DTYPE_TO_QVALUE_BOUNDS
from torchao.quantization.utils import get_group_qparams_symmetric

IGNORE_INDEX = -100  # targets with this value take no part in the loss
# compiled code rounds where eager rounds: inductor would keep a bfloat16 fake quant's scale in float32
# inside its fused kernel, so that a compiled bf16 run trained on other integer codes (7% of the int8
# activations', a level apart) than eager's and the conversion's
torch._inductor.config.emulate_precision_casts = True
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
    head_dim: Optional[int] = None  # None = dim // n_heads; set explicitly it may differ
    rope_theta: float = 10000.0
    # Llama 3.1's RoPE frequency scaling ("llama3" in transformers); factor None means none
    rope_scaling_factor: Optional[float] = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192  # the context the unscaled model was trained on
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
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim")
            self.head_dim = self.dim // self.n_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is odd, and RoPE rotates pairs of dimensions: give an even head_dim "
                             f"(without one, dim / n_heads)")
        if self.rope_scaling_factor is not None and not self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(f"rope_low_freq_factor={self.rope_low_freq_factor} must be below "
                             f"rope_high_freq_factor={self.rope_high_freq_factor}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.tie_embeddings and self.lora_rank and "output" in self.lora_targets:
            raise ValueError("LoRA on 'output' needs untied embeddings (tie_embeddings=False)")
        unknown = set(self.lora_targets) - set(LORA_TARGETS)
        if unknown:
            raise ValueError(f"unknown lora_targets {sorted(unknown)}; choose from {LORA_TARGETS}")

    @property
    def rope_scaling(self):
        if self.rope_scaling_factor is None:
            return None
        return (self.rope_scaling_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                self.rope_original_max_seq_len)

    @property
    def hidden_dim(self):
        # Llama's rule: 2/3 of 4*dim, scaled, rounded up to multiple_of
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @classmethod
    def from_dict(cls, d, strict=False):
        """ModelArgs from the fields of d, ignoring keys that are not fields; strict (a nanotune
        checkpoint's own model_args) refuses them: another version's field may change the model."""
        names = {f.name for f in fields(cls)}
        if strict and (unknown := sorted(d.keys() - names)):
            raise ValueError(f"its model_args hold {unknown[0]}={d[unknown[0]]!r}, which this version of nanotune does "
                             f"not know: it was written by another version, and would be built as a different model")
        return cls(**{k: v for k, v in d.items() if k in names})


LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")

PRESETS = {
    # real sizes (vocab of the Llama 2 tokenizer)
    "llama2-7b": dict(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, max_seq_len=4096),
    "llama2-13b": dict(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, max_seq_len=4096),
    "tinyllama-1.1b": dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000,
                           multiple_of=256, norm_eps=1e-5, max_seq_len=2048),
    # Llama 3 (vocab 128256, RoPE theta 500000); 3.1 and 3.2 scale RoPE frequencies to a 128K context,
    # 3.2 ties the output layer to the embedding
    "llama3-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                      ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192),
    "llama3.1-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                        ffn_dim_multiplier=1.3, rope_theta=500000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                        rope_high_freq_factor=4.0, rope_original_max_seq_len=8192, max_seq_len=131072),
    "llama3.2-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=256,
                        ffn_dim_multiplier=1.5, rope_theta=500000.0, rope_scaling_factor=32.0, rope_low_freq_factor=1.0,
                        rope_high_freq_factor=4.0, rope_original_max_seq_len=8192, max_seq_len=131072, tie_embeddings=True),
    "llama3.2-3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, multiple_of=256,
                        ffn_dim_multiplier=1.0, rope_theta=500000.0, rope_scaling_factor=32.0, rope_low_freq_factor=1.0,
                        rope_high_freq_factor=4.0, rope_original_max_seq_len=8192, max_seq_len=131072, tie_embeddings=True),
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


def project(x, *linears):
    """[linear(x) for linear in linears]; when QAT fake-quantizes their input alike (per token,
    as in wq, wk and wv, or w1 and w3), the fake quant of x is computed once for all of them."""
    fqs = [getattr(lin, "activation_fake_quantizer", None) for lin in linears]
    if not all(isinstance(fq, FusedFakeQuantizer) and fq.enabled and fq.config == fqs[0].config for fq in fqs):
        return [lin(x) for lin in linears]
    x = fqs[0](x)
    return [F.linear(x, lin.weight if lin.weight_fake_quantizer is None else lin.weight_fake_quantizer(lin.weight), lin.bias)
            for lin in linears]


def rope_tables(head_dim, max_seq_len, theta, device=None, scaling=None):
    """cos and sin of each position's angles. scaling = (factor, low_freq_factor, high_freq_factor,
    original_max_seq_len) applies Llama 3.1's frequency scaling: wavelengths shorter than
    original/high_freq_factor stay, those longer than original/low_freq_factor are stretched by
    factor, and those between are blended, so the model reaches factor times its original context
    while nearby positions look as they did in pretraining."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None:
        factor, low, high, original = scaling
        wavelen = 2 * math.pi / freqs
        freqs = torch.where(wavelen > original / low, freqs / factor, freqs)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * freqs / factor + smooth * freqs
        freqs = torch.where((wavelen >= original / high) & (wavelen <= original / low), blended, freqs)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()  # (T, D/2) each


class _ComplexRope(torch.autograd.Function):
    # eager RoPE: each pair (x0, x1) as the complex number x0 + i x1 times cos + i sin, one kernel each
    # way with the strided form's products and sums (bit for bit on an AVX512 CPU), 5-6x faster than
    # it on a CPU; the gradient is grad times cos - i sin, from the tables autograd keeps anyway (a
    # plain complex product would keep a complex copy of them per call)
    @staticmethod
    def forward(ctx, x, cos, sin):  # x: (..., D/2, 2) float32, contiguous
        ctx.save_for_backward(cos, sin)
        return torch.view_as_real(torch.view_as_complex(x) * torch.complex(cos.float(), sin.float())).flatten(-2)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        g = torch.view_as_complex(grad.float().unflatten(-1, (-1, 2)).contiguous())
        return torch.view_as_real(g * torch.complex(cos.float(), -sin.float())), None, None


def apply_rope(x, cos, sin):
    # Meta's layout: consecutive pairs (x0, x1), (x2, x3), ... are rotated together
    x = x.float().unflatten(-1, (-1, 2))  # (B, T, H, D/2, 2)
    cos, sin = cos[..., None, :], sin[..., None, :]  # (T, 1, D/2), or (B, T, 1, D/2) per-token positions
    if not torch.compiler.is_compiling():
        # compiled code keeps the strided form, which Inductor fuses with its neighbours (the complex
        # one compiles to separate, slower kernels), and so does torch.export, which the .pte is traced by
        return _ComplexRope.apply(x.contiguous(), cos, sin)
    x0, x1 = x.unbind(-1)
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
        q, k, v = project(x, self.wq, self.wk, self.wv)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
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
        gate, up = project(x, self.w1, self.w3)
        return self.w2(F.silu(gate) * up)


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
        self.ce_chunk = ce_chunk  # one chunk's loss: a training script may torch.compile it
        # recomputed by init_weights, never saved: they are a function of the args
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, scaling=args.rope_scaling)
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
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device,
                               self.args.rope_scaling)
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
        loss = chunked_cross_entropy(h.flatten(0, 1), self.output, targets.flatten(), chunk, self.ce_chunk)
        if reduction == "sum":
            return loss
        return loss / (targets != IGNORE_INDEX).sum().clamp(min=1)

    @torch.no_grad()
    def generate(self, tokens, max_new_tokens, temperature=1.0, top_k=None, eos_id=None, generator=None,
                 use_cache=True, n_ids=None):
        """Samples max_new_tokens after tokens (B, T); temperature 0 is greedy. With use_cache the
        prompt runs once and every later step runs only the newest token, reading earlier keys and
        values from per-layer caches that live only during this call. A context longer than
        max_seq_len has positions beyond the RoPE tables: from then on each step re-runs the last
        max_seq_len tokens from position 0, as use_cache=False does at every step, so a long
        generation slows down rather than fails. eos_id: an id or a list of them, where a sequence ends:
        a row that drew one repeats it from then on, and generation stops once every row has.
        n_ids: the tokenizer's size, when the embedding has padding rows past it: those ids are never drawn."""
        L = self.args.max_seq_len
        eos = None if eos_id is None else torch.tensor(eos_id, device=tokens.device).view(-1)
        ended = torch.zeros(tokens.shape[0], 1, dtype=torch.bool, device=tokens.device)
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
            if n_ids is not None:
                logits[:, n_ids:] = -float("inf")
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits[logits < kth] = -float("inf")
                nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
            if eos is not None:
                nxt = torch.where(ended, tokens[:, -1:], nxt)  # an ended row keeps its stop id
                ended |= torch.isin(nxt, eos)
            tokens = torch.cat((tokens, nxt), 1)
            if ended.all():
                break
        return tokens


def fake_quantized_weight(linear):
    """The weight of a fake-quantized linear layer, fake-quantized here, or None for any other layer.
    torchao's fake-quantized linear fake-quantizes its whole weight at every call, which a chunked
    loss would make for every chunk and again in each chunk's recomputation (the output layer:
    vocabulary x dim elements each time; at Llama 3's vocabulary 4,096 tokens are 16 chunks): the
    chunks take it once, through linear_with."""
    fq = getattr(linear, "weight_fake_quantizer", None)
    return None if fq is None else fq(linear.weight)


def linear_with(linear, x, w=None):
    """linear(x), with w (fake_quantized_weight's) in place of its weight's fake quant when given."""
    if w is None:
        return linear(x)
    act = linear.activation_fake_quantizer
    return F.linear(x if act is None else act(x), w, linear.bias)


def ce_chunk(h, output, targets, w=None):
    """Summed cross-entropy of output(h) against targets, the logits upcast to fp32; w as in linear_with."""
    logits = linear_with(output, h, w).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(h, output, targets, chunk=1024, loss=ce_chunk):
    """Summed cross-entropy of output(h) (N, V) against targets (N,), never holding more than
    `chunk` rows of fp32 logits (`loss` computes one chunk's). With several chunks each is
    checkpointed: backward recomputes its logits rather than keeping all of them alive, and a
    fake-quantized output layer's weight is fake-quantized once for all of them."""
    if h.shape[0] <= chunk:
        return loss(h, output, targets)
    w = fake_quantized_weight(output)
    total = h.new_zeros((), dtype=torch.float32)
    for hc, tc in zip(h.split(chunk), targets.split(chunk)):
        total = total + checkpoint(loss, hc, output, tc, w, use_reentrant=False)
    return total


def flops_per_token(args: ModelArgs, seq_len: int, frozen=False):
    """Training FLOPs per token: 6 per weight (forward + backward) plus attention's QK^T and AV,
    12 * layers * dim * seq_len (PaLM appendix B; causal masking not discounted, as usual). With
    frozen weights (LoRA's base) 4 per weight: backward computes no gradient for them."""
    d, h, L = args.dim, args.hidden_dim, args.n_layers
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim  # q need not be dim wide (head_dim given)
    per_layer = 2 * d * q + 2 * d * kv + 3 * d * h
    n = L * per_layer + args.vocab_size * d  # the output projection; embedding lookups are free
    return (4 if frozen else 6) * n + 12 * L * q * seq_len


# dense bf16 FLOP/s per device (float32 runs on TF32 tensor cores at half of it), by a part of the
# device's name; the first that matches counts, so the PCIe and NVL cards come before their SXM names
GPU_PEAK_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "H200": 989e12, "H100": 989e12,
                  "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def peak_flops(device, dtype):
    """Per-device peak FLOP/s behind MFU, and where it came from. GPUs: the table above. CPUs:
    the best rate of a 1024^3 matmul in `dtype` on the current threads, over several tries, since
    one timing in a busy moment would set the bar low. When a run goes faster than it (the machine
    was busy at start-up), the scripts time it once more and never let it fall below the rate the
    run reached, so MFU never exceeds 100%."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
        # a whole word of the name: "A10" is not the A10G, "A100" not the RTX A1000; a MIG slice has a
        # share of its GPU's peak, which the name does not say
        key = next((k for k in GPU_PEAK_FLOPS if re.search(rf"(?<![\w-]){re.escape(k)}(?!\w)", name)), None)
        if key is None or "MIG" in name.split():
            return float("nan"), f"unknown GPU {name}; set peak_flops_per_device"
        flops = GPU_PEAK_FLOPS[key]
        return (flops if dtype == torch.bfloat16 else flops / 2), f"table ({name})"
    # a generator of its own: drawing from the global one would shift the RNG state resume restores
    a = torch.randn(1024, 1024, dtype=dtype, generator=torch.Generator().manual_seed(0))
    # ten tries, or as many as fit in about two seconds, three at least: a CPU without native
    # bfloat16 (AVX2 alone) takes seconds a matmul, and the benchmark must not outlast a short run
    best, spent, tries = float("inf"), 0.0, 0
    while tries < 10 and (tries < 3 or spent < 2.0):
        t0 = time.perf_counter()
        a @ a
        took = time.perf_counter() - t0
        best, spent, tries = min(best, took), spent + took, tries + 1
    return 2 * 1024 ** 3 / best, f"measured {str(dtype).removeprefix('torch.')} matmul"


# ---------------------------------------------------------------------------------------------
# Fake quantization: torchao's fake quantizers (QATConfig "prepare") compute their scales and
# zero points, then fake-quantize in a chain of elementwise ops. The same math with fewer passes
# over memory (min and max together, the rest in place on one buffer, and one fake quant of an
# input that several linears read) makes a QAT step cost less over plain training;
# tests/test_speed_numerics.py holds it to torchao's output, bit for bit.

def check_quantizable(args, group_size, quant_skip, quantize_embedding=False):
    """quant_skip's module paths normalized ('layers.0.' means 'layers.0'), once group_size is
    known to divide the layer widths and every path to name a module of the model, none of them
    one quantize_embedding asks to quantize. Raises ValueError."""
    # the linears' input widths: dim, the MLP's hidden width, and wo's (n_heads * head_dim, not dim
    # where head_dim is given)
    widths = (("dim", args.dim), ("hidden", args.hidden_dim), ("heads", args.n_heads * args.head_dim))
    if bad := {k: w for k, w in widths if w % group_size}:
        raise ValueError(f"group_size={group_size} does not divide the layer widths {bad}; pick a divisor of "
                         f"{math.gcd(*(w for _, w in widths))}")
    with torch.device("meta"):
        paths = {name for name, _ in Transformer(args).named_modules()}
    quant_skip = tuple(s.rstrip(".") for s in quant_skip)
    if unknown := [s for s in quant_skip if s not in paths]:
        raise ValueError(f"quant_skip names {unknown}, which are not modules of the model; use paths such as 'output' or 'layers.0'")
    if quantize_embedding and "tok_embeddings" in quant_skip:
        raise ValueError("quant_skip names 'tok_embeddings', which quantize_embedding=True asks to quantize: drop one of them")
    return quant_skip


def _round_to(t, dtype):
    """float32 t rounded to dtype's precision (to nearest, ties to even), kept in float32: where eager
    rounds a bfloat16 op's result, compiled code must too, and torch 2.11's Inductor drops a
    .to(bfloat16) that a .float() follows (2.13's emulate_precision_casts keeps it). Integer
    arithmetic on the bits, which no compiler elides."""
    if dtype == torch.float32:
        return t
    assert dtype == torch.bfloat16, dtype
    bits = t.view(torch.int32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).view(torch.float32)


def _qparams(x, qmin, qmax, eps, symmetric):
    """torchao's choose_qparams_affine (int grid; symmetric with zero point 0, or asymmetric)
    over the last dim of x, a token or a group, in x's dtype. Min and max are found in fp32 (exact
    for bf16 values): ATen's bf16 reductions over short groups, and its torch.aminmax in any dtype,
    are several times slower than amin and amax over fp32. The ops after them run in fp32, each
    rounded where x's dtype rounds it (_round_to says why)."""
    xf = x.float()
    lo, hi = xf.amin(-1, keepdim=True).clamp(max=0), xf.amax(-1, keepdim=True).clamp(min=0)
    eps = torch.finfo(x.dtype).smallest_normal if eps is None else eps
    r = lambda t: _round_to(t, x.dtype)  # noqa: E731
    if symmetric:
        scale = r(torch.max(-lo, hi) / (float(qmax - qmin) / 2)).clamp(min=eps).to(x.dtype)
        return scale, torch.zeros_like(scale)
    scale = r(r(hi - lo) / float(qmax - qmin)).clamp(min=eps)
    return scale.to(x.dtype), (qmin - torch.round(r(lo / scale))).clamp(qmin, qmax).to(x.dtype)


def _mask_as_difference(x):
    """Whether a compiled fake quant keeps its clamp mask as the float difference, not as bools:
    Inductor's CPU kernels (torch 2.13) store and load bool tensors through a slow path, 2-20x the
    time of the whole fake quant (a conversion is slow too)."""
    return x.device.type == "cpu"


class _FakeQuantize(torch.autograd.Function):
    # torchao's fake quantize (scale, round, shift, clamp, and back) in the dtype torchao computes
    # it in (x's, or the scale's if wider); the gradient is straight-through except where the clamp
    # held, as torchao's, and needs only that mask
    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin, qmax):
        ct = torch.promote_types(x.dtype, scale.dtype)  # the dtype torchao computes in
        zero_point = zero_point.to(ct)  # integers, which it holds exactly
        if torch.compiler.is_compiling():
            # out of place, and no .to() that returns its input: torch 2.11's dynamo sends the
            # gradient of an autograd.Function whose output is also one of its intermediates (the
            # result of an in-place op, or of such a .to()) to another output, and every input's
            # gradient is zero (pytorch/pytorch#180642): compiled QAT on an H100 trained no weight,
            # and nothing said so. Inductor fuses the passes anyway. In fp32, each op rounded where
            # eager's rounds (_round_to says why)
            r = lambda t: _round_to(t, ct)  # noqa: E731
            s, zero_point = scale.float(), zero_point.float()
            q = torch.round(r(x.float() * r(1.0 / s))) + zero_point
            clamped = q.clamp(qmin, qmax)
            # where the clamp moved q the gradient stops: there q - clamped is a nonzero integer
            clipped = q - clamped
            # as a difference, backward multiplies by 1 - min(|difference|, 1)
            ctx.save_for_backward(clipped if _mask_as_difference(x) else clipped != 0)
            out = (clamped - zero_point) * s
            return out if out.dtype == x.dtype else out.to(x.dtype)
        # eager: in place, fewer passes over memory
        q = x * (1.0 / scale)
        q = q.round_().add_(zero_point)
        clamped = q.clamp(qmin, qmax)
        clipped = q.sub_(clamped)
        # a cast to bool: ATen writes a compare's bool result 2-3x slower than it casts floats
        ctx.save_for_backward(clipped.bool())
        return clamped.to(x.dtype).sub_(zero_point.to(x.dtype)).mul_(scale)

    @staticmethod
    def backward(ctx, grad):
        clipped, = ctx.saved_tensors
        if clipped.dtype != torch.bool:  # compiled on a CPU: the difference itself
            return grad * (1 - clipped.abs().clamp(max=1)).to(grad.dtype), None, None, None, None
        # where, not grad * mask: a product first converts the bool mask to grad's dtype, a pass of its own
        return torch.where(clipped, 0, grad), None, None, None, None


class FusedFakeQuantizer(IntxFakeQuantizer):
    """torchao's per-token (asymmetric) and per-group (symmetric) fake quantizer, computing the
    same scales, zero points and values in fewer passes over memory."""

    def forward(self, x):
        if not self.enabled:
            return x
        cfg = self.config
        qmin, qmax = _DTYPE_TO_QVALUE_BOUNDS[cfg.dtype]
        per_token = isinstance(cfg.granularity, PerToken)
        v = x if per_token else x.view(x.shape[0], -1, cfg.granularity.group_size)  # rows: tokens, or groups
        # no gradient flows back through the scales (none does in torchao): outside the autograd
        # graph, they spare backward a chain of min, max and clamp nodes per quantizer
        scale, zero_point = _qparams(v.detach(), qmin, qmax, cfg.eps, symmetric=not per_token)
        return _FakeQuantize.apply(v, scale.to(cfg.scale_precision), zero_point.to(cfg.zero_point_precision),
                                   qmin, qmax).view(x.shape)


def fuse_fake_quant(m):
    """Swaps torchao's fake quantizers for FusedFakeQuantizer where it computes the same thing."""
    for mod in m.modules():
        for name in ("activation_fake_quantizer", "weight_fake_quantizer"):
            fq = getattr(mod, name, None)
            if type(fq) is IntxFakeQuantizer and not fq.config.range_learning and (
                    isinstance(fq.config.granularity, PerToken) and not fq.config.is_symmetric
                    or isinstance(fq.config.granularity, PerGroup) and fq.config.is_symmetric):
                new = FusedFakeQuantizer(fq.config)
                new.enabled = fq.enabled
                setattr(mod, name, new)


class LearnedScaleFakeQuantizer(nn.Module):
    """Symmetric per-group fake quantization of a weight (out, in) whose scales (out, in / group)
    are trained with it (LSQ, Esser et al. 2020; torchao's range_learning): rounding passes the
    gradient straight through, so a scale s learns d(q * s)/ds = round(w/s) - w/s inside the grid,
    and qmin or qmax where the clamp holds. The parameter is learned_scale; the scale is its
    magnitude, so that a step past 0 flips no grid. torchao's conversion reads `scale` and
    `zero_point` from here (config.range_learning) instead of choosing its own."""

    def __init__(self, config, weight):
        super().__init__()
        self.config, self.enabled = config, True
        # the weight's dtype: FSDP2 shards a block's parameters together, in one dtype
        self.learned_scale = nn.Parameter(torch.empty(weight.shape[0], weight.shape[1] // config.granularity.group_size,
                                                      dtype=weight.dtype, device=weight.device))

    @property
    def scale(self):
        # floored, as the conversion reads it, but with the gradient passed through the floor: a group
        # of zeros starts at torchao's eps (1e-38), and a floor that stopped the gradient would pin it there
        a = self.learned_scale.float().abs()
        return a + (a.clamp(min=1e-9) - a).detach()

    @property
    def zero_point(self):  # symmetric: zero
        return torch.zeros_like(self.learned_scale, dtype=torch.int32)

    def forward(self, w):
        if not self.enabled:
            return w
        qmin, qmax = _DTYPE_TO_QVALUE_BOUNDS[self.config.dtype]
        s = self.scale.unsqueeze(-1)  # (out, groups, 1)
        x = w.float().view(*s.shape[:2], -1) * (1.0 / s)  # as torchao rounds: by the reciprocal
        q = (x + (x.round() - x).detach()).clamp(qmin, qmax)
        return (q * s).view(w.shape).to(w.dtype)


def learn_scales(m):
    """Swaps the per-group weight fake quantizer of each prepared linear layer for a
    LearnedScaleFakeQuantizer of the same bits and groups (its scales still to be set)."""
    for mod in m.modules():
        fq = getattr(mod, "weight_fake_quantizer", None)
        if isinstance(mod, nn.Linear) and isinstance(fq, IntxFakeQuantizer) and isinstance(fq.config.granularity, PerGroup):
            c = fq.config
            config = IntxFakeQuantizeConfig(c.dtype, c.granularity, c.mapping_type, c.scale_precision, c.zero_point_precision,
                                            c.zero_point_domain, is_dynamic=False, range_learning=True, eps=c.eps)
            learned = LearnedScaleFakeQuantizer(config, mod.weight)
            learned.enabled = fq.enabled
            mod.weight_fake_quantizer = learned


def weights_only(state):
    """state without the LearnedScaleFakeQuantizer scales: those are training state, which
    checkpoints keep; the model itself is its weights."""
    return {k: v for k, v in state.items() if not k.endswith(".learned_scale")}


def _max_scales(w, fq):
    """The scales torchao's dynamic fake quantizer computes for weight rows w, shaped as fq's and in
    its dtype (the model's: a bfloat16 checkpoint finetuned in float32 gets float32 scales)."""
    scale, _ = get_group_qparams_symmetric(w.float(), _DTYPE_TO_BIT_WIDTH[fq.config.dtype], fq.config.granularity.group_size,
                                           torch.float32, eps=fq.config.eps)
    return scale.view(w.shape[0], -1).to(fq.learned_scale.dtype)


@torch.no_grad()
def initial_scales(m, state):
    """{name: scales} for each LearnedScaleFakeQuantizer of m, computed from the weights in the
    state dict `state` as torchao's dynamic fake quantizer computes them: training starts where
    plain QAT would (exactly in float32; in bfloat16 with the same scales, but the weights divided
    by them in float32, as the conversion does, where torchao's bf16 fake quant rounds about 1% of
    them to the neighbouring level)."""
    return {f"{path}.weight_fake_quantizer.learned_scale": _max_scales(state[f"{path}.weight"], mod.weight_fake_quantizer)
            for path, mod in m.named_modules() if isinstance(getattr(mod, "weight_fake_quantizer", None), LearnedScaleFakeQuantizer)}


def local_rows(mod):
    """A prepared linear layer's weight and learned scales as this process holds them: FSDP shards
    both by rows, alike, so a rank's rows of one match its rows of the other."""
    return tuple(t.to_local() if hasattr(t, "to_local") else t for t in (mod.weight, mod.weight_fake_quantizer.learned_scale))


def reshard(m):
    """Puts every FSDP module of m back on its shards. A forward leaves the root's parameters (norm,
    output) gathered, as an evaluation's does: a write into the gathered copy would be lost at the
    next reshard, and the shards the optimizer steps would keep the old values."""
    for mod in m.modules():
        if isinstance(mod, FSDPModule):
            mod.reshard()


@torch.no_grad()
def restart_scales(m):
    """Sets every learned scale of m from its layer's weights as they are now: when fake quant
    starts after full-precision steps, the weights have moved since the scales were set; on FSDP
    shards too, each rank its own rows (local_rows)."""
    reshard(m)  # an evaluation may just have run
    for mod in m.modules():
        fq = getattr(mod, "weight_fake_quantizer", None)
        if isinstance(fq, LearnedScaleFakeQuantizer):
            w, s = local_rows(mod)
            if w.numel():  # a rank may hold no rows of a small layer
                s.copy_(_max_scales(w, fq))


@torch.no_grad()
def gptq_(w, hessian, fq, damp=0.01, block=128):
    """GPTQ (Frantar et al. 2022) of weight rows w (out, in) on the grid of the LearnedScaleFakeQuantizer
    fq, whose scales for these rows it returns (out, in / group). The columns are rounded one by one,
    each rounding's error, weighted by the inverse of the layer's input Hessian (sum of x x^T over
    the calibration tokens), moved onto the columns not rounded yet; a group's scale is the usual
    max-based one, of its weights as they are when the group is reached. w is left holding each
    column as it was just before its rounding, so that it rounds, on those scales, to GPTQ's integers:
    the start of a finetune that goes on from GPTQ's model. Rows are independent: FSDP's shards of a
    weight (whole rows) are each done on their own rank, with the whole Hessian."""
    qmin, qmax = _DTYPE_TO_QVALUE_BOUNDS[fq.config.dtype]
    g = fq.config.granularity.group_size
    block = max(1, block // g) * g  # a group never spans two blocks
    W, H = w.to(hessian.device, torch.float32), hessian.float().clone()  # w may be offloaded to the host
    dead = H.diagonal() == 0  # inputs that were always zero: their weights do nothing, and are set so
    H[dead, dead] = 1
    W[:, dead] = 0
    H.diagonal().add_(damp * H.diagonal().mean())
    try:  # the upper Cholesky factor of H's inverse: row i holds what rounding column i feeds forward
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    except torch.linalg.LinAlgError:
        raise ValueError(f"GPTQ: a layer's input Hessian ({H.shape[0]} inputs) is not positive definite even "
                         f"with {damp:.0%} damping; calibrate on more tokens (gptq_tokens)") from None
    scales = torch.empty(W.shape[0], W.shape[1] // g, dtype=torch.float32, device=W.device)
    for b in range(0, W.shape[1], block):
        Wb, err = W[:, b:b + block], torch.empty_like(W[:, b:b + block])  # Wb: a view, rounded in place
        Hb = Hinv[b:b + block, b:b + block]
        for i in range(Wb.shape[1]):
            if i % g == 0:  # torchao's symmetric scale of the group as it is now
                s = _qparams(Wb[:, i:i + g], qmin, qmax, fq.config.eps, symmetric=True)[0][:, 0]
                s = s.to(fq.learned_scale.dtype).float()  # the scale as fq will hold it
                scales[:, (b + i) // g] = s
            col = Wb[:, i].clone()
            q = (col * (1.0 / s)).round().clamp(qmin, qmax) * s  # as the fake quantizer rounds
            err[:, i] = (col - q) / Hb[i, i]
            Wb[:, i:] -= err[:, i:i + 1] * Hb[i:i + 1, i:]  # column i becomes q; the later ones take its error
            Wb[:, i] = col  # kept unrounded: the value that rounds to q
        W[:, b + block:] -= err @ Hinv[b:b + block, b + block:]
    w.copy_(W)
    return scales.to(fq.learned_scale.dtype)  # exact: each was rounded to that dtype when used


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
            if a.shape[0] != args.lora_rank:  # the scale is alpha / rank: another rank would merge at another scale
                raise ValueError(f"{prefix}lora_a has rank {a.shape[0]}, but the args say lora_rank={args.lora_rank}")
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

