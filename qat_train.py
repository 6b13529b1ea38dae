"""
Quantization-aware training (QAT) of a Llama-family model with FSDP2, in one file.

One process (CPU or one GPU):
$ python qat_train.py config/tiny_qat.py
Several processes (GPUs, or CPU processes on gloo), e.g. a Llama-3-8B finetune on one node:
$ torchrun --standalone --nproc_per_node 8 qat_train.py config/llama.py
Post-training quantization (PTQ) or conversion of any checkpoint, no training:
$ python qat_train.py --init_from=out/base/ckpt.pt --quantizer=8da2w --convert_only=True --out_dir=out/ptq

During training the linear layers are fake-quantized (torchao's QATConfig "prepare"): the
forward pass sees weights (and activations) rounded to the target integer grid, so the model
learns weights that survive rounding. At the end the model is converted for real (QATConfig
"convert") and both the full-precision and the converted model are evaluated on the whole
validation split. quantizer='none' runs the same loop as a plain finetune: the baseline QAT
must beat, and the way to train a base model from scratch.
"""

import ctypes
import json
import logging
import math
import os
import resource
import sys
import time
from contextlib import nullcontext, suppress
from datetime import timedelta
from functools import lru_cache

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint as activation_checkpoint
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from tqdm import tqdm

# torchao's import logs notes about GPU-only kernels and a torch deprecation: not the user's concern
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, PerGroup, quantize_
from torchao.quantization.qat import QATConfig

from checkpoint import (TO_SINGLE_FILE, atomic_save, check_resume, checkpoint_digest, export_executorch, export_hf, export_meta,
                        hf_unexportable, load_checkpoint, load_sharded_checkpoint, lock_dir, pte_summary, ranks_not_sharing,
                        remove_earlier_outputs, save_training_checkpoint, set_aside_checkpoint, sharded_dir,
                        source_generation, source_stop_ids, stop_ids, tokenizer_of)
from data_prep import DataPrepError, load_data_meta, load_tokenizer, remove_tokenizer_files, tokenizer_mismatch
from model import (IGNORE_INDEX, PRESETS, ModelArgs, Transformer, check_quantizable, flops_per_token, fuse_fake_quant,
                   LearnedScaleFakeQuantizer, gptq_, initial_scales, learn_scales, local_rows, merge_lora, peak_flops,
                   reshard, restart_scales, weights_only)

# -----------------------------------------------------------------------------
# I/O
out_dir = "out/qat"  # ckpt.pt, quantized.pt, log.jsonl and a copy of the data's tokenizer go here
data_dir = "data/stdlib"  # train.bin, val.bin and meta.json from data_prep.py
init_from = "scratch"  # 'scratch', 'resume' (out_dir/ckpt.pt), or a checkpoint file / Meta / HF directory
convert_only = False  # skip training: evaluate, convert and save the init_from model
ptq_baseline = True  # when finetuning a checkpoint with a quantizer, first evaluate PTQ of its weights
eval_interval = 100  # steps between validation estimates
eval_iters = 20  # batches per process per validation estimate; the final evaluation uses the whole split
log_interval = 10  # steps between log lines (the only steps that sync with the device)
ckpt_interval = 500  # steps between checkpoints; one is always written at the end
# each process writes its own shards of model and optimizer to out_dir/ckpt/ (torch.distributed.checkpoint)
# instead of rank 0 gathering everything into ckpt.pt: for models whose training state outgrows one host
sharded_checkpoint = False
export_format = "none"  # also write the trained full-precision model as an 'hf' or 'meta' directory, or the converted one as 'pte' (ExecuTorch)
wandb_log = False  # also log to Weights & Biases (imported only then)
wandb_project = "nanotune"
wandb_run_name = "qat"
# model, for init_from='scratch' (a checkpoint carries its own shape)
preset = "tiny"  # a name from model.PRESETS
n_layer = 0  # 0: the preset's value
n_head = 0
n_kv_head = 0
n_embd = 0
# quantization
quantizer = "8da4w"  # 'none', '8daNw' (int8 dynamic activations, intN weights), 'Nw' (weight-only), N in 2..8, or '4w-gpu' (int4 weight-only, CUDA)
group_size = 32  # weights share one scale per group of this many input channels
fake_quant_after_n_steps = 0  # train in full precision until this step, then fake-quantize
quantize_embedding = False  # also fake-quantize the token embedding (weight-only, same bits)
quant_skip = ()  # modules left in full precision, by path, e.g. ('output', 'layers.0')
# learn each weight group's scale with the weights (LSQ; torchao's range_learning), starting from
# the scales plain QAT computes; the conversion then uses the learned ones
range_learning = False
range_lr_ratio = 1.0  # the learned scales' learning rate, as a multiple of the weights'
# > 0: start from GPTQ's model (Frantar et al. 2022) instead of the checkpoint's weights as they are,
# calibrated on this many train tokens; its scales are kept as learned ones (needs range_learning)
gptq_tokens = 0
# data and batch
batch_size = 16  # micro-batch size per process
block_size = 128  # tokens per sequence
loss_chunk = 0  # tokens per chunk of the loss (logits recomputed in backward); 0: fp32 logits <= 128 MiB
gradient_accumulation_steps = 0  # micro-batches per optimizer step over all processes; 0: one per process
# reduce gradients once per step instead of once per micro-batch: less traffic, but every process
# then holds a full unsharded gradient between micro-batches (2 bytes a parameter in bf16, 4 with
# mixed_precision: 16-32 GB for an 8B model)
accumulate_unsharded = False
# optimizer and schedule
max_iters = 300  # optimizer steps
learning_rate = 3e-4  # peak learning rate
min_lr = 3e-5  # the cosine decays to this at lr_decay_iters
lr_decay_iters = 0  # 0: max_iters; set it to stop a run early on the schedule of a longer one
warmup_iters = 30  # linear warmup steps
weight_decay = 0.1  # applied to matrices only
norm_lr_ratio = 1.0  # the RMSNorm gains' learning rate, as a multiple of the weights' (README, Quality)
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # clip the global gradient norm to this; float('inf') logs it without clipping
optimizer_in_bwd = False  # step each parameter inside backward, freeing its gradient early
# > 0: the model trained ends as the running average of its weights over the steps, each step
# keeping ema_decay of the average (about the last 1 / (1 - ema_decay) steps count), restarted when
# fake quant begins: what is evaluated, saved and converted. One more copy of the trained weights
# (README, Quality)
ema_decay = 0.0
# system
device = "cpu"  # 'cpu' or 'cuda'
dtype = "float32"  # 'float32' or 'bfloat16'
mixed_precision = False  # with bfloat16: fp32 master weights and reductions, bf16 compute
compile = False  # torch.compile each transformer block and the loss
activation_checkpointing = 0  # recompute activations of every k-th block in backward (0: off)
activation_offloading = False  # keep saved activations in pinned CPU memory (CUDA only)
cpu_offload = False  # keep parameters, gradients and optimizer state on the CPU (CUDA only)
reshard_after_forward = True  # free gathered parameters after forward (less memory, more traffic)
replicate_degree = 1  # HSDP: shard within groups of world_size / replicate_degree processes (a node), replicate across
profile = False  # write a torch.profiler trace to out_dir
profile_wait, profile_warmup, profile_active = 5, 2, 3  # profiler schedule, in steps
peak_flops_per_device = 0.0  # for MFU; 0: a table for known GPUs, a measured matmul on CPU
seed = 1337
# -----------------------------------------------------------------------------
from configurator import (TRAINING_ONLY, ConfigError, check_training, code_digest, command_line_keys, configure,
                          ranks_disagree)

config, overridden = configure(globals(), positive=("batch_size", "block_size", "eval_interval", "eval_iters",
                                                    "log_interval", "ckpt_interval", "group_size", "grad_clip",
                                                    "replicate_degree", "norm_lr_ratio", "profile_active"))

# derived values and checks: every mistake a user can make fails here, before any real work
torchrun = "RANK" in os.environ  # launched by torchrun: the process group comes from its variables
rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
master_process = rank == 0


compared = False  # whether the processes have found that they run one job (below)


def fail(msg, every_node=False):
    # until then a node may fail alone, on files of its own: the first process of each node says why,
    # and the others, which wait for this process's job, are handed its error instead and stop too
    if master_process or (local_rank == 0 and (every_node or not compared)):
        print(f"error{f' (rank {rank})' if rank else ''}: {msg}", file=sys.stderr)
    if world_size > 1 and not compared and dist.is_initialized():
        dist.all_gather_object([None] * world_size, {"failed": msg})
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(2)


