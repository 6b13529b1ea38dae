"""
Generate text from any checkpoint: a training checkpoint (ckpt.pt), a merged student (model.pt),
a converted quantized model (quantized.pt), or a Meta / Hugging Face directory. The tokenizer is
the one beside the checkpoint (training copies it into out_dir) or in the directory; one given
with --tokenizer must match the fingerprint the checkpoint records. The prompt starts with BOS
when the tokenizer has one, as every training document did.

$ python sample.py --init_from=out/tiny_qat/quantized.pt --start="def fibonacci(n):"
$ python sample.py --init_from=out/tiny_base/ckpt.pt --num_samples=3 --temperature=0.8
$ python sample.py --init_from=out/tiny_qat/quantized.pt --export_pte=out/tiny_qat/model.pte
"""

import logging
import os
import sys
import time

import torch

# torchao's import logs notes about GPU-only kernels and a torch deprecation: not the user's concern
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
import torchao  # noqa: F401  (registers the quantized tensor types quantized.pt holds)

from checkpoint import load_checkpoint, source_stop_ids, stop_ids, tokenizer_of
from data_prep import load_tokenizer, tokenizer_mismatch
from model import Transformer, merge_lora

# -----------------------------------------------------------------------------
init_from = "out/tiny_qat/quantized.pt"  # a checkpoint file or a Meta / HF directory
tokenizer = ""  # a tokenizer file or folder; '' = the one beside the checkpoint, or in the HF / Meta directory
start = "\n"  # the prompt; 'FILE:path' reads it from a file
num_samples = 2
max_new_tokens = 200
temperature = 0.8  # 0 is greedy
top_k = 200  # 0 keeps every token
seed = 1337
device = "cpu"
dtype = "float32"  # of the full-precision weights (a converted model computes in the dtype it was converted in)
export_pte = ""  # a path: write the converted model there as an ExecuTorch program (XNNPACK) instead of sampling
pte_max_seq_len = 0  # the program's KV cache, in positions; 0: the model's context, at most checkpoint.PTE_CONTEXT
# -----------------------------------------------------------------------------
from configurator import configure

_, overridden = configure(globals(), positive=("num_samples", "max_new_tokens"))
if "pte_max_seq_len" in overridden and not export_pte:
    raise SystemExit("error: pte_max_seq_len sizes the cache of the --export_pte program; give --export_pte=PATH, or drop it")
if export_pte and (unread := [k for k in ("start", "num_samples", "max_new_tokens", "temperature", "top_k", "seed")
                                if k in overridden]):
    raise SystemExit(f"error: --export_pte writes a program and samples nothing: {', '.join(unread)} not read; drop them")
if temperature == 0 and (unread := [k for k in ("top_k", "seed") if k in overridden]):
    raise SystemExit(f"error: temperature=0 is greedy and draws nothing: {', '.join(unread)} not read; drop them")
if dtype not in ("float32", "bfloat16"):
    raise SystemExit(f"error: dtype={dtype!r} is not supported; use 'float32' or 'bfloat16'")
if device != "cpu" and not (device.split(":")[0] == "cuda" and torch.cuda.is_available()):
    raise SystemExit(f"error: device={device!r} is not available here; use 'cpu' or, with a visible GPU, 'cuda'")

if not os.path.exists(init_from):
    raise SystemExit(f"error: init_from={init_from!r} does not exist")
torch.manual_seed(seed)
# the tokenizer first: a wrong one would print confident garbage after a long load
ckpt_dir = init_from if os.path.isdir(init_from) else os.path.dirname(init_from) or "."
try:
    tok = load_tokenizer(tokenizer or ckpt_dir)
except ValueError as e:
    raise SystemExit(f"error: {e}" + ("" if tokenizer else "; pass --tokenizer=PATH"))
ckpt_file = os.path.join(init_from, "ckpt.pt") if os.path.isdir(init_from) else init_from
if os.path.isfile(ckpt_file):  # training checkpoints record the fingerprint of their data's tokenizer
    try:
        ckpt = torch.load(ckpt_file, mmap=True, weights_only=True, map_location="cpu")
    except Exception:  # not a checkpoint torch can read: load_checkpoint below says why
        ckpt = None
    recorded = ckpt.get("tokenizer") if isinstance(ckpt, dict) else None
    source_stops = source_stop_ids(init_from, ckpt) if isinstance(ckpt, dict) else []
    trained_context = ckpt.get("trained_context") if isinstance(ckpt, dict) else None  # (older checkpoints: none)
    del ckpt
else:  # an HF or Meta directory: the tokenizer its nanotune.json records, or its own tokenizer file
    recorded = tokenizer_of(init_from, None, tok.kind)
    source_stops = source_stop_ids(init_from, None)
    trained_context = None
# generation stops at the EOS, and where the source model says it stops too (an Instruct model's end of turn)
stops = stop_ids({"eos_id": tok.eos_id, "tokenizer": {"kind": tok.kind}, "vocab_size": tok.vocab_size}, source_stops)
if recorded and (diff := tokenizer_mismatch(recorded, tok.fingerprint())):
    raise SystemExit(f"error: tokenizer {tokenizer or ckpt_dir} is not the one {init_from} was trained with ({diff}); "
                     f"give the one it was trained with (leave --tokenizer out for the one beside the checkpoint, if any)")
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
try:
    args, state = load_checkpoint(init_from)
