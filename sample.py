"""
Generate text from any checkpoint: a training checkpoint (ckpt.pt), a merged student (model.pt),
a converted quantized model (quantized.pt), or a Meta / Hugging Face directory.

$ python sample.py --init_from=out/tiny_qat/quantized.pt --start="def fibonacci(n):"
$ python sample.py --init_from=out/tiny_base/ckpt.pt --num_samples=3 --temperature=0.8
"""

import logging
import os
import time

import torch

# torchao's import logs notes about GPU-only kernels and a torch deprecation: not the user's concern
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
import sentencepiece as spm
import torchao  # noqa: F401  (registers the quantized tensor types quantized.pt holds)

from checkpoint import load_checkpoint
from model import Transformer, merge_lora

# -----------------------------------------------------------------------------
init_from = "out/tiny_qat/quantized.pt"  # a checkpoint file or a Meta / HF directory
tokenizer = ""  # a SentencePiece model; '' looks beside init_from, then in data_dir
data_dir = "data/stdlib"
start = "\n"  # the prompt; 'FILE:path' reads it from a file
num_samples = 2
max_new_tokens = 200
temperature = 0.8  # 0 is greedy
top_k = 200  # None keeps every token
seed = 1337
device = "cpu"
dtype = "float32"  # of the full-precision weights; quantized ones keep their own
# -----------------------------------------------------------------------------
from configurator import configure

configure(globals())

torch.manual_seed(seed)
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
if ptdtype != torch.float32:
    state = {k: v.to(ptdtype) if type(v) is torch.Tensor and v.is_floating_point() else v for k, v in state.items()}
# quantized weights are torchao tensor subclasses that know how to multiply: assigning them
# in place of the float parameters is all it takes to run the converted model
model.load_state_dict(state, assign=True)
model.reset_buffers(device)
model.to(device).eval()
quantized = any(type(p).__module__.startswith("torchao") for p in model.parameters())

candidates = [tokenizer] if tokenizer else [
    os.path.join(init_from if os.path.isdir(init_from) else os.path.dirname(init_from), "tokenizer.model"),
    os.path.join(data_dir, "tokenizer.model")]
tok_path = next((p for p in candidates if os.path.isfile(p)), None)
if tok_path is None:
    raise SystemExit(f"error: no tokenizer.model found in {candidates}; pass --tokenizer=PATH")
sp = spm.SentencePieceProcessor(model_file=tok_path)
if start.startswith("FILE:"):
    with open(start[5:], encoding="utf-8") as f:
        start = f.read()
ids = sp.encode(start) or [sp.bos_id()]
x = torch.tensor([ids], dtype=torch.long, device=device)
print(f"{init_from}: {'quantized' if quantized else 'full precision'}, {sum(p.numel() for p in model.parameters()):,} parameters")
for _ in range(num_samples):
    t0 = time.perf_counter()
    y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k, eos_id=sp.eos_id())
    dt = time.perf_counter() - t0
    print(sp.decode(y[0].tolist()))
    print(f"---------------  {y.shape[1] - x.shape[1]} tokens in {dt:.1f} s")