try:
    quant_bits, gradient_accumulation_steps = check_training(config, overridden, world_size)
except ConfigError as e:
    fail(str(e))
if master_process and not convert_only and 0 < max_iters <= warmup_iters:  # e.g. a short run under a config's warmup
    print(f"warning: warmup_iters={warmup_iters} outlasts max_iters={max_iters}: the learning rate rises to "
          f"{learning_rate * max_iters / (warmup_iters + 1):.3g} and never reaches learning_rate={learning_rate:g}")
# recorded as derived: a resume compares it, and 0 would mean another batch on another process count
config["gradient_accumulation_steps"] = gradient_accumulation_steps

# -----------------------------------------------------------------------------
# distributed init: a process group even for one process, so that one code path (FSDP2 on a
# mesh of size 1) serves both `python` and `torchrun`. Before the checks that read files: a process
# that fails on its node's own files then stops the others too (fail), rather than leave them waiting
device_type = device
if device_type == "cpu" and sys.platform == "linux":
    # glibc hands each freed block over 32 MiB back to the system, so every vocabulary-sized
    # temporary of a step (fp32 logits, their softmax, the KD's) is page-faulted in afresh, at 3-10x
    # the op's own time: keep freed memory for reuse instead (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD)
    with suppress(OSError, AttributeError):  # not glibc
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)
        libc.mallopt(-1, (1 << 31) - 1)
if device_type == "cuda":
    device = f"cuda:{local_rank}"
    torch.cuda.set_device(device)
# on CUDA, gloo beside nccl: with cpu_offload the gradients (and their norm) live on the CPU
backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
if torchrun:
    dist.init_process_group(backend, device_id=torch.device(device) if device_type == "cuda" else None)
else:
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
micro_steps = gradient_accumulation_steps // world_size  # micro-batches per process per step
if optimizer_in_bwd and micro_steps > 1:
    fail("optimizer_in_bwd=True steps inside backward, so it cannot accumulate gradients; set gradient_accumulation_steps to the number of processes")
if optimizer_in_bwd and math.isfinite(grad_clip):
    fail("optimizer_in_bwd=True steps before the global gradient norm is known; set grad_clip=float('inf')")
if convert_only and (unused := [k for k in TRAINING_ONLY if k in command_line_keys()]):
    fail(f"convert_only=True trains nothing, so {', '.join(unused)} would be ignored; drop them or set convert_only=False")
if "ptq_baseline" in command_line_keys() and (quant_bits is None or init_from in ("scratch", "resume") or convert_only):
    fail("ptq_baseline evaluates PTQ of the init_from checkpoint before a finetune with a quantizer; this run is not "
         "one (no quantizer, init_from 'scratch' or 'resume', or convert_only): drop it")
if convert_only and (init_from == "scratch" or quant_bits is None):
    fail("convert_only=True needs trained weights (init_from) and a quantizer, e.g. --quantizer=8da4w")
if gptq_tokens < 0 or gptq_tokens and (quant_bits is None or init_from == "scratch" or not range_learning
                                        or fake_quant_after_n_steps):
    fail(f"gptq_tokens={gptq_tokens} starts from GPTQ's rounding of the init_from checkpoint, whose scales only learned "
         f"ones keep: it needs a quantizer, a checkpoint, range_learning=True and fake_quant_after_n_steps=0")

resume_path = (sharded_dir(out_dir) or os.path.join(out_dir, "ckpt.pt")) if init_from == "resume" else init_from
sharded_from = sharded_dir(resume_path) if init_from != "scratch" else None  # weights read shard by shard
if init_from != "scratch" and not os.path.exists(resume_path):
    fail(f"init_from={init_from!r}: {resume_path} does not exist; give 'scratch', 'resume' (after a run in out_dir) or a checkpoint")
inputs = [resume_path] if init_from != "scratch" else []
# a fresh run sets an earlier one's checkpoint in out_dir aside (below), so never reads one that is
try:
    set_aside_checkpoint(out_dir, inputs, move=False)
except ValueError as e:
    fail(str(e))
if init_from == "scratch" and preset not in PRESETS:
    fail(f"preset={preset!r} is unknown; choose from {sorted(PRESETS)}")
try:
    data_meta = load_data_meta(data_dir, block_size)
except DataPrepError as e:
    fail(str(e))
data_tokenizer = data_meta.get("tokenizer")  # its fingerprint; hand-made data may have none

# the model's shape: from the checkpoint, or from the preset and overrides
init_state, ckpt = None, {}
if init_from == "scratch":
    shape = dict(PRESETS[preset], vocab_size=data_meta["vocab_size"])
    for key, value in (("n_layers", n_layer), ("n_heads", n_head), ("n_kv_heads", n_kv_head), ("dim", n_embd)):
        shape[key] = value or shape.get(key)
    try:
        model_args = ModelArgs(**shape)
    except ValueError as e:  # a shape that cannot be, e.g. n_head not dividing n_embd
        fail(str(e))
elif sharded_from:  # the small things now; every rank reads its shards once the model is sharded
    ckpt = torch.load(os.path.join(sharded_from, "state.pt"), map_location="cpu", weights_only=True)
    try:
        model_args = ModelArgs.from_dict(ckpt["model_args"], strict=True)
    except ValueError as e:
        fail(f"{sharded_from}: {e}")
    if model_args.lora_rank:
        fail(f"{sharded_from} holds LoRA adapters, which are merged from a single file only; convert it with "
             f"{TO_SINGLE_FILE.format(sharded_from)} and give init_from={sharded_from + '.pt'!r}")
    if range_learning and init_from != "resume":
        fail(f"range_learning=True starts from a single-file checkpoint; convert {sharded_from} with "
             f"{TO_SINGLE_FILE.format(sharded_from)} and give init_from={sharded_from + '.pt'!r}")
else:
    try:  # only rank 0 broadcasts the weights (memory-mapped); the others need the shapes alone
        model_args, init_state = load_checkpoint(resume_path, weights=master_process)
    except ValueError as e:  # e.g. a file that is no checkpoint: one clear line, no traceback
        fail(str(e))
    ckpt_file = resume_path if os.path.isfile(resume_path) else os.path.join(resume_path, "ckpt.pt")
    if os.path.isfile(ckpt_file):  # a nanotune checkpoint: resume also takes its optimizer and position
        ckpt = torch.load(ckpt_file, map_location="cpu", mmap=True, weights_only=True)
        if any(type(v) is not torch.Tensor for v in ckpt.get("model", {}).values()):  # torchao's quantized tensors
            fail(f"{ckpt_file} holds a converted (integer) model, which does not train; give the checkpoint it was "
                 f"converted from (its ckpt.pt)")
if init_from != "scratch":
    try:
        theirs = tokenizer_of(resume_path, ckpt, data_tokenizer.get("kind")) if data_tokenizer else None
    except DataPrepError as e:  # a directory whose tokenizer files cannot be read
        fail(f"{resume_path}: {e}")
    if theirs and (diff := tokenizer_mismatch(theirs, data_tokenizer)):
        fail(f"{resume_path} was trained with another tokenizer than the data in {data_dir} ({diff}); "
             f"prepare the data with the model's own tokenizer")
    if data_tokenizer and not theirs and master_process:  # e.g. an HF directory without its tokenizer files
        print(f"warning: {resume_path} records no tokenizer, so nothing checks that the data in {data_dir} was "
              f"prepared with the model's own")
    if model_args.lora_rank:  # a LoRA model (from kd_train.py): QAT rounds what it computes, W + BA
        init_state = merge_lora(init_state, model_args) if master_process else None
        model_args.lora_rank = 0
        if master_process:
            print(f"note: {init_from} holds LoRA adapters; they are merged into the weights before QAT")
# the longest window the weights have trained on: a model from scratch has seen block_size's positions alone
# (sample.py says so past them); a source of another kind, its own max_seq_len
trained_context = block_size if init_from == "scratch" else max(block_size, ckpt.get("trained_context", model_args.max_seq_len))
if data_meta["vocab_size"] > model_args.vocab_size:
    fail(f"the data in {data_dir} uses {data_meta['vocab_size']} token ids but the model has only {model_args.vocab_size}; prepare the data with the model's tokenizer")