except ValueError as e:
    raise SystemExit(f"error: {e}")
if args.lora_rank:  # a LoRA student: sample from its merged weights
    state = merge_lora(state, args)
    args.lora_rank = 0
args.tie_embeddings = False  # a tied checkpoint's state dict carries output.weight too
with torch.device("meta"):
    model = Transformer(args)
qdtypes = {v.dtype for v in state.values() if type(v).__module__.startswith("torchao")}
if qdtypes:  # a converted model computes in the dtype it was converted in: its other weights follow
    if len(qdtypes) > 1:
        raise SystemExit(f"error: {init_from} holds quantized weights of several dtypes ({sorted(map(str, qdtypes))}); convert it again")
    qdtype = next(iter(qdtypes))
    if "dtype" in overridden and ptdtype != qdtype:
        raise SystemExit(f"error: {init_from} is a converted model, which computes in {qdtype}; drop --dtype")
    ptdtype = qdtype
# every plain weight in ptdtype, whatever the file holds (a bf16 directory runs in float32 when asked)
state = {k: v.to(ptdtype) if type(v) is torch.Tensor and v.is_floating_point() else v for k, v in state.items()}
# quantized weights are torchao tensor subclasses that know how to multiply: assigning them
# in place of the float parameters is all it takes to run the converted model
model.load_state_dict(state, assign=True)
model.reset_buffers(device)
model.to(device).eval()
quantized = any(type(p).__module__.startswith("torchao") for p in model.parameters())
if tok.vocab_size > args.vocab_size:
    raise SystemExit(f"error: the tokenizer has {tok.vocab_size} tokens but {init_from} only {args.vocab_size}; "
                     f"it belongs to another model")
if args.vocab_size - tok.vocab_size >= 1024:  # rows past the tokenizer's are padding, never this many
    raise SystemExit(f"error: {init_from} has {args.vocab_size} vocabulary rows but the tokenizer only {tok.vocab_size}; "
                     f"it belongs to another model")

if export_pte:
    from checkpoint import export_executorch, pte_summary
    try:
        print(f"exported: {pte_summary(export_pte, args, export_executorch(model, export_pte, pte_max_seq_len or None))}")
    except (ValueError, ImportError) as e:
        raise SystemExit(f"error: {e}")
    raise SystemExit(0)

if start.startswith("FILE:"):
    with open(start[5:], encoding="utf-8-sig") as f:  # a BOM is no text, as data_prep.py reads files
        start = f.read()
if tok.specials and (found := tok.specials.search(start)):  # a chat template's markers, or a BOS of the user's own
    print(f"warning: --start holds {found.group()!r}, a special token's text, which is encoded as plain text (as "
          f"data_prep.py encodes it in documents), not as the special token"
          f"{'; BOS is put before the prompt already' if tok.bos_id is not None else ''}", file=sys.stderr)
ids = ([] if tok.bos_id is None else [tok.bos_id]) + tok.encode(start)  # documents were trained from BOS
if not ids:
    raise SystemExit("error: --start is empty and the tokenizer has no BOS to start from; give a prompt")
if len(ids) > args.max_seq_len:  # generate would read its last max_seq_len tokens alone, BOS and all dropped
    raise SystemExit(f"error: the prompt is {len(ids)} tokens, longer than {init_from}'s context of {args.max_seq_len}; shorten --start")
if trained_context and len(ids) + max_new_tokens > trained_context:
    print(f"note: {init_from} was trained on windows of at most {trained_context} tokens (a model from scratch knows no "
          f"later positions), and the prompt and {max_new_tokens} new tokens reach {len(ids) + max_new_tokens}: expect "
          f"the text to degrade past it", file=sys.stderr)
x = torch.tensor([ids], dtype=torch.long, device=device)
print(f"{init_from}: {'quantized' if quantized else 'full precision'}, {sum(p.numel() for p in model.parameters()):,} parameters, "
      f"computing in {', '.join(sorted({str(p.dtype).removeprefix('torch.') for p in model.parameters()}))}")


def timed_generate(n):
    t0 = time.perf_counter()
    y = model.generate(x, n, temperature=temperature, top_k=top_k or None, eos_id=stops,
                       n_ids=tok.vocab_size)
    return y, time.perf_counter() - t0


# tokens/s measures generation alone: each sample's time less the time to its first token
# (prefill and one step), timed warm just before it; the very first call warms up and is not timed
timed_generate(1)
for _ in range(num_samples):
    _, t_first = timed_generate(1)
    y, dt = timed_generate(max_new_tokens)
    n_new = y.shape[1] - x.shape[1]
    print(tok.decode(y[0, int(tok.bos_id is not None):].tolist()))
    rate = ("" if n_new < 2 else f", {(n_new - 1) / (dt - t_first):.1f} tokens/s after the first (prefill excluded)"
            if dt > t_first else ", too few to time after the first")  # a run shorter than its warm first token
    print(f"---------------  {n_new} tokens in {dt:.1f} s{rate}")