if model_args.vocab_size - data_meta["vocab_size"] >= 1024:  # rows past the tokenizer's are padding, never this many
    fail(f"the model has {model_args.vocab_size} vocabulary rows but the data's tokenizer only {data_meta['vocab_size']}: "
         f"more than padding, so the model uses another tokenizer; prepare the data with the model's tokenizer")
if block_size > model_args.max_seq_len:
    fail(f"block_size={block_size} exceeds the model's max_seq_len={model_args.max_seq_len}")
try:
    quant_skip = config["quant_skip"] = check_quantizable(model_args, group_size, quant_skip, quantize_embedding) if quant_bits else ()
except ValueError as e:
    fail(str(e))
if export_format == "hf" and (why := hf_unexportable(model_args)):
    fail(why)
quant_settings = ("quantizer", "group_size", "quantize_embedding", "quant_skip", "range_learning")
if init_from == "resume":  # these decide which batches a step sees, or what the weights were trained for
    try:
        same = ("seed", "batch_size", "gradient_accumulation_steps", "block_size", "fake_quant_after_n_steps", "preset", "n_layer",
                "n_head", "n_kv_head", "n_embd") + quant_settings
        # a conversion trains nothing: the loop's settings neither need to match nor may be given
        changes = check_resume(ckpt, config, tuple(k for k in same if not (convert_only and k in TRAINING_ONLY)), data_meta,
                               resume_path, "qat_train.py", asked=None if convert_only else overridden)
    except ValueError as e:
        fail(str(e))
    if changes and master_process:
        print(f"note: the training settings change from the checkpoint's step: {changes}")
    if not convert_only and (was := ckpt["config"].get("ema_decay", 0.0)) != ema_decay:  # the average it holds is that one's
        fail(f"{resume_path} was trained with ema_decay={was}; resume with the same or start a new out_dir")
    if ckpt.get("weights_averaged") and max_iters > ckpt["iter_num"] and master_process:
        print(f"note: {resume_path} ended its run by replacing the weights with their average (ema_decay); "
              f"training continues from that average, not from its last step's weights")
    if convert_only and (was := ckpt["config"].get("ema_decay")) and not ckpt.get("weights_averaged") and master_process:
        print(f"note: {resume_path} is a step of a run not yet ended (ema_decay={was}): its last step's weights are "
              f"converted, not the running average it holds; --convert_only=False --max_iters={ckpt['iter_num']} ends the "
              f"run there with the average")
    if gptq_tokens and ckpt["config"].get("gptq_tokens") != gptq_tokens:  # GPTQ is a finetune's start, not a resume's
        fail(f"{resume_path} did not start from GPTQ over {gptq_tokens} tokens (gptq_tokens="
             f"{ckpt['config'].get('gptq_tokens', 0)}), and a resume continues its weights as they are; drop gptq_tokens")
# whether the loaded weights were trained with this very fake quantization (so converting them is QAT)
same_quant = "config" in ckpt and all(ckpt["config"].get(k) == globals()[k] for k in quant_settings)
ckpt_fake_quant = bool(ckpt.get("fake_quant")) and same_quant
# the source model's stop ids beyond the data's EOS (an Instruct model lists several): carried in
# the checkpoints, written to the export's generation config
source_stops = source_stop_ids(resume_path, ckpt) if init_from != "scratch" else []
generation = source_generation(resume_path, ckpt) if init_from != "scratch" else {}  # its sampling defaults, the same way
# scales learned by range_learning: training state, which load_checkpoint leaves out of the weights.
# A run stopped before its fake quant began never trained them (they are its first weights' scales):
# a finetune from it starts from the scales of the weights it has, as plain QAT does
ckpt_scales = ({k: v for k, v in ckpt.get("model", {}).items() if k.endswith("learned_scale")}
               if init_from == "resume" or ckpt_fake_quant else {})
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size

# every process must run one job. Each node reads its own copy of the code, the config, the data and
# the checkpoints: one that differs (a config edited on one node, data prepared again there) would
# train on beside the others without a word. Paths may differ between nodes, and what rank 0 alone
# uses (names in logs, the MFU's peak); what the paths hold may not. A sharded checkpoint by its state.pt
job = {**{k: v for k, v in config.items() if k not in ("out_dir", "data_dir", "init_from", "wandb_project", "wandb_run_name",
                                                        "peak_flops_per_device")},
       "init_from": init_from if init_from in ("scratch", "resume") else "a checkpoint", "code": code_digest(__file__),
       "data": data_meta.get("data") or {}, "tokenizer": data_tokenizer or {},
       "checkpoints": {"init_from": checkpoint_digest(os.path.join(sharded_from, "state.pt") if sharded_from else resume_path)}
       if inputs else {}}
jobs = [None] * world_size
dist.all_gather_object(jobs, job)
compared = True
if disagreement := ranks_disagree(jobs):
    fail(disagreement, every_node=any("failed" in j for j in jobs))  # a process that failed told its own node alone
# HSDP when replicate_degree > 1: each group of world_size / replicate_degree processes (a node)
# holds one sharded copy, and gradients are all-reduced across the copies: inter-node traffic is
# one gradient reduction per step instead of every parameter gather
mesh = init_device_mesh(device_type, (replicate_degree, world_size // replicate_degree) if replicate_degree > 1 else (world_size,),
                        mesh_dim_names=("replicate", "shard") if replicate_degree > 1 else None)
torch.manual_seed(seed + rank)
torch.backends.cuda.matmul.allow_tf32 = True  # float32 matmuls on tensor cores (the GPU peak table assumes it)
torch.backends.cudnn.allow_tf32 = True
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
param_dtype = torch.float32 if mixed_precision else ptdtype
# one run at a time in out_dir (checkpoint.lock_dir)
lock_error = [None]
if master_process:
    os.makedirs(out_dir, exist_ok=True)
    out_dir_lock, lock_error[0] = lock_dir(out_dir)
dist.broadcast_object_list(lock_error, src=0)  # every rank stops, not rank 0 alone
if lock_error[0]:
    fail(lock_error[0])
# sharded checkpoints are written by every process into out_dir: a path local to each node would
# split each one between the nodes, unreadable, without a word. Rank 0 leaves a file there that every process must see
if world_size > 1 and sharded_checkpoint and not convert_only:
    try:
        blind = ranks_not_sharing(out_dir)
    except ValueError as e:
        fail(str(e))
    if blind:
        fail(f"sharded_checkpoint=True has every process write its shards into {out_dir}, which rank(s) "
             f"{', '.join(map(str, blind))} cannot see as rank 0 does (a directory local to each node?); give an "
             f"out_dir that every node shares")
if master_process:
    # the data's tokenizer beside each checkpoint, to sample and export it with, and no other: an
    # earlier run's would be read with it, or instead of it
    names = load_tokenizer(data_dir).save(out_dir) if data_tokenizer and data_tokenizer.get("files") else []
    remove_tokenizer_files(out_dir, keep=names)
    print(f"{world_size} process(es) on {device_type}, {tokens_per_iter:,} tokens per step")

# -----------------------------------------------------------------------------
# data: non-overlapping windows of block_size + 1 tokens; each epoch visits every window once
# in an order fixed by (seed, epoch), so the batches of step n never depend on how we got there
data_dtype = np.dtype(data_meta["dtype"])
has_mask, has_pos = bool(data_meta.get("has_mask")), bool(data_meta.get("has_pos"))


data_files = {}  # (inode, size) of each bin as first opened, against data_prep.py writing into data_dir under this run


def memmap(split, kind=""):
    # a fresh memmap per batch: a long-lived one grows the process's memory (nanoGPT's lesson)
    dtype = {"": data_dtype, "mask": np.uint8, "pos": np.dtype(data_meta.get("pos_dtype") or "uint16")}[kind]
    path = os.path.join(data_dir, f"{split}_{kind}.bin" if kind else f"{split}.bin")
    try:
        with open(path, "rb") as f:
            m, stat = np.memmap(f, dtype=dtype, mode="r"), os.fstat(f.fileno())
            now = stat.st_ino, stat.st_size
    except FileNotFoundError:
        now = None
    if now is None or data_files.setdefault(path, now) != now:  # replaced, rewritten or removed
        # on whichever rank sees it (data may be local to each node), so not through fail()
        print(f"error{f' (rank {rank})' if world_size > 1 else ''}: {path} changed during the run (data prepared again "
              f"into {data_dir}?); stopped rather than train on other data", file=sys.stderr, flush=True)
        sys.exit(2)
    return m


n_targets = {s: len(memmap(s)) - 1 for s in ("train", "val")}  # every token but the first is a target
n_windows = {s: n // block_size for s, n in n_targets.items()}  # whole windows, for training and estimates
gptq_windows = math.ceil(gptq_tokens / block_size)  # in all, whatever the number of processes
if gptq_windows > n_windows["train"]:
    fail(f"gptq_tokens={gptq_tokens} asks for {gptq_windows} windows of {block_size} tokens, more than the "
         f"train split's {n_windows['train']}")
global_batch = batch_size * gradient_accumulation_steps  # windows per optimizer step
steps_per_epoch = n_windows["train"] // global_batch
if steps_per_epoch == 0 and not convert_only:
    fail(f"the train split has {n_windows['train']} windows of {block_size + 1} tokens, fewer than one step's {global_batch}; lower batch_size or block_size")
if n_windows["val"] == 0:
    fail(f"the val split of {data_dir} is shorter than block_size + 1 = {block_size + 1} tokens; use a larger val_fraction in data_prep.py")


def generator(*keys):
    # seeded by (seed, *keys) through numpy's SeedSequence, which mixes its inputs so that
    # neighbouring keys (step 7 and 8, rank 0 and 1) still give unrelated streams
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, *keys]).generate_state(1)[0]))


@lru_cache(maxsize=1)  # one epoch at a time: a permutation of every train window
def epoch_order(epoch):
    return torch.randperm(n_windows["train"], generator=generator(epoch))


def get_batch(split, windows):
    """Inputs, targets and (packed data) positions within each sample, (B, T) each, for window
    indices; windows < 0 are padding, and targets past the end of the split (the last, partial
    window) are ignored. Positions restart at 0 where a sample starts, which is what keeps packed
    samples from attending to each other."""
    data = memmap(split)
    mask = memmap(split, "mask") if has_mask else None
    pos_data = memmap(split, "pos") if has_pos else None
    x = torch.zeros(len(windows), block_size, dtype=torch.long)
    y = torch.full((len(windows), block_size), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros(len(windows), block_size, dtype=torch.long) if has_pos else None
    for i, w in enumerate(windows.tolist()):
        if w < 0:
            continue
        chunk = torch.from_numpy(data[w * block_size: w * block_size + block_size + 1].astype(np.int64))
        n = len(chunk) - 1
        x[i, :n], y[i, :n] = chunk[:-1], chunk[1:]
        if mask is not None:  # prompt tokens are context only: no loss on them
            m = torch.from_numpy(mask[w * block_size + 1: w * block_size + n + 1].astype(bool))
            y[i, :n][~m] = IGNORE_INDEX
        if pos is not None:
            pos[i, :n] = torch.from_numpy(pos_data[w * block_size: w * block_size + n].astype(np.int64))
    if device_type == "cuda":
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        pos = None if pos is None else pos.pin_memory().to(device, non_blocking=True)
    return x, y, pos


def train_batches(it):
    """This process's micro-batches for step `it`: the step's slice of the epoch order, cut in
    gradient_accumulation_steps micro-batches, every world_size-th one ours."""
    epoch, step = divmod(it, steps_per_epoch)
    windows = epoch_order(epoch)[step * global_batch: (step + 1) * global_batch]
    return [get_batch("train", w) for w in windows.view(gradient_accumulation_steps, batch_size)[rank::world_size]]


# -----------------------------------------------------------------------------
# model: built on the meta device (no memory), fake-quantized, sharded, then materialized
with torch.device("meta"):
    model = Transformer(model_args)
model.to(param_dtype)


def quantize_filter(module, path):
    if any(path == s or path.startswith(s + ".") for s in quant_skip):
        return False
    if isinstance(module, nn.Embedding):
        return quantize_embedding
    return isinstance(module, nn.Linear)


def base_config(for_embedding=False):
    """The torchao config of the real quantized model; QAT derives its fake quantizers from it."""
    act_bits, w_bits = quant_bits
    w_dtype = getattr(torch, f"int{w_bits}")
    if quantizer == "4w-gpu" and not for_embedding:  # packed int4 with bf16 scales, for CUDA's int4 matmul
        from torchao.quantization import Int4WeightOnlyConfig
        return Int4WeightOnlyConfig(group_size=group_size)
    if for_embedding or act_bits is None:
        return IntxWeightOnlyConfig(weight_dtype=w_dtype, granularity=PerGroup(group_size))
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=w_dtype, weight_granularity=PerGroup(group_size))


def quantize_model(m, step, within=""):
    """step 'prepare' (fake quant), 'convert' (after prepare) or 'ptq' (plain weights -> int), on
    the whole model or only on the module at path `within` and inside it."""
    for is_emb in (False, True):
        cfg = base_config(for_embedding=is_emb)
        fn = lambda mod, path: (quantize_filter(mod, path) and isinstance(mod, nn.Embedding) == is_emb
                                and (path == within or path.startswith(within + ".") or not within))
        quantize_(m, cfg if step == "ptq" else QATConfig(cfg, step=step), filter_fn=fn)


def convert_on_device(m, after_training):
    """Converts m (weights on the host) piece by piece onto the device, so that the device never
    holds more than the converted pieces and one piece in the compute dtype: after QAT (m then
    prepared), QATConfig's convert; else the same scheme on plain weights (PTQ)."""
    m.reset_buffers(device)
    for path, piece in [(f"layers.{i}", layer) for i, layer in enumerate(m.layers)] + [
            ("tok_embeddings", m.tok_embeddings), ("norm", m.norm), ("output", m.output)]:
        piece.to(device)
        quantize_model(m, "convert" if after_training else "ptq", within=path)
    return m.eval()


def set_fake_quant(m, enabled):
    for mod in m.modules():
        for fq in (getattr(mod, "activation_fake_quantizer", None), getattr(mod, "weight_fake_quantizer", None)):
            if fq is not None:
                fq.enabled = enabled


if quant_bits is not None:
    quantize_model(model, "prepare")
    if range_learning:
        learn_scales(model)
    fuse_fake_quant(model)
    if model_args.tie_embeddings:  # prepare gives the output layer a weight of its own: tie it back
        model.output.weight = model.tok_embeddings.weight
if activation_checkpointing:
    for i, block in enumerate(model.layers):
        if i % activation_checkpointing == 0:
            activation_checkpoint(block)
if compile:
    # a graph per shape: the loss's last chunk of a step, and the evaluation's, are shorter than the
    # others; dynamo's default limit of 8 would send the rest to eager
    torch._dynamo.config.recompile_limit = 64
    for block in model.layers:
        block.compile()
    # the output layer, the fp32 upcast and the CE in one graph. Static shapes: the chunks are
    # recomputed in backward, and a chunk of another length mid-step would have dynamo compile a
    # dynamic graph that the earlier chunks' recomputation then runs, saving its tensors in another
    # order than their forward did (torch 2.11, CUDA: a CheckpointError)
    model.ce_chunk = torch.compile(model.ce_chunk, dynamic=False)

# FSDP2: one unit per block, the embedding its own; the root keeps the final norm and output,
# which stay gathered through forward and backward, so the chunked loss can reuse them
mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else MixedPrecisionPolicy()
fsdp_kw = dict(mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
               offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
for block in model.layers:
    fully_shard(block, **fsdp_kw)
if not model_args.tie_embeddings:  # tied, the embedding is the output's weight: both stay in the root
    fully_shard(model.tok_embeddings, **fsdp_kw)
fully_shard(model, **{**fsdp_kw, "reshard_after_forward": False})  # backward needs the root first
model.to_empty(device="cpu" if cpu_offload else device)
model.reset_buffers(device)

# weights: rank 0 holds the full state dict (a fresh init, or the mmapped checkpoint) and
# broadcasts it; each rank keeps only its shards
if master_process and init_state is None and not sharded_from:
    init_model = Transformer(model_args)
    init_model.init_weights(seed=seed)
    init_state = init_model.state_dict()
if master_process and range_learning and not sharded_from:  # the checkpoint's learned scales, else fresh ones
    init_state = {**init_state, **initial_scales(model, init_state), **ckpt_scales}
if not sharded_from:  # a sharded checkpoint is read after the optimizer exists, with its state
    set_model_state_dict(model, init_state if master_process else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
del init_state

# -----------------------------------------------------------------------------
def init_optimizer_state(opt):
    """Makes now, for every parameter, the state AdamW makes at its first step. A parameter without
    a gradient yet (a learned scale before fake quant starts) would have none when a checkpoint is
    written: torch's state-dict helpers then step it once at lr 0 to make one, which runs its step
    count one ahead for the rest of training, and a resume from that checkpoint finds no state for it."""
    for group in opt.param_groups:
        for p in group["params"]:
            on_device = group["fused"] or group["capturable"]  # else AdamW keeps the count on the CPU
            opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            if ema_decay:  # the weight's running average: beside AdamW's state, so checkpoints keep it (set below)
                opt.state[p]["ema"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# optimizer: AdamW, weight decay on weight matrices only (not on learned scales: it would shrink
# the grid). With optimizer_in_bwd, one AdamW per parameter, stepped by a hook as soon as its
# gradient is reduced, so gradients never pile up
params = [p for p in model.parameters() if p.requires_grad]
scales = {p for n, p in model.named_parameters() if n.endswith("learned_scale")}
groups = [{"params": [p for p in params if p.ndim >= 2 and p not in scales], "weight_decay": weight_decay},
          {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr_ratio": norm_lr_ratio},
          {"params": [p for p in params if p in scales], "weight_decay": 0.0, "lr_ratio": range_lr_ratio}]
opt_kw = dict(lr=learning_rate, betas=(beta1, beta2), fused=True)  # one kernel per step, on GPUs and CPUs alike
grad_finite = torch.ones((), dtype=torch.bool, device=device)  # optimizer_in_bwd: this step's gradients so far
if optimizer_in_bwd:
    optimizers = [torch.optim.AdamW([{**g, "params": [p]}], **opt_kw) for g in groups for p in g["params"]]

    def step_in_backward(p, opt):
        grad_finite.logical_and_(p.grad.to_local().isfinite().all())  # the step spends the gradient: look first
        opt.step()
        opt.zero_grad(set_to_none=True)

    for opt in optimizers:
        opt.param_groups[0]["params"][0].register_post_accumulate_grad_hook(lambda p, opt=opt: step_in_backward(p, opt))
else:
    optimizers = [torch.optim.AdamW([g for g in groups if g["params"]], **opt_kw)]
for opt in optimizers if not convert_only else ():  # a conversion trains nothing: no state to hold
    init_optimizer_state(opt)

iter_num = 0
if sharded_from:  # every rank reads its own shards; the optimizer's state only to resume training
    load_sharded_checkpoint(model, optimizers, sharded_from, with_optimizer=init_from == "resume" and not convert_only)
if init_from == "resume":
    iter_num = ckpt["iter_num"]
    if not sharded_from and not convert_only:
        set_optimizer_state_dict(model, optimizers, ckpt["optimizer"] if master_process else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if rank < len(ckpt["rng"]):  # a resume on more processes than before keeps fresh states on the new ones
        torch.set_rng_state(ckpt["rng"][rank]["cpu"])
        if device_type == "cuda" and ckpt["rng"][rank]["cuda"] is not None:
            torch.cuda.set_rng_state(ckpt["rng"][rank]["cuda"])
    # the loaded state brings its run's settings too: this run's, as printed above, apply from here
    group_of = {p: g for g in groups for p in g["params"]}
    for opt in optimizers:
        for group in opt.param_groups:
            group.update({k: v for k, v in group_of[group["params"][0]].items() if k != "params"}, betas=(beta1, beta2))
    if master_process:
        print(f"resumed from {resume_path} at step {iter_num}")
ckpt_averaged = bool(ckpt.get("weights_averaged"))  # its run ended by putting the average in place
ckpt = None  # free the optimizer state held by rank 0


def get_lr(it):
    # linear warmup, cosine decay to min_lr; a function of the step, so resume needs no state
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    progress = min(1.0, (it - warmup_iters) / max(1, (lr_decay_iters or max_iters) - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)


def fake_quant_on(it):
    return quant_bits is not None and it >= fake_quant_after_n_steps


def weight_averages():
    """(averages, weights): this process's shards of the running averages (ema_decay) and of the
    trained weights, in the same order, to update in place; taken afresh at each use, since FSDP2 may
    re-pad a parameter's shard into new memory (at its first forward), leaving older views behind"""
    pairs = [(opt.state[p]["ema"], p) for opt in optimizers for group in opt.param_groups for p in group["params"]]
    return [a.to_local() for a, _ in pairs], [p.detach().to_local() for _, p in pairs]


# -----------------------------------------------------------------------------
# helpers: evaluation, checkpointing, logging


@torch.no_grad()
def evaluate(m, full=False, it=0, alone=False):
    """Mean validation loss: eval_iters random batches, or (full=True) every token of the split
    exactly once, the last partial window included. Every rank runs the same number of forwards
    (padding with ignored windows), since an FSDP forward is a collective."""
    was_training = m.training
    m.eval()
    if full:  # alone: this process scores the whole split by itself (the converted model)
        ranks, r = (1, 0) if alone else (world_size, rank)
        n = math.ceil(n_targets["val"] / block_size)
        n_rounds = math.ceil(n / (batch_size * ranks))
        order = torch.arange(n_rounds * batch_size * ranks)
        order[order >= n] = -1
        batches = order.view(n_rounds, ranks, batch_size)[:, r]
    else:
        batches = torch.randint(n_windows["val"], (eval_iters, batch_size), generator=generator(it, rank, 1))
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # (summed loss, target count)
    for windows in tqdm(batches, desc="eval", leave=False, disable=not (full and master_process)):
        x, y, pos = get_batch("val", windows)
        sums[0] += m(x, y, reduction="sum", loss_chunk=loss_chunk, input_pos=pos).double()
        sums[1] += (y != IGNORE_INDEX).sum()
    m.train(was_training)
    if not alone:
        dist.all_reduce(sums)
    total, count = sums.tolist()
    return total / max(count, 1)


def full_state_dict(m):
    # a collective: every rank calls it; only rank 0 ends up with the tensors, on the CPU
    return get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# Conversion runs on rank 0 alone: torchao's quantized tensors are not shardable by FSDP, and a
# copy converted on every rank is that many times the work and the memory. Rank 0 gathers the
# weights to its host in the compute dtype and moves them to its device a block at a time,
# converting each on arrival; the others wait on a CPU (gloo) group whose timeout outlasts the
# evaluation. The memory this takes at 8B is in the README ("Memory").
wait_group = dist.new_group(backend="gloo", timeout=timedelta(hours=6))


def gathered_state():
    """The full state dict in the compute dtype on rank 0's host (None elsewhere): a collective."""
    state = full_state_dict(model)
    if not master_process:
        return None
    for k in state:  # one tensor at a time, so the fp32 gather and its bf16 copy never coexist whole
        state[k] = state[k].to(ptdtype)
    return state


def convert_and_evaluate(state, after_qat):
    """On rank 0, which holds `state`: builds a plain model from it, converts it to real low-bit
    weights and evaluates it on every window of the validation split. Returns (that loss, on every
    rank; the model, on rank 0 only)."""
    qm, result = None, [None]
    if master_process:
        with torch.device("meta"):
            qm = Transformer(model_args)
            if after_qat:  # the fake quantizers the conversion reads; learned scales are loaded into them
                quantize_model(qm, "prepare")
                if range_learning:
                    learn_scales(qm)
        if not (after_qat and range_learning):
            state = weights_only(state)
        qm.load_state_dict(state, assign=True)
        convert_on_device(qm.requires_grad_(False), after_qat)
        result = [evaluate(qm, full=True, alone=True)]
    dist.broadcast_object_list(result, src=0, group=wait_group)
    return result[0], qm


def save_checkpoint():
    """ckpt.pt, or (sharded_checkpoint) the directory ckpt/ of every rank's shards: checkpoint.py."""
    rngs = [None] * world_size
    dist.all_gather_object(rngs, {"cpu": torch.get_rng_state(),
                                  "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None})
    small = {"script": "qat_train.py", "model_args": vars(model_args).copy(), "iter_num": iter_num,
             "trained_context": trained_context, "epoch": iter_num // max(steps_per_epoch, 1), "config": config,
             "quantizer": quantizer, "group_size": group_size,
             # how these weights were trained (the last step taken), as ckpt_fake_quant reads it
             "fake_quant": iter_num > 0 and fake_quant_on(iter_num - 1),
             "weights_averaged": bool(ema_decay) and iter_num == max_iters,  # the loop's end replaced them
             "tokenizer": data_tokenizer, "data": data_meta.get("data"), "stop_ids": source_stops, "generation": generation,
             "rng": rngs}
    save_training_checkpoint(model, optimizers, small, out_dir, sharded_checkpoint)


def _json_or_none(line):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


log_file = None
baseline = {}  # what the loaded weights score before any step: evaluated below, or a resume's, from its log
if master_process:
    # checkpoint.py: an earlier run's exports, not this one's, and a killed run's temp files if out_dir is locked
    remove_earlier_outputs(out_dir, inputs, locked=out_dir_lock is not None)
    if init_from != "resume":  # an earlier run's checkpoint: set aside, never taken for this run's (nor beside
        set_aside_checkpoint(out_dir, inputs)  # a conversion's quantized.pt as the weights it came from)
    log_path = os.path.join(out_dir, "log.jsonl")
    if init_from != "resume" and os.path.exists(log_path):  # an earlier run's lines: set aside, never mixed with these
        os.replace(log_path, log_path + ".prev")
        print(f"{log_path} held an earlier run's log: moved to log.jsonl.prev")
    if init_from == "resume" and os.path.exists(log_path):
        # the lines of steps after the checkpoint, an event at its step (not the end's average, done
        # before it was written) and the summary are about to come again; the rest is rewritten to a
        # temp file and renamed, so a kill keeps one whole log (a line a kill tore in half is dropped)
        with open(log_path) as f:
            records = [r for r in map(_json_or_none, f) if r is not None]
        for r in records:  # the start's baseline, which a resume does not evaluate again, for its summary too
            baseline.update({k: v for k, v in r.items() if k in ("init_fp_val_loss", "init_ptq_val_loss", "init_gptq_val_loss")})
        kept = [json.dumps(r) + "\n" for r in records
                if (r["iter"] < iter_num or r["iter"] == iter_num and r.get("event") in (None, "weights_averaged"))
                and "fp_val_loss" not in r]
        with open(log_path + ".tmp", "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(log_path + ".tmp", log_path)
    log_file = open(log_path, "a")
wandb = None
if wandb_log and master_process:
    import wandb
    wandb.init(project=wandb_project, name=wandb_run_name, config=config)


def log(record):
    if master_process:
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()
        if wandb is not None:
            wandb.log(record, step=record["iter"])


def peak_memory_gib():
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


# -----------------------------------------------------------------------------
# training loop
flops_token = flops_per_token(model_args, block_size)
peak, peak_source = (peak_flops_per_device, "given") if peak_flops_per_device else peak_flops(device_type, ptdtype)
peak_retimed = False
if master_process and not convert_only:
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {flops_token / 1e6:.1f} MFLOPs per token, "
          f"peak {peak / 1e12:.3g} TFLOP/s per device ({peak_source})")
profiler = nullcontext()
if profile and not convert_only:
    profiler = torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=profile_wait, warmup=profile_warmup, active=profile_active, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(os.path.join(out_dir, f"trace_rank{rank}.json")),
        profile_memory=True, record_shapes=True)
offload_ctx = torch.autograd.graph.save_on_cpu(pin_memory=True) if activation_offloading else nullcontext()
if ptq_baseline and quant_bits is not None and init_from not in ("scratch", "resume") and not convert_only:
    # the number QAT has to beat: the starting weights, rounded without any training, in the
    # dtype the final conversion uses
    set_fake_quant(model, False)
    baseline = {"init_fp_val_loss": evaluate(model, full=True)}
    baseline["init_ptq_val_loss"] = convert_and_evaluate(gathered_state(), after_qat=False)[0]
    log({"iter": iter_num, **baseline})
    if master_process:
        print(f"start: val loss {baseline['init_fp_val_loss']:.4f} full precision, {baseline['init_ptq_val_loss']:.4f} after PTQ {quantizer}")


@torch.no_grad()
def gptq_start():
    """Replaces each fake-quantized linear layer's weights and learned scales by GPTQ's (model.gptq_),
    a block at a time in order, then the output layer: each layer's input Hessian is gathered over
    the calibration windows (each rank runs its share; the sums are reduced) with the blocks before
    it already rounded as GPTQ rounded them, and each rank rounds the rows of the weights it holds.
    Every stage runs the whole model forward (FSDP's hooks stay as in training): L + 1 forwards of
    gptq_tokens tokens, a few minutes' work next to a finetune's."""
    # the same windows on any number of processes, each rank an equal share (FSDP's forwards are
    # collectives) of them padded to a multiple of world_size; the pad's rows count for nothing
    per_rank = math.ceil(gptq_windows / world_size)
    order = epoch_order(0)[:gptq_windows]
    windows = order[torch.arange(per_rank * world_size) % gptq_windows].view(world_size, per_rank)[rank]
    counted = min(max(gptq_windows - rank * per_rank, 0), per_rank)  # this rank's first ones
    batches = [(get_batch("train", w), min(max(counted - i, 0), len(w)) * block_size)
               for i, w in zip(range(0, per_rank, batch_size), windows.split(batch_size))]
    layers = [mod for mod in model.modules() if isinstance(getattr(mod, "weight_fake_quantizer", None), LearnedScaleFakeQuantizer)]
    names = {mod: name for name, mod in model.named_modules()}
    stages = [[m for m in layers if any(m is x for x in block.modules())] for block in model.layers]
    if model.output in layers and not model_args.tie_embeddings:  # tied, its weight is the embedding: rounded to nearest
        stages.append([model.output])
    set_fake_quant(model, False)  # full-precision activations, and weights until their own stage is done
    bar = tqdm(total=len(stages) * len(batches), desc="gptq", dynamic_ncols=True, leave=False, disable=not master_process)
    for stage in stages:
        hessians = {m: torch.zeros(m.weight.shape[1], m.weight.shape[1], device=device) for m in stage}
        rows = torch.zeros(len(stage), dtype=torch.int64, device=device)  # each layer's inputs gathered
        keep = 0  # rows of the batch that count (the pad's do not)

        def gather(i, m, x):
            x = x.detach().flatten(0, -2)[:keep].float()
            hessians[m].addmm_(x.T, x)
            rows[i] += x.shape[0]
        # the output layer's input is the final norm's output: a chunked loss multiplies it by the
        # output weight itself (model.linear_with), without calling the layer
        hooks = [model.norm.register_forward_hook(lambda mod, args, out, i=i, m=m: gather(i, m, out)) if m is model.output
                 else m.register_forward_hook(lambda mod, args, out, i=i, m=m: gather(i, m, args[0]))
                 for i, m in enumerate(stage)]
        with torch.compiler.set_stance("force_eager"):  # a compiled block would not call the hooks as written
            for (x, y, pos), keep in batches:
                model(x, y, reduction="sum", loss_chunk=loss_chunk, input_pos=pos)
                bar.update(1)
        for h in hooks:
            h.remove()
        reshard(model)  # the calibration's forwards left the root gathered: rounded there, it would be lost
        dist.all_reduce(rows)
        if missed := [names[m] for m, n in zip(stage, rows.tolist()) if n != gptq_windows * block_size]:
            raise RuntimeError(f"GPTQ: {', '.join(missed)} saw other than the {gptq_windows * block_size} calibration rows")
        for m in stage:
            dist.all_reduce(hessians[m])
            w, s = local_rows(m)
            if w.numel():  # a rank may hold no rows of a small layer
                s.copy_(gptq_(w, hessians[m], m.weight_fake_quantizer))
            m.weight_fake_quantizer.enabled = True  # the next stages see this layer rounded
    bar.close()


if gptq_tokens and init_from != "resume":
    t_gptq = time.perf_counter()
    gptq_start()
    if master_process:
        print(f"GPTQ: {gptq_windows * block_size:,} calibration tokens (whole windows), {time.perf_counter() - t_gptq:.0f} s")
    if baseline:  # the PTQ a finetune from here has to beat
        baseline["init_gptq_val_loss"] = convert_and_evaluate(gathered_state(), after_qat=True)[0]
        log({"iter": iter_num, "init_gptq_val_loss": baseline["init_gptq_val_loss"]})
        if master_process:
            print(f"start: val loss {baseline['init_gptq_val_loss']:.4f} after GPTQ {quantizer}")
if ema_decay and init_from != "resume" and not convert_only:  # the average starts at the weights training starts from
    torch._foreach_copy_(*weight_averages())  # (GPTQ's, with gptq_tokens)
set_fake_quant(model, fake_quant_on(iter_num))
if master_process and quant_bits is not None and not convert_only:
    print(f"fake quant ({quantizer}, group {group_size}) {'on' if fake_quant_on(iter_num) else 'off until step ' + str(fake_quant_after_n_steps)}")


def frozen_by_rounding(p, step):
    """(elements of bfloat16 p that a step this size leaves as they are, elements): rounding to the
    nearest bfloat16 undoes a change below half the spacing there, 2^(floor(log2 |p|) - 8) (frexp's
    exponent is floor(log2 |p|) + 1)."""
    x = p.detach().to_local().float().abs()
    frozen = (x > 0) & (torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 9) > step)
    return torch.stack([frozen.sum().double(), torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)])


if param_dtype == torch.bfloat16 and iter_num < max_iters and not convert_only:
    # AdamW's step is at most about the learning rate: a weight whose bfloat16 spacing is twice that never moves
    counts = torch.stack([sum((frozen_by_rounding(p, learning_rate * g.get("lr_ratio", 1.0)) for p in g["params"]),
                              torch.zeros(2, dtype=torch.float64, device=device)) for g in groups])
    dist.all_reduce(counts)
    names = ("weight matrices", "norms", "learned scales")
    shares = {name: f / n for name, (f, n) in zip(names, counts.tolist()) if n}
    if said := [f"{s:.0%} of the {name}" for name, s in shares.items() if s >= 0.01]:
        line = (f"dtype=bfloat16 without mixed_precision: a step of learning_rate={learning_rate:g} (times a group's lr "
                f"ratio; AdamW's steps are at most about that) is below half of bfloat16's spacing for {', '.join(said)}, "
                f"which rounding then leaves as they are; mixed_precision=True keeps fp32 master weights")
        if shares.get(names[0], 0) >= 0.5:
            fail(line)
        if master_process:
            print(f"warning: {line}")

pbar = tqdm(total=max_iters, initial=iter_num, desc="train", dynamic_ncols=True,
            disable=not master_process or convert_only or iter_num >= max_iters)
start_iter = iter_num
t0 = time.perf_counter()
last_log_iter = iter_num
# the first step whose loss or gradient norm was not finite (NO_BAD_STEP: none), kept on the device
# and read where the loop syncs anyway: at log lines, and before a checkpoint, which a NaN must not overwrite
NO_BAD_STEP = 2 ** 62
bad_step = torch.full((), NO_BAD_STEP, device=device)  # step * 4 + which part was not finite
saved_iter = iter_num if init_from == "resume" else None


def check_finite():
    """Stops every rank, in one line, once a step's loss or gradient was nan or inf: training on
    would only spread it through the weights, and into the checkpoint and the converted model."""
    dist.all_reduce(bad_step, op=dist.ReduceOp.MIN)
    if (first := int(bad_step.item())) != NO_BAD_STEP:
        (step, why), what = divmod(first, 4), {1: "the loss", 2: "the gradient"}
        kept = f"{out_dir} keeps the checkpoint of step {saved_iter}" if saved_iter is not None else "no checkpoint was written"
        hint = "lower learning_rate or grad_clip" + ("" if ptdtype == torch.float32 else
                                                    ", or train in float32 to see whether the precision is the cause")
        if master_process:
            pbar.close()
            print(f"error: step {step}: {what[why]} is not finite; stopped, and {kept}; {hint}", file=sys.stderr, flush=True)
        dist.barrier()  # rank 0's line out first: torchrun stops every rank at the first exit
        sys.exit(2)


def check_gradients(step_loss):
    """Stops every rank, in one line, when the run's first step left a trainable weight without a
    gradient, or with one zero everywhere in a finite step with a loss: AdamW would pass over the
    first and move the second by weight decay alone, without a word, and only part of the model
    would train (compiled by torch 2.11, an in-place fake quant zeroed them all).
    (Learned scales get none while fake quant is off.)"""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad
             and (fake_quant_on(iter_num) or not n.endswith("learned_scale"))]
    grads = [None if p.grad is None else p.grad.to_local() for _, p in named]
    # per weight, over the ranks: whether it has no gradient, and its gradient's nonzero elements;
    # then the weights whose gradient is not finite, and the loss
    counts = torch.tensor([float(g is None) for g in grads] + [0.0 if g is None else float(torch.count_nonzero(g)) for g in grads]
                          + [sum(float(not g.isfinite().all()) for g in grads if g is not None), float(step_loss)],
                          dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    *counts, not_finite, loss = counts.tolist()
    none = [n for (n, _), c in zip(named, counts) if c > 0]
    zero = [n for (n, _), c in zip(named, counts[len(named):]) if c == 0 and n not in none]
    if none or (zero and not not_finite and 0 < loss < math.inf):  # a step not finite is check_finite's
        if master_process:
            pbar.close()
            names = none or zero
            what = "no gradient reached" if none else "the gradient was zero everywhere for"
            hint = "; rerun with compile=False to see whether torch.compile drops them" if compile else ""
            print(f"error: step {iter_num + 1}: {what} {', '.join(names[:3])}"
                  f"{' and others' if len(names) > 3 else ''}: the loss does not depend on them as trained{hint}",
                  file=sys.stderr, flush=True)
        dist.barrier()
        sys.exit(2)


if ema_decay and init_from == "resume" and not convert_only and iter_num >= max_iters and not ckpt_averaged:
    # no step left to take: the run ends here, with the average its last step would have put in place
    torch._foreach_copy_(*weight_averages()[::-1])
    if master_process:
        print(f"step {iter_num}: no step left to take (max_iters={max_iters}): weights replaced by their running average "
              f"(ema_decay={ema_decay})")
    log({"iter": iter_num, "event": "weights_averaged"})

with profiler as prof:
    while iter_num < max_iters and not convert_only:
        if quant_bits is not None and iter_num == fake_quant_after_n_steps and iter_num > 0:
            set_fake_quant(model, True)
            if range_learning:  # scales for the weights as they are now, not as they were at step 0
                restart_scales(model)
            if ema_decay:  # average only weights trained under fake quant, as they will be converted
                torch._foreach_copy_(*weight_averages())
            if master_process:
                pbar.write(f"step {iter_num}: fake quant enabled")
            log({"iter": iter_num, "event": "fake_quant_enabled"})
        lr = get_lr(iter_num)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = lr * group.get("lr_ratio", 1.0)

        batches = train_batches(iter_num)
        # normalize by the unmasked tokens of the whole step, over every micro-batch and rank, so
        # the gradient does not depend on how the global batch is split; FSDP averages over ranks,
        # hence the world_size factor
        n_tokens = sum((y != IGNORE_INDEX).sum() for _, y, _ in batches)
        dist.all_reduce(n_tokens)
        n_tokens.clamp_(min=1)  # a step whose every target is masked contributes nothing, not NaN
        loss_sum = torch.zeros((), device=device)
        grad_finite.fill_(True)
        for micro, (x, y, pos) in enumerate(batches):
            if accumulate_unsharded:  # reduce once per step; else each micro-batch's gradient is reduce-scattered
                model.set_requires_gradient_sync(micro == len(batches) - 1)
            with offload_ctx:
                loss = model(x, y, reduction="sum", loss_chunk=loss_chunk, input_pos=pos)
            (loss * world_size / n_tokens).backward()
            loss_sum += loss.detach()
        if iter_num == start_iter and not optimizer_in_bwd:  # (optimizer_in_bwd steps and frees each gradient in backward)
            check_gradients(loss_sum)
        if not optimizer_in_bwd:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
            optimizers[0].step()
            optimizers[0].zero_grad(set_to_none=True)
        iter_num += 1
        if ema_decay:
            with torch.no_grad():
                averages, weights = weight_averages()
                torch._foreach_lerp_(averages, weights, 1.0 - ema_decay)
                if iter_num == max_iters:  # the end: the average is the model from here on
                    torch._foreach_copy_(weights, averages)
                    if master_process:
                        pbar.write(f"step {iter_num}: weights replaced by their running average (ema_decay={ema_decay})")
                    log({"iter": iter_num, "event": "weights_averaged"})
        # this step's verdict, kept on the device (no sync): 0 finite, 1 the loss, 2 the gradient
        grad_ok = grad_finite if optimizer_in_bwd else grad_norm.to_local().isfinite()
        verdict = torch.where(loss_sum.isfinite(), torch.where(grad_ok, 0, 2), 1)
        bad_step = torch.where((bad_step == NO_BAD_STEP) & (verdict > 0), iter_num * 4 + verdict, bad_step)
        pbar.update(1)
        if profile:
            prof.step()

        if iter_num % log_interval == 0 or iter_num == max_iters:
            check_finite()
            dist.all_reduce(loss_sum)
            loss_val = loss_sum.item() / n_tokens.item()  # a log step's host sync, with check_finite's
            tps = tokens_per_iter * (iter_num - last_log_iter) / (time.perf_counter() - t0)
            mfu = flops_token * tps / world_size / peak
            if mfu > 1 and not peak_flops_per_device:  # the peak was timed in a busy moment: time it again, once
                if not peak_retimed:
                    peak, peak_retimed = max(peak, peak_flops(device_type, ptdtype)[0]), True
                peak = max(peak, flops_token * tps / world_size)  # a rate the run reached is one the machine has
                mfu = flops_token * tps / world_size / peak
            t0, last_log_iter = time.perf_counter(), iter_num  # after the peak's timing, which is no training
            record = {"iter": iter_num, "loss": loss_val, "lr": lr, "epoch": (iter_num - 1) // steps_per_epoch,
                      # FSDP's gradients are DTensors, and so is their norm
                      "grad_norm": None if optimizer_in_bwd else grad_norm.full_tensor().item(),
                      "tokens_per_sec": tps, "tokens_per_sec_per_device": tps / world_size,
                      "mfu": mfu, "peak_flops": peak, "peak_mem_gib": peak_memory_gib(), "fake_quant": fake_quant_on(iter_num - 1)}
            log(record)
            pbar.set_postfix(loss=f"{loss_val:.4f}", lr=f"{lr:.1e}", tok_s=f"{tps:,.0f}", mfu=f"{mfu:.0%}")
        evaluating = iter_num % eval_interval == 0 or iter_num == max_iters
        saving = iter_num % ckpt_interval == 0 or iter_num == max_iters
        if (evaluating or saving) and device_type == "cuda":
            torch.cuda.synchronize()  # the step's queued work is training time, not the pause's
        t_pause = time.perf_counter()  # evaluation and checkpoints are not training time
        if evaluating:
            val_loss = evaluate(model, it=iter_num)
            log({"iter": iter_num, "val_loss": val_loss, "fake_quant": fake_quant_on(iter_num - 1)})
            if master_process:
                pbar.write(f"step {iter_num}: val loss {val_loss:.4f}")
        if saving:
            check_finite()
            save_checkpoint()
            saved_iter = iter_num
        t0 += time.perf_counter() - t_pause
pbar.close()

# -----------------------------------------------------------------------------
# the end: full-precision and quantized validation loss on the whole split, quantized model saved
set_fake_quant(model, False)
fp_val_loss = evaluate(model, full=True)
summary = {"iter": iter_num, "fp_val_loss": fp_val_loss, "fp_ppl": math.exp(fp_val_loss), "quant_val_loss": None}
if export_format in ("hf", "meta"):  # the trained full-precision weights, for tools that quantize on their own
    fp_state = weights_only(full_state_dict(model))  # a collective; rank 0 ends up with the weights, on the CPU
    if master_process:
        export_dir = os.path.join(out_dir, f"export_{export_format}")
        tokenizer_files = [os.path.join(out_dir, f) for f in (data_tokenizer or {}).get("files", [])]
        provenance = {"tokenizer": data_tokenizer, "data": data_meta.get("data"), "iter_num": iter_num, "config": config,
                      "stop_ids": source_stops, "generation": generation}
        if export_format == "hf":
            export_hf(fp_state, model_args, export_dir, tokenizer_files, data_meta.get("bos_id"), stop_ids(data_meta, source_stops),
                      provenance, generation)
        else:
            export_meta(fp_state, model_args, export_dir, tokenizer_files, provenance)
        print(f"exported: {export_dir}")
    del fp_state
if quant_bits is not None:
    # QAT only if the weights were trained under this fake quantization: in this run's last
    # step, or (no step taken here) in the loaded checkpoint's
    qat_trained = fake_quant_on(iter_num - 1) if iter_num > start_iter else ckpt_fake_quant
    gptq_only = gptq_tokens > 0 and init_from != "resume" and iter_num == start_iter  # GPTQ's model itself
    # make room first: rank 0 gathers the whole model (in the compute dtype) and converts it
    del optimizers, params, scales, groups
    state = gathered_state()
    del model
    export_ptq = {}
    if range_learning and export_format in ("hf", "meta") and (qat_trained or gptq_only):
        # the export holds the unquantized weights, which a tool quantizing them rounds on max-based
        # scales, not on the learned ones: another model, scored so that it is never shipped unaware
        # (first, and freed at once: one converted model at a time)
        export_ptq["export_ptq_val_loss"] = convert_and_evaluate(state, after_qat=False)[0]
    quant_val_loss, qmodel = convert_and_evaluate(state, after_qat=qat_trained or gptq_only)
    del state
    summary.update(quant_val_loss=quant_val_loss, quant_ppl=math.exp(quant_val_loss),
                   method="gptq" if gptq_only else "qat" if qat_trained else "ptq", quantizer=quantizer, group_size=group_size, **baseline,
                   **export_ptq)
    if master_process:
        atomic_save({"model": qmodel.state_dict(), "model_args": vars(model_args).copy(), "quantizer": quantizer,
                     "group_size": group_size, "quantize_embedding": quantize_embedding, "quant_skip": quant_skip,
                     "range_learning": range_learning, "iter_num": iter_num, "config": config, "tokenizer": data_tokenizer,
                     "trained_context": trained_context, "stop_ids": source_stops},
                    os.path.join(out_dir, "quantized.pt"))
        if export_format == "pte":  # the converted model as an ExecuTorch program, for CPUs and phones
            pte = os.path.join(out_dir, "model.pte")
            print(f"exported: {pte_summary(pte, model_args, export_executorch(qmodel.to('cpu'), pte))}")
log(summary)
if master_process:
    rows = []
    if baseline:
        rows += [("start, full precision", baseline["init_fp_val_loss"]), (f"start, PTQ {quantizer}", baseline["init_ptq_val_loss"])]
        if "init_gptq_val_loss" in baseline:
            rows.append((f"start, GPTQ {quantizer}", baseline["init_gptq_val_loss"]))
    at = "loaded weights" if convert_only and init_from != "resume" else f"step {iter_num}"  # a finetune's step 0 is its start
    at = "GPTQ's weights" if quant_bits is not None and summary["method"] == "gptq" else at  # not the loaded ones
    rows.append((f"{at}, full precision", fp_val_loss))
    if quant_bits is not None:
        rows.append((f"{at}, {summary['method'].upper()} {quantizer} g{group_size}", summary["quant_val_loss"]))
    if "export_ptq_val_loss" in summary:
        rows.append((f"export_{export_format}, PTQ {quantizer} g{group_size}", summary["export_ptq_val_loss"]))
    print(f"\n{'whole validation split':<36} {'loss':>8} {'ppl':>9}")
    for name, loss in rows:
        print(f"{name:<36} {loss:>8.4f} {math.exp(loss):>9.3f}")
    if quant_bits is not None:
        print(f"converted model: {os.path.join(out_dir, 'quantized.pt')}")
    if "export_ptq_val_loss" in summary:
        print(f"note: export_{export_format}/ holds the unquantized weights; the scales learned for them are in quantized.pt "
              f"alone, and a tool that quantizes the export again rounds on max-based ones (the PTQ row above)")
    log_file.close()
    if wandb is not None:
        wandb.finish()
dist.destroy_process_group()
if torchrun:
    # gloo's worker threads release a collective's tensors late, taking the GIL: in interpreter
    # shutdown that aborts the process ("terminate called without an active exception") with its
    # work done. All is written and closed: skip the shutdown. (A plain `python` run may share its
    # interpreter with others, as in the tests: it returns.)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
