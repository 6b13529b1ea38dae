"""
Knowledge distillation (KD) of a Llama-family student from a teacher, with FSDP2, in one file.

One process (CPU or one GPU): distill the tiny base model into a smaller student
$ python kd_train.py config/tiny_kd.py
Several processes (GPUs, or CPU processes on gloo), e.g. Llama-3.1-8B into Llama-3.2-1B:
$ torchrun --standalone --nproc_per_node 8 kd_train.py config/llama_kd.py
Quantization-aware self-distillation (QAD): the student is fake-quantized, the teacher is the
same model in full precision
$ python kd_train.py config/tiny_qad.py

The student learns from the labels and from the teacher's whole next-token distribution:
loss = (1 - kd_ratio) * CE(student, labels) + kd_ratio * T^2 * D(teacher || student) at
temperature T, with D one of forward KL, reverse KL, symmetric KL or generalized Jensen-Shannon.
Both models' logits are computed a chunk of tokens at a time, so neither full-vocabulary fp32
logits tensor ever exists. The teacher is sharded like the student, runs under no_grad and
holds no optimizer state.

Distillation from a stored teacher: write the teacher's top-k log-probabilities over every train
window once (all processes in parallel, resumable: rerun the same command after a kill), then
train any number of students from the store without loading the teacher
$ python kd_train.py config/tiny_kd.py --topk_write=True --teacher_topk=256 --teacher_topk_dir=data/stdlib/teacher_tiny
$ torchrun --standalone --nproc_per_node 8 kd_train.py config/llama_kd.py --topk_write=True --teacher_topk_dir=...
$ python kd_train.py config/tiny_kd.py --teacher_topk_dir=data/stdlib/teacher_tiny
The store (teacher_topk_dir, default data_dir/teacher_topk) holds ids.bin (uint16, or uint32 past
65536 tokens) and logprobs.bin (float16), both (train windows * block_size, k) with row
w * block_size + t the target t of window w, as get_batch cuts it, and rest.bin (float32, one per
row: the log of the mass outside the top k, summed in float32, which 1 - sum(top k) of float16
values would bury in their rounding where the teacher is sure); done.bin (one byte per group
of batch_size windows written); meta.json (k, temperature, the teacher's path and a digest of its
files, the dtype it ran in, data and tokenizer fingerprints (the teacher's own too), its stop ids, windows done, the teacher's val loss, and "complete", set
last). 4k + 4 bytes a token (6k + 4 with uint32 ids). float16 rather than bfloat16: for log-probs in [-32, 0], where the mass is,
float16's 11-bit mantissa rounds a probability by < 0.8% and bfloat16's 8 bits by up to 6%, and
float16's range (down to -65504) is no limit for log-probs. They are the teacher's at the writing
run's kd_temperature, and training refuses another temperature: p_T(i) = p(i)^(1/T) / sum_j
p(j)^(1/T) needs every tail probability, which a top-k store does not hold. The KD term is then
exact over k + 1 buckets (see stored_chunk_losses).
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
import torch.nn.functional as F
from torch.distributed._composable import checkpoint as activation_checkpoint
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                    register_fsdp_forward_method)
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

# torchao's import logs notes about GPU-only kernels and a torch deprecation: not the user's concern
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, PerGroup, quantize_
from torchao.quantization.qat import QATConfig

from checkpoint import (CHECKPOINT_NAMES, FINAL_OUTPUTS, TO_SINGLE_FILE, atomic_save, check_resume, checkpoint_digest, export_executorch,
                        export_hf, export_meta, hf_unexportable, load_checkpoint, load_sharded_checkpoint, lock_dir, pte_summary,
                        ranks_not_sharing, remove_earlier_outputs, save_adapter, save_training_checkpoint,
                        set_aside_checkpoint, sharded_dir, source_generation, source_stop_ids, stop_ids, tokenizer_of)
from data_prep import DataPrepError, load_data_meta, load_tokenizer, load_topk_store, remove_tokenizer_files, tokenizer_mismatch
from model import (IGNORE_INDEX, LOGITS_PER_CHUNK, PRESETS, ModelArgs, Transformer, adapter_state_dict, check_quantizable,
                   fake_quantized_weight, flops_per_token, fuse_fake_quant, initial_scales, learn_scales, linear_with,
                   mark_only_lora_trainable, merge_lora, peak_flops, restart_scales, to_lora_keys, weights_only)

# -----------------------------------------------------------------------------
# I/O
out_dir = "out/kd"  # ckpt.pt, model.pt, log.jsonl (and adapter/, quantized.pt) go here
data_dir = "data/stdlib"  # train.bin, val.bin and meta.json from data_prep.py
teacher_init = "out/base/ckpt.pt"  # the teacher: a nanotune checkpoint or a Meta / HF directory
init_from = "scratch"  # the student: 'scratch', 'resume' (out_dir/ckpt.pt), or a checkpoint / directory
eval_interval = 100  # steps between validation estimates
eval_iters = 20  # batches per process per validation estimate; the final evaluation uses the whole split
log_interval = 10  # steps between log lines (the only steps that sync with the device)
ckpt_interval = 500  # steps between checkpoints; one is always written at the end
# each process writes its own shards of model and optimizer to out_dir/ckpt/ (torch.distributed.checkpoint)
# instead of rank 0 gathering everything into ckpt.pt: for models whose training state outgrows one host
sharded_checkpoint = False
save_adapter_only = False  # with LoRA: save the adapters alone, not the merged student
export_format = "none"  # also write the merged student as an 'hf' or 'meta' directory, or the converted one as 'pte' (ExecuTorch)
wandb_log = False  # also log to Weights & Biases (imported only then)
wandb_project = "nanotune"
wandb_run_name = "kd"
# student model, for init_from='scratch' (a checkpoint carries its own shape)
preset = "tiny-student"  # a name from model.PRESETS
n_layer = 0  # 0: the preset's value
n_head = 0
n_kv_head = 0
n_embd = 0
# distillation
kd_divergence = "fkl"  # 'fkl' forward KL, 'rkl' reverse KL, 'skl' symmetric KL, 'jsd' generalized Jensen-Shannon
kd_ratio = 0.5  # weight of the KD term; 1 - kd_ratio goes to cross-entropy with the labels
kd_temperature = 1.0  # softens both distributions; the KD term is scaled by T^2 to keep its gradient size
jsd_beta = 0.5  # the JSD's teacher weight in the mixture; -> 0 gives forward KL, -> 1 reverse KL
# a stored teacher: its top-k log-probabilities over the train windows, written once
teacher_topk_dir = ""  # distill from this store instead of running teacher_init ('': online KD)
topk_write = False  # write teacher_init's top-k into teacher_topk_dir (default data_dir/teacher_topk), then exit
# k, the tokens per position a store keeps (with topk_write): at vocab 4096 (bench.py kd) k = 8, 16,
# 32, 64, 256, 1024 closed 46, 51, 59, 68, 86, 100% of online KD's gap at equal speed; 1 KiB a token
teacher_topk = 256
# LoRA (0: full finetune)
lora_rank = 0
lora_alpha = 16.0
lora_dropout = 0.0
lora_targets = ("wq", "wk", "wv", "wo")  # any of wq wk wv wo w1 w2 w3 output
# quantization-aware distillation (as in qat_train.py)
quantizer = "none"  # 'none', '8daNw' (int8 dynamic activations, intN weights), 'Nw' (weight-only), N in 2..8, or '4w-gpu' (int4 weight-only, CUDA)
group_size = 32  # weights share one scale per group of this many input channels
fake_quant_after_n_steps = 0  # train in full precision until this step, then fake-quantize
quantize_embedding = False  # also fake-quantize the token embedding (weight-only, same bits)
quant_skip = ()  # modules left in full precision, by path, e.g. ('output', 'layers.0')
range_learning = False  # learn each weight group's scale with the weights (as in qat_train.py)
range_lr_ratio = 1.0  # the learned scales' learning rate, as a multiple of the weights'
# data and batch
batch_size = 16  # micro-batch size per process
block_size = 128  # tokens per sequence
loss_chunk = 0  # tokens per chunk of the loss (logits recomputed in backward); 0: fp32 logits <= 128 MiB
gradient_accumulation_steps = 0  # micro-batches per optimizer step over all processes; 0: one per process
# reduce gradients once per step instead of once per micro-batch: less traffic, but every process
# then holds a full unsharded gradient between micro-batches (2 bytes a trained parameter in bf16,
# 4 with mixed_precision)
accumulate_unsharded = False
# optimizer and schedule
max_iters = 300  # optimizer steps
learning_rate = 1e-3  # peak learning rate
min_lr = 1e-4  # the cosine decays to this at lr_decay_iters
lr_decay_iters = 0  # 0: max_iters; set it to stop a run early on the schedule of a longer one
warmup_iters = 30  # linear warmup steps
weight_decay = 0.1  # applied to matrices only
norm_lr_ratio = 1.0  # the RMSNorm gains' learning rate, as a multiple of the weights' (README, Quality)
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # clip the global gradient norm to this; float('inf') logs it without clipping
# > 0: the student ends as the running average of its trained weights over the steps, each step
# keeping ema_decay of the average (about the last 1 / (1 - ema_decay) steps count), restarted when
# fake quant begins: what is evaluated, saved and converted. One more copy of the trained weights
# (README, Quality)
ema_decay = 0.0
# system
device = "cpu"  # 'cpu' or 'cuda'
dtype = "float32"  # 'float32' or 'bfloat16'
mixed_precision = False  # with bfloat16: fp32 master weights and reductions, bf16 compute
compile = False  # torch.compile each transformer block and the loss
activation_checkpointing = 0  # recompute activations of every k-th student block in backward (0: off)
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
                                                    "log_interval", "ckpt_interval", "kd_temperature", "profile_active",
                                                    "teacher_topk", "group_size", "grad_clip", "replicate_degree", "norm_lr_ratio"))

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
if master_process and not topk_write and 0 < max_iters <= warmup_iters:  # e.g. a short run under a config's warmup
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
if kd_divergence not in ("fkl", "rkl", "skl", "jsd"):
    fail(f"kd_divergence={kd_divergence!r} is unknown; use 'fkl', 'rkl', 'skl' or 'jsd'")
if kd_ratio > 1 or jsd_beta > 1:
    fail(f"kd_ratio={kd_ratio} and jsd_beta={jsd_beta} are weights: each must lie in [0, 1]")
if lora_rank and quant_bits is not None:
    fail("quantizer with lora_rank > 0 is not supported: adapters trained over fake-quantized base weights won back less than a "
         "full finetune, and nothing once merged and rounded (README, Quality); use lora_rank=0 for QAD")
if save_adapter_only and not lora_rank:
    fail("save_adapter_only=True needs LoRA adapters; set lora_rank > 0")
if lora_rank and "norm_lr_ratio" in overridden:
    fail("norm_lr_ratio sets the RMSNorm gains' learning rate, and lora_rank > 0 trains the adapters alone; drop it or set lora_rank=0")
if lora_rank and init_from == "scratch":
    fail("lora_rank > 0 trains adapters on frozen weights; give a pretrained student with init_from, or set lora_rank=0")

resume_path = sharded_dir(out_dir) or os.path.join(out_dir, "ckpt.pt")
sharded_from = resume_path if init_from == "resume" and sharded_dir(resume_path) else None
if topk_write and not teacher_topk_dir:
    teacher_topk_dir = config["teacher_topk_dir"] = os.path.join(data_dir, "teacher_topk")
from_store = bool(teacher_topk_dir) and not topk_write  # distill from the store: no teacher is loaded
sources = {"init_from": resume_path if init_from == "resume" else init_from, "teacher_init": "scratch" if from_store else teacher_init}
for name, path in sources.items():
    if path != "scratch" and not os.path.exists(path):
        fail(f"{name}={globals()[name]!r}: {path} does not exist; give a nanotune checkpoint or a Meta / HF directory"
             + (" ('resume' needs a run in out_dir)" if path == resume_path else ""))
inputs = [p for p in sources.values() if p != "scratch"]
# a fresh run sets an earlier one's checkpoint in out_dir aside (below), so never reads one that is;
# and the student's checkpoints replace out_dir's, so the teacher is never one of them
try:
    set_aside_checkpoint(out_dir, inputs, move=False)
except ValueError as e:
    fail(str(e))
if not lora_rank and (unused := [k for k in ("lora_alpha", "lora_dropout", "lora_targets") if k in overridden]):
    fail(f"{', '.join(unused)} only matter with LoRA, and lora_rank=0; set lora_rank or drop them")
if lora_rank and not (lora_alpha > 0 and lora_dropout < 1):  # the adapters' updates would be 0: nothing would train
    fail(f"lora_alpha={lora_alpha} and lora_dropout={lora_dropout}: the adapters train only with lora_alpha > 0 and "
         f"lora_dropout < 1")
if kd_divergence != "jsd" and "jsd_beta" in overridden:
    fail(f"jsd_beta only matters with kd_divergence='jsd', not {kd_divergence!r}")
# kd_ratio 0 trains on the labels alone (a config file's KD settings are the job's, left alone; a
# store's temperature is still checked against the store)
if kd_ratio == 0 and (unused := [k for k in ("kd_divergence", "jsd_beta", *(() if teacher_topk_dir else ("kd_temperature",)))
                                 if k in command_line_keys()]):
    fail(f"kd_ratio=0 trains on the labels alone, so {', '.join(unused)} would only change the logged kd_loss; drop them "
         f"or set kd_ratio > 0")
# what the student's weights are trained for: a resume, and a finetune from a QAT or QAD checkpoint, compare them
quant_settings = ("quantizer", "group_size", "quantize_embedding", "quant_skip", "range_learning")
# a store write runs the teacher over the train windows and exits: the student's settings, the loss's
# and the loop's would be ignored (a config file may hold them: it is the training job's, shared)
if topk_write and (unused := [k for k in ("init_from", "preset", "n_layer", "n_head", "n_kv_head", "n_embd", "lora_rank",
                                          "lora_alpha", "lora_dropout", "lora_targets", "save_adapter_only",
                                          *quant_settings, "kd_ratio", "kd_divergence", "jsd_beta", "export_format",
                                          "wandb_log", "wandb_project", "wandb_run_name", "mixed_precision", "reshard_after_forward", *TRAINING_ONLY)
                              if k in command_line_keys()]):
    fail(f"topk_write=True only runs teacher_init over the train windows, so {', '.join(unused)} would be ignored; drop "
         f"them, and train from the store with teacher_topk_dir")
if "teacher_topk" in overridden and not teacher_topk_dir and not topk_write:
    fail("teacher_topk only matters with a top-k store (topk_write=True, or teacher_topk_dir); online KD reads the "
         "teacher's whole distribution")
if init_from == "scratch" and preset not in PRESETS:
    fail(f"preset={preset!r} is unknown; choose from {sorted(PRESETS)}")
try:
    data_meta = load_data_meta(data_dir, block_size)
except DataPrepError as e:
    fail(str(e))
data_tokenizer = data_meta.get("tokenizer")  # its fingerprint; hand-made data may have none

# the teacher top-k store: what it was written from, so that it can only meet the same data, tokenizer,
# windows and temperature; a store still being written is never read. Training from it, the store is
# the teacher: a teacher_topk or teacher_init naming another is refused, and the run records the store's
store_meta = None
if from_store:
    try:
        store_meta = load_topk_store(teacher_topk_dir, data_meta, block_size, kd_temperature)
    except DataPrepError as e:
        fail(str(e))
    if "teacher_topk" in overridden and teacher_topk != store_meta["k"]:
        fail(f"teacher_topk={teacher_topk}, but the store in {teacher_topk_dir} holds the top {store_meta['k']}, which "
             f"training reads; drop teacher_topk, or write a store of the top {teacher_topk}")
    if "teacher_init" in overridden and os.path.realpath(teacher_init) != os.path.realpath(store_meta["teacher_init"]):
        fail(f"teacher_init={teacher_init!r}, but the store in {teacher_topk_dir} was written from "
             f"{store_meta['teacher_init']!r}; drop teacher_init, or give the store of that teacher")
    teacher_init = config["teacher_init"] = store_meta["teacher_init"]
    teacher_topk = config["teacher_topk"] = store_meta["k"]  # recorded as what the run trains on
    if not store_meta.get("rest") and store_meta["k"] < store_meta["vocab_size"] and master_process:
        print(f"warning: the store in {teacher_topk_dir} was written before its rest (the teacher's mass outside its top "
              f"{store_meta['k']}) was stored: it is taken as 1 - their sum, which their float16 rounding buries where "
              f"the teacher is sure, and reverse KL and the JSD lean on it; write the store again for the exact rest")
# the student's checkpoints and final outputs replace out_dir's: the teacher (a store's too, which a
# resume or a rewrite of the store compares) is never one of them
if not topk_write and (mine := os.path.realpath(teacher_init)) in {os.path.realpath(p) for p in (
        out_dir, *(os.path.join(out_dir, n) for n in CHECKPOINT_NAMES + FINAL_OUTPUTS))}:
    fail(f"teacher_init={teacher_init!r} is {'the teacher of the store in ' + teacher_topk_dir + ', and ' if from_store else ''}"
         f"this run's own {os.path.basename(mine)} in out_dir, which the run replaces; copy the teacher elsewhere, or give "
         f"this run another out_dir")


model_sources = {}  # init_from's and teacher_init's (path, loaded checkpoint), to read their tokenizers from


@lru_cache(maxsize=None)  # read once per model: the checks below and a store's record ask again
def tokenizers_of(name):
    """The fingerprints of the tokenizer init_from or teacher_init was trained with, by kind: a
    checkpoint records one, an HF directory often holds two files (tokenizer.json, tokenizer.model),
    each read here. A file that cannot be read gives none."""
    found = {}
    for kind in ("hf", "sentencepiece"):  # each file: tokenizer_of reads the one of the kind named first
        try:
            if fingerprint := tokenizer_of(*model_sources[name], kind):
                found.setdefault(fingerprint["kind"], fingerprint)
        except (DataPrepError, OSError, ValueError):
            pass
    return found


def load_or_fail(name, path):
    if d := sharded_dir(path):  # only a resume reads shards: a teacher or student is one file here
        fail(f"{name}={path!r} is a sharded checkpoint; convert it with {TO_SINGLE_FILE.format(d)} and give {name}={d + '.pt'!r}")
    try:  # mmap: the weights are paged in as they are copied out; only rank 0 broadcasts them,
        # the other ranks need the shapes alone
        args, state = load_checkpoint(path, weights=master_process)
    except ValueError as e:
        fail(str(e))
    file = path if os.path.isfile(path) else os.path.join(path, "ckpt.pt")
    ckpt = torch.load(file, map_location="cpu", mmap=True, weights_only=True) if os.path.isfile(file) else {}
    if any(type(v) is not torch.Tensor for v in ckpt.get("model", {}).values()):  # torchao's quantized tensors
        fail(f"{name}={path!r} holds a converted (integer) model, which does not train; give the checkpoint it was "
             f"converted from (its ckpt.pt)")
    # teacher, student and data must share one tokenizer, or the divergence compares unrelated tokens
    # (data made by hand records none: teacher and student are held to each other below)
    model_sources[name] = (path, ckpt)
    try:
        theirs = tokenizer_of(path, ckpt, data_tokenizer["kind"]) if data_tokenizer else None
    except DataPrepError as e:  # a directory whose tokenizer files cannot be read
        fail(f"{name}={path!r}: {e}")
    if theirs and (diff := tokenizer_mismatch(theirs, data_tokenizer)):
        fail(f"{name}={path!r} was trained with another tokenizer than the data in {data_dir} ({diff}); "
             f"teacher, student and data must share one tokenizer")
    if data_tokenizer and not theirs and master_process:  # e.g. an HF directory without its tokenizer files
        print(f"warning: {name}={path!r} records no tokenizer, so nothing checks that the data in {data_dir} was "
              f"prepared with its tokenizer")
    # data made by hand says only how many ids it uses: fewer than the model's tokenizer has, and the
    # divergence would renormalize both models over the first ones alone (the rows past them are cut as padding)
    # (of an HF directory's two kinds, the tokenizer.json transformers reads)
    found = {} if data_tokenizer else tokenizers_of(name)
    if (size := (found.get("hf") or found.get("sentencepiece") or {}).get("vocab_size", 0)) > data_meta["vocab_size"]:
        fail(f"{name}={path!r} was trained with a tokenizer of {size} ids, and the data in {data_dir}, which records "
             f"no tokenizer, uses {data_meta['vocab_size']}: the divergence would compare the models over the first "
             f"{data_meta['vocab_size']} alone; prepare the data with data_prep.py and that tokenizer, or give its "
             f"meta.json vocab_size {size}")
    if args.lora_rank:  # a LoRA student of an earlier run: start from its merged weights
        state = merge_lora(state, args)
        args.lora_rank = 0
    return args, state, source_stop_ids(path, ckpt), source_generation(path, ckpt)


# the teacher's bytes (a store's: its teacher's), which a resume compares: a teacher retrained or
# replaced at the same path would change the objective mid-run without a word
teacher_digest = (store_meta or {}).get("teacher_digest") if from_store else checkpoint_digest(teacher_init) if teacher_init else None

# the student's shape: from the checkpoint, or from the preset and overrides; then our LoRA
# source_stops: the source model's stop ids beyond the data's EOS (an Instruct model lists several),
# carried in the checkpoints and written to the export's generation config
# generation: the source's sampling defaults, carried the same way (a student from scratch has none)
init_state, ckpt, source_stops, generation = None, {}, [], {}
if init_from == "resume":
    # our own checkpoint: model (adapters included), optimizer and position
    ckpt = torch.load(os.path.join(sharded_from, "state.pt") if sharded_from else resume_path,
                      map_location="cpu", mmap=True, weights_only=True)
    try:
        model_args, init_state = ModelArgs.from_dict(ckpt["model_args"], strict=True), ckpt.get("model")  # sharded: read later
    except ValueError as e:
        fail(f"{resume_path}: {e}")
    source_stops, generation = source_stop_ids(resume_path, ckpt), source_generation(resume_path, ckpt)
    try:  # these decide which batches a step sees, what is trained, or what the weights were trained for (the
        # teacher by its bytes, below, not its path, which may differ between nodes; quant_skip as normalized)
        quant_skip = config["quant_skip"] = check_quantizable(model_args, group_size, quant_skip, quantize_embedding) if quant_bits else ()
        changes = check_resume(ckpt, config, ("seed", "batch_size", "gradient_accumulation_steps", "block_size", "preset",
                                              "n_layer", "n_head", "n_kv_head", "n_embd", "lora_rank", "lora_alpha",
                                              "lora_dropout", "lora_targets", *quant_settings, "fake_quant_after_n_steps",
                                              "kd_ratio", "kd_divergence", "kd_temperature", "jsd_beta"), data_meta,
                               resume_path, "kd_train.py", asked=overridden)
    except ValueError as e:
        fail(str(e))
    if changes and master_process:
        print(f"note: the training settings change from the checkpoint's step: {changes}")
    if (was := ckpt["config"].get("ema_decay", 0.0)) != ema_decay:  # the average it holds is that one's
        fail(f"{resume_path} was trained with ema_decay={was}; resume with the same or start a new out_dir")
    if ckpt.get("weights_averaged") and max_iters > ckpt["iter_num"] and master_process:
        print(f"note: {resume_path} ended its run by replacing the weights with their average (ema_decay); "
              f"training continues from that average, not from its last step's weights")
    if bool(ckpt["config"].get("teacher_topk_dir")) != from_store:  # the whole distribution, or its stored top k
        fail(f"{resume_path} was trained {'from a top-k store' if not from_store else 'with an online teacher'}; resume it "
             f"{'from its store (teacher_topk_dir)' if not from_store else 'without teacher_topk_dir'}")
    if from_store and ckpt.get("store_k") not in (None, store_meta["k"]):  # (None: a checkpoint from before it was recorded)
        fail(f"{resume_path} was trained from a store of the teacher's top {ckpt['store_k']}, and the store in "
             f"{teacher_topk_dir} holds its top {store_meta['k']} (written again?); resume from that store or start a new out_dir")
    if ckpt.get("teacher_digest") not in (None, teacher_digest):  # checkpoints from before it was recorded: None
        fail(f"the teacher {teacher_init!r} is not the one {resume_path} was trained with (its bytes differ"
             f"{', or its store was rewritten' if from_store else ''}); resume with that teacher or start a new out_dir")
elif init_from == "scratch":
    shape = dict(PRESETS[preset], vocab_size=data_meta["vocab_size"])
    for key, value in (("n_layers", n_layer), ("n_heads", n_head), ("n_kv_heads", n_kv_head), ("dim", n_embd)):
        shape[key] = value or shape.get(key)
    try:
        model_args = ModelArgs(**shape)
    except ValueError as e:  # a shape that cannot be, e.g. n_head not dividing n_embd
        fail(str(e))
else:
    model_args, init_state, source_stops, generation = load_or_fail("init_from", init_from)
if init_from != "resume":
    model_args.lora_rank, model_args.lora_alpha = lora_rank, lora_alpha
    model_args.lora_dropout, model_args.lora_targets = lora_dropout, tuple(lora_targets)
    try:
        model_args.__post_init__()  # validates the LoRA targets
    except ValueError as e:
        fail(str(e))
# the longest window the student's weights have trained on: from scratch, block_size's positions alone
# (sample.py says so past them); a source of another kind, its own max_seq_len
source_ckpt = ckpt if init_from == "resume" else model_sources.get("init_from", (None, {}))[1]
trained_context = block_size if init_from == "scratch" else max(block_size, source_ckpt.get("trained_context", model_args.max_seq_len))
if from_store:  # the stop ids the teacher had when its store was written (a store from before they were recorded: none)
    teacher_args, teacher_state, teacher_stops = None, None, store_meta.get("stop_ids")
else:
    teacher_args, teacher_state, teacher_stops, _ = load_or_fail("teacher_init", teacher_init)
# data without a tokenizer fingerprint (made by hand) holds neither model to one: they are held to
# each other (a store's teacher by the fingerprints the store recorded) in a kind both have,
# tokenizer.json first (what transformers and data_prep.py read from an HF directory holding both);
# tokenizers of two kinds cannot be compared
if not data_tokenizer and "init_from" in model_sources and (student_toks := tokenizers_of("init_from")):
    teacher_toks = store_meta.get("teacher_tokenizers") if from_store else tokenizers_of("teacher_init")
    kinds = sorted(student_toks.keys() & (teacher_toks or {}).keys(), key=lambda kind: (kind != "hf", kind))
    teacher = f"the teacher of the store in {teacher_topk_dir}" if from_store else f"teacher_init={teacher_init!r}"
    if kinds and (diff := tokenizer_mismatch(student_toks[kinds[0]], teacher_toks[kinds[0]])):
        fail(f"init_from={init_from!r} and {teacher} were trained with different tokenizers ({diff}); "
             f"teacher and student must share one")
    if not kinds and master_process:
        why = ("the store predates recorded teacher tokenizers (rerun its topk_write command to record them)"
               if teacher_toks is None else f"{teacher} has no readable tokenizer of the student's kind")
        print(f"warning: the data in {data_dir} records no tokenizer and {why}, so nothing holds the student to the "
              f"teacher's tokenizer")
if init_from == "scratch":  # a student from scratch stops where its teacher does
    if teacher_stops is None and master_process:
        print(f"warning: the store in {teacher_topk_dir} predates recorded stop ids, so this student stops at the data's "
              f"EOS alone, not at its teacher's other stop ids (an Instruct model's end of turn); rerun the store's "
              f"topk_write command to record them")
    source_stops = teacher_stops or []

# vocabularies: rows past the tokenizer's size are padding and are sliced off; more rows than
# padding would explain means the two models were trained with different tokenizers
n_vocab = data_meta["vocab_size"]
for who, args in (("student", model_args), ("teacher", teacher_args or model_args)):
    if args.vocab_size < n_vocab:
        fail(f"the data in {data_dir} uses {n_vocab} token ids but the {who} has only {args.vocab_size}; prepare the data with the models' tokenizer")
    if args.vocab_size - n_vocab >= 1024:
        fail(f"the {who} has {args.vocab_size} vocabulary rows but the data's tokenizer only {n_vocab}: more than padding, so the {who} uses another tokenizer; teacher and student must share one")
if block_size > min(model_args.max_seq_len, (teacher_args or model_args).max_seq_len):
    fail(f"block_size={block_size} exceeds max_seq_len (student {model_args.max_seq_len}, teacher {(teacher_args or model_args).max_seq_len})")
if topk_write and teacher_topk > n_vocab:
    fail(f"teacher_topk={teacher_topk} exceeds the data's {n_vocab} token ids; k = {n_vocab} stores the whole distribution")

store_meta_path = os.path.join(teacher_topk_dir, "meta.json")


def write_store_meta():
    tmp = store_meta_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(store_meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, store_meta_path)


if topk_write and os.path.exists(store_meta_path):  # a write to resume, or done
    with open(store_meta_path) as f:
        store_meta = json.load(f)
store_spec = None  # what a store written now is made of, and how its work is cut
if topk_write:
    store_spec = json.loads(json.dumps({  # through JSON, so that it compares equal to a meta.json read back
        "k": teacher_topk, "temperature": kd_temperature, "block_size": block_size, "vocab_size": n_vocab,
        "ids_dtype": "uint16" if n_vocab <= 2 ** 16 else "uint32", "logprobs_dtype": "float16",
        "batch_size": batch_size, "teacher_init": teacher_init, "teacher_args": vars(teacher_args),
        "dtype": dtype,  # a write resumed in another precision would hold rows of two
        # the teacher's bytes, not only its path: a teacher retrained in place must not extend its old store
        "teacher_digest": teacher_digest,
        "data": data_meta.get("data"), "tokenizer": data_tokenizer}))
    # (a store from before the dtype was recorded is taken to be in this one)
    if store_meta is not None and (changed := [k for k in store_spec if store_meta.get(k, dtype if k == "dtype" else None) != store_spec[k]]):
        fail(f"{teacher_topk_dir} holds a store written with other {', '.join(changed)}; rerun with its settings to "
             f"finish it, or give another teacher_topk_dir")
    store_done = store_meta is not None and store_meta["complete"]  # nothing to write: it stops once the processes agree
try:
    quant_skip = config["quant_skip"] = check_quantizable(model_args, group_size, quant_skip, quantize_embedding) if quant_bits else ()
except ValueError as e:
    fail(str(e))
if export_format == "hf" and (why := hf_unexportable(model_args)):
    fail(why)

tokens_per_iter = gradient_accumulation_steps * batch_size * block_size

# every process must run one job. Each node reads its own copy of the code, the config, the data and
# the checkpoints: one that differs (a config edited on one node, data prepared again there) would
# train on beside the others without a word. Paths may differ between nodes, and what rank 0 alone
# uses (names in logs, the MFU's peak); what the paths hold may not. A sharded checkpoint by its state.pt
job = {**{k: v for k, v in config.items() if k not in ("out_dir", "data_dir", "init_from", "teacher_init", "teacher_topk_dir",
                                                        "wandb_project", "wandb_run_name", "peak_flops_per_device")},
       "init_from": init_from if init_from in ("scratch", "resume") else "a checkpoint", "code": code_digest(__file__),
       "data": data_meta.get("data") or {}, "tokenizer": data_tokenizer or {}, "store": store_meta or {},
       "checkpoints": {"init_from": None if init_from == "scratch" else checkpoint_digest(
           os.path.join(sharded_from, "state.pt") if sharded_from else sources["init_from"]), "teacher_init": teacher_digest}}
jobs = [None] * world_size
dist.all_gather_object(jobs, job)
compared = True
if disagreement := ranks_disagree(jobs):
    fail(disagreement, every_node=any("failed" in j for j in jobs))  # a process that failed told its own node alone
if topk_write and store_done:
    if master_process:
        # a store from before they were recorded: recorded now (its teacher's digest matched above)
        if "stop_ids" not in store_meta or "teacher_tokenizers" not in store_meta:
            store_meta.update(stop_ids=teacher_stops, teacher_tokenizers=tokenizers_of("teacher_init"))
            try:
                write_store_meta()
            except OSError as e:  # a read-only store, say: it still trains, its students unchecked
                print(f"warning: could not record the teacher's stop ids and tokenizer in {store_meta_path}: {e}")
        print(f"the store in {teacher_topk_dir} is complete; nothing to write")
    dist.destroy_process_group()
    sys.exit(0)
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
    if topk_write:  # what this run writes is the store (out_dir gets the tokenizer's copy alone)
        os.makedirs(teacher_topk_dir, exist_ok=True)
    dir_lock, lock_error[0] = lock_dir(teacher_topk_dir if topk_write else out_dir)
dist.broadcast_object_list(lock_error, src=0)  # every rank stops, not rank 0 alone
if lock_error[0]:
    fail(lock_error[0])
# a store's rows (topk_write) and sharded checkpoints are written by every process into one directory:
# a path local to each node would split them between the nodes, unreadable, without a word. Rank 0
# leaves a file there that every process must see
shared_dir = teacher_topk_dir if topk_write else out_dir
if world_size > 1 and (topk_write or sharded_checkpoint):
    try:
        blind = ranks_not_sharing(shared_dir)
    except ValueError as e:
        fail(str(e))
    if blind:
        fail(f"every process writes its {'rows of the store' if topk_write else 'checkpoint shards'} into {shared_dir}, "
             f"which rank(s) {', '.join(map(str, blind))} cannot see as rank 0 does (a directory local to each node?); "
             f"give a directory that every node shares")
if master_process:
    # the data's tokenizer beside each checkpoint, to sample and export it with, and no other (in an
    # out_dir this run holds): an earlier run's would be read with it, or instead of it
    names = load_tokenizer(data_dir).save(out_dir) if data_tokenizer and data_tokenizer.get("files") else []
    if not topk_write:
        remove_tokenizer_files(out_dir, keep=names)
    print(f"{world_size} process(es) on {device_type}, {tokens_per_iter:,} tokens per step")

# -----------------------------------------------------------------------------
# data: non-overlapping windows of block_size + 1 tokens; each epoch visits every window once
# in an order fixed by (seed, epoch), so the batches of step n never depend on how we got there
data_dtype = np.dtype(data_meta["dtype"])
has_mask, has_pos = bool(data_meta.get("has_mask")), bool(data_meta.get("has_pos"))


data_files = {}  # (inode, size, time) of each file as first opened, against data_prep.py (or a store's write) under this run


def opened(path, dtype, shape=None, again=None):
    """A fresh read-only memmap of path (a long-lived one grows the process's memory: nanoGPT's
    lesson), or a stop if the file is not the one this run first opened (`again`: how that came)."""
    try:
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            now = stat.st_ino, stat.st_size, stat.st_mtime_ns  # the time too: a store's write truncates in place
            m = np.memmap(f, dtype=dtype, mode="r", shape=shape)
    except (FileNotFoundError, ValueError):  # gone, or shorter than the shape it had (a store of a smaller k)
        now = None
    if now is None or data_files.setdefault(path, now) != now:  # replaced, rewritten or removed
        # on whichever rank sees it (data may be local to each node), so not through fail()
        print(f"error{f' (rank {rank})' if world_size > 1 else ''}: {path} changed during the run ({again}?); stopped "
              f"rather than train on other data", file=sys.stderr, flush=True)
        sys.exit(2)
    return m


def memmap(split, kind=""):
    dtype = {"": data_dtype, "mask": np.uint8, "pos": np.dtype(data_meta.get("pos_dtype") or "uint16")}[kind]
    return opened(os.path.join(data_dir, f"{split}_{kind}.bin" if kind else f"{split}.bin"), dtype,
                  again=f"data prepared again into {data_dir}")


n_targets = {s: len(memmap(s)) - 1 for s in ("train", "val")}  # every token but the first is a target
n_windows = {s: n // block_size for s, n in n_targets.items()}  # whole windows, for training and estimates
if from_store and store_meta["n_windows"] != n_windows["train"]:  # data without file fingerprints: not caught before
    fail(f"the store in {teacher_topk_dir} holds {store_meta['n_windows']} windows, the train split of {data_dir} "
         f"{n_windows['train']}: it was written from other data; write a store for this data with topk_write=True")
global_batch = batch_size * gradient_accumulation_steps  # windows per optimizer step
steps_per_epoch = n_windows["train"] // global_batch
if steps_per_epoch == 0:
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


def store_memmaps(mode="r"):
    """The store's top-k ids and log-probs, (train windows * block_size, k) each, and the log of
    the mass outside the top k, (train windows * block_size,): None in a store written before
    2026-12-06, whose rest is 1 - sum(top k)."""
    n = store_meta["n_windows"] * block_size
    files = [("ids.bin", store_meta["ids_dtype"], (n, store_meta["k"])), ("logprobs.bin", np.float16, (n, store_meta["k"]))]
    files += [("rest.bin", np.float32, (n,))] if store_meta.get("rest") else []
    if mode == "r":  # training from it: checked as the data's files are
        again = f"a store written again into {teacher_topk_dir}"
        maps = [opened(os.path.join(teacher_topk_dir, name), dt, shape, again) for name, dt, shape in files]
    else:
        maps = [np.memmap(os.path.join(teacher_topk_dir, name), dtype=dt, mode=mode, shape=shape) for name, dt, shape in files]
    return (*maps, None) if len(maps) == 2 else tuple(maps)


def stored_topk(windows):
    """The stored teacher's top-k token ids (int64) and log-probs (float32), (B, T, k) and
    (B, T, k + 1) with the rest's last where the store holds it, for train windows: the targets
    of get_batch("train", windows), row for row."""
    ids, logp, rest = store_memmaps()
    rows = (windows[:, None] * block_size + torch.arange(block_size)).flatten().numpy()
    ids = torch.from_numpy(ids[rows].astype(np.int64)).view(len(windows), block_size, -1)
    logp = logp[rows].astype(np.float32) if rest is None else np.concatenate((logp[rows], rest[rows, None]), 1, dtype=np.float32)
    logp = torch.from_numpy(logp).view(len(windows), block_size, -1)
    if device_type == "cuda":
        ids, logp = ids.pin_memory().to(device, non_blocking=True), logp.pin_memory().to(device, non_blocking=True)
    return ids, logp


def train_batches(it):
    """This process's micro-batches for step `it`: the step's slice of the epoch order, cut in
    gradient_accumulation_steps micro-batches, every world_size-th one ours. Each is (x, y, pos,
    the stored teacher's (ids, log-probs) or None)."""
    epoch, step = divmod(it, steps_per_epoch)
    windows = epoch_order(epoch)[step * global_batch: (step + 1) * global_batch]
    return [(*get_batch("train", w), stored_topk(w) if from_store else None)
            for w in windows.view(gradient_accumulation_steps, batch_size)[rank::world_size]]


# -----------------------------------------------------------------------------
# models: built on the meta device (no memory), sharded, then materialized. The student may be
# fake-quantized and may carry LoRA adapters; the teacher is frozen.
with torch.device("meta"):
    model = Transformer(model_args)
    teacher = Transformer(teacher_args) if teacher_args else None  # None: distilled from a store
model.to(param_dtype)
if teacher is not None:
    teacher.to(ptdtype)  # no master weights needed: it never steps
    teacher.requires_grad_(False)
if lora_rank:
    mark_only_lora_trainable(model)


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
    holds more than the converted pieces and one piece in the compute dtype: after QAD (m then
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
    for block in list(model.layers) + (list(teacher.layers) if teacher is not None else []):
        block.compile()

# FSDP2: one unit per block, the embedding its own; the root keeps the final norm and output,
# which FSDP leaves gathered after the root's forward (until backward ends), so the chunked
# loss below can call both output layers directly
mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else MixedPrecisionPolicy()
offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
for m in filter(None, (model, teacher)):
    # the teacher never runs backward: its blocks would gain nothing from staying gathered
    kw = dict(mesh=mesh, mp_policy=mp_policy if m is model else MixedPrecisionPolicy(),
              reshard_after_forward=reshard_after_forward or m is teacher, offload_policy=offload)
    for block in m.layers:
        fully_shard(block, **kw)
    if not m.args.tie_embeddings:  # tied, the embedding is the output's weight: both stay in the root
        fully_shard(m.tok_embeddings, **kw)
    fully_shard(m, **{**kw, "reshard_after_forward": False})  # the root stays gathered: see above
    register_fsdp_forward_method(m, "hidden")  # FSDP's gathering hooks also run for .hidden()
    m.to_empty(device="cpu" if cpu_offload else device)
    m.reset_buffers(device)


def lora_init_state():
    """Fresh adapters for the student, made on rank 0 so that every process count starts from the
    same values: A as nn.Linear's default init, B zero (the student starts as its base model)."""
    gen, out = torch.Generator().manual_seed(seed), {}
    for name, p in model.named_parameters():
        t = torch.zeros(p.shape)
        if name.endswith("lora_a"):
            nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=gen)
        if name.endswith(("lora_a", "lora_b")):
            out[name] = t.to(param_dtype)
    return out


# weights: rank 0 holds each full state dict (a fresh init, or the mmapped checkpoint) and
# broadcasts it; each rank keeps only its shards
# a QAT or QAD checkpoint trained with this very fake quantization: its learned scales carry over, and
# converting it untrained (max_iters=0) converts what it was trained as, not PTQ of its weights
init_source = model_sources.get("init_from", (None, {}))[1]
source_same_quant = bool(init_source.get("fake_quant")) and all(init_source.get("config", {}).get(k) == config[k]
                                                                 for k in quant_settings)
if master_process and not sharded_from:
    if init_state is None:
        init_model = Transformer(model_args)
        init_model.init_weights(seed=seed)
        init_state = init_model.state_dict()
    elif lora_rank and init_from != "resume":
        init_state = {**to_lora_keys(init_state, model), **lora_init_state()}
    if range_learning and init_from != "resume":  # a resume has its learned scales, and so has such a source
        init_state = {**init_state, **initial_scales(model, init_state),
                      **{k: v for k, v in init_source.get("model", {}).items() if source_same_quant and k.endswith("learned_scale")}}
broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
if not sharded_from:  # a sharded checkpoint is read after the optimizer exists, with its state
    set_model_state_dict(model, init_state if master_process else {}, options=broadcast)
if teacher is not None:
    set_model_state_dict(teacher, teacher_state if master_process else {}, options=broadcast)
    teacher.eval()
del init_state, teacher_state

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


# optimizer: AdamW over the trainable parameters (the adapters alone with LoRA), decay on weight
# matrices only (not on learned scales: it would shrink the grid)
params = [p for p in model.parameters() if p.requires_grad]
scales = {p for n, p in model.named_parameters() if n.endswith("learned_scale")}
groups = [{"params": [p for p in params if p.ndim >= 2 and p not in scales], "weight_decay": weight_decay},
          {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr_ratio": norm_lr_ratio},
          {"params": [p for p in params if p in scales], "weight_decay": 0.0, "lr_ratio": range_lr_ratio}]
optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=learning_rate, betas=(beta1, beta2),
                              fused=True)  # one kernel per step, on GPUs and CPUs alike
if not topk_write:  # writing the store trains nothing: no state to hold
    init_optimizer_state(optimizer)
iter_num = 0
if sharded_from:  # every rank reads its own shards, with the optimizer's state
    load_sharded_checkpoint(model, [optimizer], sharded_from)
if init_from == "resume":
    iter_num = ckpt["iter_num"]
    if not sharded_from:
        set_optimizer_state_dict(model, optimizer, ckpt["optimizer"] if master_process else {}, options=broadcast)
    if rank < len(ckpt["rng"]):  # a resume on more processes than before keeps fresh states on the new ones
        torch.set_rng_state(ckpt["rng"][rank]["cpu"])
        if device_type == "cuda" and ckpt["rng"][rank]["cuda"] is not None:
            torch.cuda.set_rng_state(ckpt["rng"][rank]["cuda"])
    # the loaded state brings its run's settings too: this run's, as printed above, apply from here
    group_of = {p: g for g in groups for p in g["params"]}
    for group in optimizer.param_groups:
        group.update({k: v for k, v in group_of[group["params"][0]].items() if k != "params"}, betas=(beta1, beta2))
    if master_process:
        print(f"resumed from {resume_path} at step {iter_num}")
start_iter = iter_num
teacher_val_loss = ckpt.get("teacher_val_loss")
# how the loaded weights were trained (resume has checked that the quantization settings match)
ckpt_fake_quant = bool(ckpt.get("fake_quant")) if init_from == "resume" else source_same_quant
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
    pairs = [(optimizer.state[p]["ema"], p) for group in optimizer.param_groups for p in group["params"]]
    return [a.to_local() for a, _ in pairs], [p.detach().to_local() for _, p in pairs]


if ema_decay and init_from != "resume" and not topk_write:  # the average starts at the weights training starts from
    torch._foreach_copy_(*weight_averages())


# -----------------------------------------------------------------------------
# the loss: cross-entropy with the labels plus a divergence from the teacher, a chunk of tokens
# at a time. Each chunk is checkpointed: backward recomputes its logits instead of keeping them.


def divergence(s_logp, t_logp):
    """Per-token divergence (N,) between teacher and student log-probabilities (N, V)."""
    def kl(p_logp, q_logp):  # KL(p || q)
        return (p_logp.exp() * (p_logp - q_logp)).sum(-1)
    if kd_divergence == "fkl":
        return kl(t_logp, s_logp)  # mass-covering: the student must cover all the teacher's modes
    if kd_divergence == "rkl":
        return kl(s_logp, t_logp)  # mode-seeking
    if kd_divergence == "skl":
        return 0.5 * (kl(t_logp, s_logp) + kl(s_logp, t_logp))
    # generalized JSD (Agarwal et al., 2024) with mixture m = beta * teacher + (1 - beta) * student,
    # divided by beta * (1 - beta) so that it tends to forward KL as beta -> 0, reverse KL as -> 1
    if jsd_beta == 0.0:
        return kl(t_logp, s_logp)
    if jsd_beta == 1.0:
        return kl(s_logp, t_logp)
    # written with log(m / student) and log(m / teacher) directly: subtracting two nearly equal
    # logs of m would lose the small divergences that beta near 0 or 1 then magnifies
    b, d = jsd_beta, t_logp - s_logp
    log_m_s = torch.logaddexp(d + math.log(b), torch.full_like(d, math.log1p(-b)))
    log_m_t = torch.logaddexp(torch.full_like(d, math.log(b)), math.log1p(-b) - d)
    jsd = -(b * (t_logp.exp() * log_m_t).sum(-1) + (1 - b) * (s_logp.exp() * log_m_s).sum(-1))
    return jsd / (b * (1 - b))


class StudentLogProbs(torch.autograd.Function):
    """The student's log-probabilities that the losses read, from its fp32 logits z (N, V): at the
    labels y (N,), over all V rows, for the CE (0 where y is ignored); and at temperature T over
    the tokenizer's n_vocab rows, either all of them (ids None: online KD) or coarse-grained onto
    the stored teacher's k + 1 buckets (ids (N, k): its top k tokens, then the rest of the mass).
    Online, given the teacher's log-probabilities at T (t_logp, (N, n_vocab)), it returns the
    forward KL(teacher || student) of each row instead of the student's log-probabilities: the
    default divergence, whose gradient then joins the same pass.

    Only the point is speed: autograd through log_softmax, the division by T, gather and nll_loss
    passes over (N, V) five times in backward (a zero-filled buffer for each gather, the division,
    the sum), which costs a stored-top-k step more than the CE it adds to. Here the gradient is
    written in one pass (two at T != 1 or with padding rows), from d log S_j / d z_v =
    [v in bucket j] p_v / S_j - p_v with S_j a bucket's mass: the top k's entries are
    g_v - p_v * sum(g), the rest's p_v * (g_rest / S_rest - sum(g)), and the label's g_y (1 - p_y).
    The forward KL's gradient in the student's log-probs is g_v = -t_v * g_row (t the teacher's
    probabilities), and sum(g) = -g_row: through autograd it would take four more passes over (N, V)."""

    @staticmethod
    def forward(ctx, z, y, ids, temperature, t_logp):
        lp = F.log_softmax(z, -1)  # the CE's, over every row
        shared = temperature == 1 and z.shape[1] == n_vocab
        lpt = lp if shared else F.log_softmax(z[:, :n_vocab] / temperature, -1)
        keep = y != IGNORE_INDEX
        y = torch.where(keep, y, 0)
        label = torch.where(keep, lp.gather(1, y[:, None]).squeeze(1), 0.0)
        top = rest = rest_live = t_p = None
        if ids is None:
            out = lpt
            if t_logp is not None:
                t_p = t_logp.exp()
                out = (t_logp - lpt).mul_(t_p).sum(-1)  # KL(teacher || student) per row
        else:
            out = top = lpt.gather(1, ids)  # (N, k)
            if ids.shape[1] < n_vocab:
                # the rest is 1 - sum(top k), floored at float32's epsilon (0 * log 0 would be NaN):
                # log(-expm1(log sum)), exact down to the floor; a floored row takes no gradient
                lse, cap = top.logsumexp(-1), math.log1p(-torch.finfo(torch.float32).eps)
                rest, rest_live = torch.log(-torch.expm1(lse.clamp(max=cap))), lse <= cap
                out = torch.cat((top, rest[:, None]), 1)
        ctx.save_for_backward(lp, None if shared else lpt, y, keep, ids, top, rest, rest_live, t_p)
        ctx.temperature, ctx.shared = temperature, shared
        ctx.set_materialize_grads(False)  # an output outside the loss (kd_ratio 0) gets None, not a pass over zeros
        return out, label

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, g_label):
        lp, lpt, y, keep, ids, top, rest, rest_live, t_p = ctx.saved_tensors
        T = ctx.temperature
        g_label = torch.zeros_like(lp[:, 0]) if g_label is None else g_label * keep
        if g is None:  # the KD term is only logged: the CE's gradient alone
            grad = lp.exp().mul_(-g_label[:, None])
            grad.scatter_add_(1, y[:, None], g_label[:, None])
            return grad, None, None, None, None
        if t_p is not None:
            per_row = g  # the KL's row gradient; the teacher's probabilities sum to 1
        elif ids is None:
            per_row = -g.sum(1)
        else:
            k = ids.shape[1]
            g_rest = w_rest = torch.zeros_like(g[:, 0])
            if rest is not None:
                g_rest = g[:, k] * rest_live  # a floored rest is a constant: no gradient
                w_rest = g_rest * torch.exp(-rest)
            per_row, at_ids = w_rest - g[:, :k].sum(1) - g_rest, g[:, :k] - top.exp() * w_rest[:, None]
        if ctx.shared:  # one pass: p * (the KD's row factor - the CE's)
            grad = lp.exp().mul_((per_row - g_label)[:, None])
        else:
            grad = lp.exp().mul_(-g_label[:, None])
            grad[:, :n_vocab].addcmul_(lpt.exp(), (per_row / T)[:, None])
        kd_part = grad[:, :n_vocab]  # a view: writes land in grad
        if t_p is not None:
            kd_part.addcmul_(t_p, g[:, None], value=-1 / T)
        elif ids is None:
            kd_part.add_(g, alpha=1 / T)
        else:
            kd_part.scatter_add_(1, ids, at_ids / T)
        grad.scatter_add_(1, y[:, None], g_label[:, None])
        return grad, None, None, None, None


def chunk_losses(hs, ht, y, w=None):
    """Summed CE and KD over one chunk of tokens: hs (N, Cs), ht (N, Ct), y (N,); w the student's
    fake-quantized output weight, when the step's chunks share it (model.fake_quantized_weight)."""
    s_logits = linear_with(model.output, hs, w).float()  # (N, V), fp32 for this chunk only
    with torch.no_grad():
        # rows past the tokenizer's vocabulary are padding, not part of either distribution
        t_logits = teacher.output(ht).float()[:, :n_vocab]
        t_logp = F.log_softmax(t_logits if kd_temperature == 1 else t_logits / kd_temperature, -1)
    # the forward KL (the JSD at beta 0 is one) comes out of StudentLogProbs; others through autograd.
    # At kd_ratio 0 the KD term is only logged: detached, so that no 0 * nan of a teacher's inf
    # reaches the gradient
    fkl = (kd_divergence == "fkl" or kd_divergence == "jsd" and jsd_beta == 0.0) and kd_ratio > 0
    s_out, label_logp = StudentLogProbs.apply(s_logits, y, None, kd_temperature, t_logp if fkl else None)
    kd = ((s_out if fkl else divergence(s_out if kd_ratio > 0 else s_out.detach(), t_logp))
          * (y != IGNORE_INDEX)).sum() * kd_temperature ** 2
    return -label_logp.sum(), kd


def stored_chunk_losses(hs, t_ids, t_logp, y, w=None):
    """Summed CE and KD over one chunk of tokens against the stored teacher: hs (N, Cs), t_ids
    (N, k) its k likeliest tokens, t_logp (N, k) their log-probs at kd_temperature, or (N, k + 1)
    with the log of the rest's mass last, y (N,); w as in chunk_losses.

    The teacher's tail, the mass 1 - sum(top k) it puts outside its top k, is one bucket "rest",
    compared with the student's mass on those same tokens: both distributions coarse-grained onto
    the same k + 1 buckets, so every divergence is well defined, none exceeds its full-vocabulary
    value (coarse-graining never increases an f-divergence), and k = vocabulary gives the full
    one. Renormalizing the top k instead would make the teacher look surer than it is and leave
    the student free to put any mass outside the top k."""
    s_buckets, label_logp = StudentLogProbs.apply(linear_with(model.output, hs, w).float(), y, t_ids, kd_temperature, None)
    eps = torch.finfo(torch.float32).eps
    if t_logp.shape[1] > t_ids.shape[1]:  # the store's rest (its last column), floored like the student's
        top, rest = t_logp[:, :-1], t_logp[:, -1:].clamp(min=math.log(eps))
        t_logp = torch.cat((top, rest), -1) if t_ids.shape[1] < n_vocab else top  # k = vocabulary: no rest
    elif t_ids.shape[1] < n_vocab:
        # an older store's rest: 1 - sum(top k), where float16 rounding can take the sum past 1
        t_logp = torch.cat((t_logp, (1 - t_logp.exp().sum(-1, keepdim=True)).clamp(min=eps).log()), -1)
    t_buckets = F.log_softmax(t_logp, -1)  # renormalized: float16 log-probs sum to 1 only within rounding
    kd = (divergence(s_buckets if kd_ratio > 0 else s_buckets.detach(), t_buckets) * (y != IGNORE_INDEX)).sum() * kd_temperature ** 2
    return -label_logp.sum(), kd


if compile:
    # static shapes: a chunk of another length mid-step would otherwise compile a dynamic graph that
    # the earlier chunks' recomputation in backward then runs, saving its tensors in another order
    # than their forward did (torch 2.11, CUDA: a CheckpointError)
    chunk_losses = torch.compile(chunk_losses, dynamic=False)
    stored_chunk_losses = torch.compile(stored_chunk_losses, dynamic=False)
# tokens per chunk: by default 1048 at vocab 32000, whose fp32 logits then take 134 MB per model
chunk_tokens = loss_chunk or max(1, LOGITS_PER_CHUNK // max(model_args.vocab_size, (teacher_args or model_args).vocab_size))


def distill_loss(x, y, pos, topk=None):
    """Summed (CE, KD) of a micro-batch (B, T); pos: positions within packed samples, or None;
    topk: the stored teacher's (ids, log-probs) as stored_topk gives them, or None to run the teacher."""
    hs = model.hidden(x, pos).flatten(0, 1)  # (B*T, Cs)
    if topk is None:
        with torch.no_grad():
            teacher_side, losses = (teacher.hidden(x, pos).flatten(0, 1),), chunk_losses  # (B*T, Ct)
    else:
        teacher_side, losses = tuple(t.flatten(0, 1) for t in topk), stored_chunk_losses  # (B*T, k), (B*T, k [+ 1])
    y = y.flatten()
    if hs.shape[0] <= chunk_tokens:
        return losses(hs, *teacher_side, y)
    ce, kd = torch.zeros((), device=hs.device), torch.zeros((), device=hs.device)
    w = fake_quantized_weight(model.output)  # once for every chunk (QAD), not in each and its recomputation
    for c in range(0, hs.shape[0], chunk_tokens):
        sl = slice(c, c + chunk_tokens)
        ce_c, kd_c = checkpoint(losses, hs[sl], *(t[sl] for t in teacher_side), y[sl], w, use_reentrant=False)
        ce, kd = ce + ce_c, kd + kd_c
    return ce, kd


# -----------------------------------------------------------------------------
# helpers: evaluation, checkpointing, logging


@torch.no_grad()
def evaluate(m, full=False, it=0, alone=False):
    """Mean validation loss (CE with the labels): eval_iters random batches, or (full=True) every
    token of the split exactly once, the last partial window included. Every rank runs the same
    number of forwards (padding with ignored windows), since an FSDP forward is a collective."""
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


def convert_and_evaluate(state, after_qad):
    """On rank 0: a plain model built from `state` (with the fake quantizers, and any learned scales,
    the conversion reads after QAD), converted to real low-bit weights and evaluated on every window
    of the validation split. Returns (that loss, the model)."""
    with torch.device("meta"):
        qm = Transformer(model_args)
        if after_qad:
            quantize_model(qm, "prepare")
            if range_learning:
                learn_scales(qm)
    if not (after_qad and range_learning):
        state = weights_only(state)
    qm.load_state_dict({k: v.to(ptdtype) for k, v in state.items()}, assign=True)
    convert_on_device(qm.requires_grad_(False), after_qad)
    return evaluate(qm, full=True, alone=True), qm


def full_state_dict(m):
    # a collective: every rank calls it; only rank 0 ends up with the tensors, on the CPU
    return get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_checkpoint():
    """ckpt.pt, or (sharded_checkpoint) the directory ckpt/ of every rank's shards: checkpoint.py."""
    rngs = [None] * world_size
    dist.all_gather_object(rngs, {"cpu": torch.get_rng_state(),
                                  "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None})
    small = {"script": "kd_train.py", "model_args": vars(model_args).copy(), "iter_num": iter_num,
             "epoch": iter_num // steps_per_epoch, "config": config, "quantizer": quantizer, "group_size": group_size,
             "fake_quant": iter_num > 0 and fake_quant_on(iter_num - 1), "teacher_init": teacher_init,
             "weights_averaged": bool(ema_decay) and iter_num == max_iters,  # the loop's end replaced them
             "store_k": store_meta["k"] if from_store else None,
             "teacher_val_loss": teacher_val_loss, "teacher_digest": teacher_digest, "tokenizer": data_tokenizer,
             "data": data_meta.get("data"), "stop_ids": source_stops, "generation": generation, "rng": rngs,
             "trained_context": trained_context}
    save_training_checkpoint(model, [optimizer], small, out_dir, sharded_checkpoint)


# -----------------------------------------------------------------------------
# writing the teacher's top-k store (topk_write=True): every train window once, in groups of
# batch_size windows dealt out to the processes. A group's rows reach the disk before its byte in
# done.bin does, so a killed write resumes where it stopped, redoing at most the groups in flight;
# a group is always one forward of the same windows, so a resumed write equals a straight one.


def group_windows(groups):
    # windows in each group: batch_size, fewer in the last one
    groups = np.asarray(groups)
    return np.minimum((groups + 1) * batch_size, n_windows["train"]) - groups * batch_size


def write_topk():
    global store_meta
    n_groups = math.ceil(n_windows["train"] / batch_size)
    done_path = os.path.join(teacher_topk_dir, "done.bin")
    if master_process and store_meta is None:  # a new store: its files at full size, then its meta
        store_meta = {**store_spec, "n_windows": n_windows["train"], "windows_done": 0, "teacher_val_loss": None,
                      "complete": False, "rest": True}
        for m in store_memmaps("w+"):
            if m is not None:
                m.flush()
        np.zeros(n_groups, np.uint8).tofile(done_path)
        write_store_meta()
    dist.barrier()
    with open(store_meta_path) as f:
        store_meta = json.load(f)
    # written with the progress (a resumed old store's too): what a student from it needs of its teacher
    store_meta.update(stop_ids=teacher_stops, teacher_tokenizers=tokenizers_of("teacher_init"))
    todo = np.flatnonzero(np.fromfile(done_path, dtype=np.uint8) == 0)
    dist.barrier()  # every process has read done.bin before any writes to it, so all deal the same groups
    n_rounds = math.ceil(len(todo) / world_size)
    deal = np.full(n_rounds * world_size, -1)  # -1: an idle turn, still one forward (FSDP's is a collective)
    deal[:len(todo)] = todo
    deal = deal.reshape(n_rounds, world_size)
    k, ids_dtype = store_meta["k"], np.dtype(store_meta["ids_dtype"])
    pbar = tqdm(total=n_windows["train"], initial=n_windows["train"] - int(group_windows(todo).sum()), unit="window",
                desc=f"teacher top-{k}", dynamic_ncols=True, disable=not master_process)
    for groups in deal:
        g = int(groups[rank])
        windows = torch.full((batch_size,), -1)
        if g >= 0:
            windows[:group_windows(g)] = torch.arange(g * batch_size, g * batch_size + group_windows(g))
        x, _, pos = get_batch("train", windows)
        with torch.no_grad():
            ht = teacher.hidden(x, pos).flatten(0, 1)  # (B*T, Ct)
            tops, rests = [], []
            for c in range(0, ht.shape[0], chunk_tokens):
                lp = F.log_softmax(teacher.output(ht[c: c + chunk_tokens]).float()[:, :n_vocab] / kd_temperature, -1)
                tops.append(lp.topk(k))
                rests.append(lp.scatter(-1, tops[-1].indices, -math.inf).logsumexp(-1))  # the tail's mass, in float32
        if g >= 0:
            n = int(group_windows(g)) * block_size
            rows = slice(g * batch_size * block_size, g * batch_size * block_size + n)
            ids, logp, rest = store_memmaps("r+")
            ids[rows] = torch.cat([t.indices for t in tops])[:n].cpu().numpy().astype(ids_dtype)
            logp[rows] = torch.cat([t.values for t in tops])[:n].half().cpu().numpy()
            if rest is not None:  # (a store begun before it was written goes on without it)
                rest[rows] = torch.cat(rests)[:n].cpu().numpy()
            for m in (ids, logp, rest):
                if m is not None:
                    m.flush()
            done = np.memmap(done_path, dtype=np.uint8, mode="r+")
            done[g] = 1
            done.flush()
        pbar.update(int(group_windows(groups[groups >= 0]).sum()))
        if master_process:  # progress for a reader of meta.json; done.bin is what a resume trusts
            done = np.fromfile(done_path, dtype=np.uint8)
            store_meta["windows_done"] = int(group_windows(np.flatnonzero(done)).sum())
            write_store_meta()
    pbar.close()
    dist.barrier()
    if not np.fromfile(done_path, dtype=np.uint8).all():  # cannot happen unless another writer shares the store
        raise RuntimeError(f"{done_path} still has unwritten groups after a full pass; rerun the write")
    teacher_val_loss = evaluate(teacher, full=True)
    if master_process:
        store_meta.update(windows_done=n_windows["train"], teacher_val_loss=teacher_val_loss, complete=True)
        write_store_meta()  # last: only now may a training run read the store
        per_token = k * (ids_dtype.itemsize + 2)
        print(f"wrote {teacher_topk_dir}: top-{k} of {n_windows['train'] * block_size:,} tokens at temperature "
              f"{kd_temperature}, {per_token} bytes per token ({per_token * n_windows['train'] * block_size / 2 ** 20:,.1f} MiB); "
              f"teacher val loss {teacher_val_loss:.4f}")


if topk_write:
    write_topk()
    dist.destroy_process_group()
    sys.exit(0)

def _json_or_none(line):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


log_file = None
if master_process:
    # checkpoint.py: an earlier run's exports, not this one's, and a killed run's temp files if out_dir is locked
    # (a store's teacher, though not read, is kept as an input is)
    remove_earlier_outputs(out_dir, (*inputs, teacher_init), locked=dir_lock is not None and not topk_write)
    if init_from != "resume":  # an earlier run's checkpoint: set aside, never taken for this run's
        set_aside_checkpoint(out_dir, inputs)
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
# a KD step costs the student's training FLOPs plus one teacher forward (a third of its training FLOPs)
# the student's (LoRA: its frozen base, and 6 per adapter weight), and the teacher's forward
flops_token = (flops_per_token(model_args, block_size, frozen=bool(lora_rank))
               + 6 * sum(p.numel() for n, p in model.named_parameters() if n.endswith(("lora_a", "lora_b")))
               + (flops_per_token(teacher_args, block_size) / 3 if teacher else 0))
peak, peak_source = (peak_flops_per_device, "given") if peak_flops_per_device else peak_flops(device_type, ptdtype)
peak_retimed = False
if teacher_val_loss is None:  # once per run: a resumed run has it from its checkpoint, a store from its writing
    teacher_val_loss = store_meta["teacher_val_loss"] if from_store else evaluate(teacher, full=True)
    log({"iter": iter_num, "teacher_val_loss": teacher_val_loss})
if master_process:
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    teacher_desc = f"top-{store_meta['k']} store {teacher_topk_dir}" if from_store else f"{sum(p.numel() for p in teacher.parameters()):,}"
    print(f"student {sum(p.numel() for p in model.parameters()):,} parameters ({n_train:,} trained), "
          f"teacher {teacher_desc}; teacher val loss {teacher_val_loss:.4f}")
    print(f"{flops_token / 1e6:.1f} MFLOPs per token, peak {peak / 1e12:.3g} TFLOP/s per device ({peak_source})")
profiler = nullcontext()
if profile:
    profiler = torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=profile_wait, warmup=profile_warmup, active=profile_active, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(os.path.join(out_dir, f"trace_rank{rank}.json")),
        profile_memory=True, record_shapes=True)
offload_ctx = torch.autograd.graph.save_on_cpu(pin_memory=True) if activation_offloading else nullcontext()
set_fake_quant(model, fake_quant_on(iter_num))
if master_process and quant_bits is not None:
    print(f"fake quant ({quantizer}, group {group_size}) {'on' if fake_quant_on(iter_num) else 'off until step ' + str(fake_quant_after_n_steps)}")


def frozen_by_rounding(p, step):
    """(elements of bfloat16 p that a step this size leaves as they are, elements): rounding to the
    nearest bfloat16 undoes a change below half the spacing there, 2^(floor(log2 |p|) - 8) (frexp's
    exponent is floor(log2 |p|) + 1)."""
    x = p.detach().to_local().float().abs()
    frozen = (x > 0) & (torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 9) > step)
    return torch.stack([frozen.sum().double(), torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)])


if param_dtype == torch.bfloat16 and iter_num < max_iters:
    # AdamW's step is at most about the learning rate: a weight whose bfloat16 spacing is twice that never moves
    counts = torch.stack([sum((frozen_by_rounding(p, learning_rate * g.get("lr_ratio", 1.0)) for p in g["params"]),
                              torch.zeros(2, dtype=torch.float64, device=device)) for g in groups])
    dist.all_reduce(counts)
    names = ("adapters" if lora_rank else "weight matrices", "norms", "learned scales")
    shares = {name: f / n for name, (f, n) in zip(names, counts.tolist()) if n}
    if said := [f"{s:.0%} of the {name}" for name, s in shares.items() if s >= 0.01]:
        line = (f"dtype=bfloat16 without mixed_precision: a step of learning_rate={learning_rate:g} (times a group's lr "
                f"ratio; AdamW's steps are at most about that) is below half of bfloat16's spacing for {', '.join(said)}, "
                f"which rounding then leaves as they are; mixed_precision=True keeps fp32 master weights")
        if shares.get(names[0], 0) >= 0.5:
            fail(line)
        if master_process:
            print(f"warning: {line}")

pbar = tqdm(total=max_iters, initial=iter_num, desc="distill", dynamic_ncols=True,
            disable=not master_process or iter_num >= max_iters)
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
        (step, why), what = divmod(first, 4), {1: "the cross-entropy with the labels", 2: "the KD term", 3: "the gradient norm"}
        kept = f"{out_dir} keeps the checkpoint of step {saved_iter}" if saved_iter is not None else "no checkpoint was written"
        hint = (f"check the teacher ({teacher_topk_dir or teacher_init})" if why == 2 else "lower learning_rate or grad_clip"
                + ("" if ptdtype == torch.float32 else ", or train in float32 to see whether the precision is the cause"))
        if master_process:
            pbar.close()
            print(f"error: step {step}: {what[why]} is not finite; stopped, and {kept}; {hint}", file=sys.stderr, flush=True)
        dist.barrier()  # rank 0's line out first: torchrun stops every rank at the first exit
        sys.exit(2)


def mix(ce, kd):
    """The trained loss: kd_ratio 0 is the labels' alone, not 0 times a KD term that may be inf or nan."""
    return ce if kd_ratio == 0 else (1 - kd_ratio) * ce + kd_ratio * kd


def check_gradients(step_loss):
    """Stops every rank, in one line, when the run's first step left a trainable weight without a
    gradient, or with one zero everywhere in a finite step with a loss: AdamW would pass over the
    first and move the second by weight decay alone, without a word, and only part of the model
    would train (compiled by torch 2.11, an in-place fake quant zeroed them all).
    (Learned scales get none while fake quant is off; a LoRA A matrix gets a zero one while its B
    is still zero, as B starts.)"""
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
    zero = [n for (n, _), c in zip(named, counts[len(named):]) if c == 0 and n not in none and not n.endswith("lora_a")]
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


if ema_decay and init_from == "resume" and iter_num >= max_iters and not ckpt_averaged:
    # no step left to take: the run ends here, with the average its last step would have put in place
    torch._foreach_copy_(*weight_averages()[::-1])
    if master_process:
        print(f"step {iter_num}: no step left to take (max_iters={max_iters}): weights replaced by their running average "
              f"(ema_decay={ema_decay})")
    log({"iter": iter_num, "event": "weights_averaged"})

with profiler as prof:
    while iter_num < max_iters:
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
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_ratio", 1.0)

        batches = train_batches(iter_num)
        # normalize by the unmasked tokens of the whole step, over every micro-batch and rank, so
        # the gradient does not depend on how the global batch is split; FSDP averages over ranks,
        # hence the world_size factor
        n_tokens = sum((y != IGNORE_INDEX).sum() for _, y, _, _ in batches)
        dist.all_reduce(n_tokens)
        n_tokens.clamp_(min=1)  # a step whose every target is masked contributes nothing, not NaN
        ce_sum, kd_sum = torch.zeros((), device=device), torch.zeros((), device=device)
        for micro, (x, y, pos, topk) in enumerate(batches):
            if accumulate_unsharded:  # reduce once per step; else each micro-batch's gradient is reduce-scattered
                model.set_requires_gradient_sync(micro == len(batches) - 1)
            with offload_ctx:
                ce, kd = distill_loss(x, y, pos, topk)
            mix(ce, kd).mul(world_size / n_tokens).backward()
            ce_sum, kd_sum = ce_sum + ce.detach(), kd_sum + kd.detach()
        if iter_num == start_iter:
            check_gradients(mix(ce_sum, kd_sum))
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if ema_decay:
            with torch.no_grad():
                averages, weights = weight_averages()
                torch._foreach_lerp_(averages, weights, 1.0 - ema_decay)
                if iter_num == max_iters:  # the end: the average is the student from here on
                    torch._foreach_copy_(weights, averages)
                    if master_process:
                        pbar.write(f"step {iter_num}: weights replaced by their running average (ema_decay={ema_decay})")
                    log({"iter": iter_num, "event": "weights_averaged"})
        # this step's verdict, kept on the device (no sync): 0 finite, 1 the CE, 2 the KD term (unless
        # kd_ratio is 0: then it is only logged), 3 the gradient
        verdict = torch.where(ce_sum.isfinite(), torch.where(kd_sum.isfinite() | (kd_ratio == 0),
                                                             torch.where(grad_norm.to_local().isfinite(), 0, 3), 2), 1)
        bad_step = torch.where((bad_step == NO_BAD_STEP) & (verdict > 0), iter_num * 4 + verdict, bad_step)
        pbar.update(1)
        if profile:
            prof.step()

        if iter_num % log_interval == 0 or iter_num == max_iters:
            check_finite()
            sums = torch.stack((ce_sum, kd_sum))
            dist.all_reduce(sums)
            class_loss, kd_loss_val = (sums / n_tokens).tolist()  # a log step's host sync, with check_finite's
            loss_val = mix(class_loss, kd_loss_val)
            tps = tokens_per_iter * (iter_num - last_log_iter) / (time.perf_counter() - t0)
            mfu = flops_token * tps / world_size / peak
            if mfu > 1 and not peak_flops_per_device:  # the peak was timed in a busy moment: time it again, once
                if not peak_retimed:
                    peak, peak_retimed = max(peak, peak_flops(device_type, ptdtype)[0]), True
                peak = max(peak, flops_token * tps / world_size)  # a rate the run reached is one the machine has
                mfu = flops_token * tps / world_size / peak
            t0, last_log_iter = time.perf_counter(), iter_num  # after the peak's timing, which is no training
            record = {"iter": iter_num, "loss": loss_val, "class_loss": class_loss, "kd_loss": kd_loss_val, "lr": lr,
                      "epoch": (iter_num - 1) // steps_per_epoch,
                      "grad_norm": grad_norm.full_tensor().item(),  # FSDP's gradients are DTensors, and so is their norm
                      "tokens_per_sec": tps, "tokens_per_sec_per_device": tps / world_size,
                      "mfu": mfu, "peak_flops": peak, "peak_mem_gib": peak_memory_gib(), "fake_quant": fake_quant_on(iter_num - 1)}
            log(record)
            pbar.set_postfix(loss=f"{loss_val:.4f}", ce=f"{class_loss:.4f}", kd=f"{kd_loss_val:.4f}",
                             tok_s=f"{tps:,.0f}", mfu=f"{mfu:.0%}")
        evaluating = iter_num % eval_interval == 0 or iter_num == max_iters
        saving = iter_num % ckpt_interval == 0 or iter_num == max_iters
        if (evaluating or saving) and device_type == "cuda":
            torch.cuda.synchronize()  # the step's queued work is training time, not the pause's
        t_pause = time.perf_counter()  # evaluation and checkpoints are not training time
        if evaluating:
            val_loss = evaluate(model, it=iter_num)
            log({"iter": iter_num, "val_loss": val_loss, "fake_quant": fake_quant_on(iter_num - 1)})
            if master_process:
                pbar.write(f"step {iter_num}: val loss {val_loss:.4f} (teacher {teacher_val_loss:.4f})")
        if saving:
            check_finite()
            save_checkpoint()
            saved_iter = iter_num
        t0 += time.perf_counter() - t_pause
pbar.close()

# -----------------------------------------------------------------------------
# the end: the student's full-precision (and quantized) validation loss on the whole split,
# the merged student, the adapters and exports saved
set_fake_quant(model, False)
fp_val_loss = evaluate(model, full=True)
summary = {"iter": iter_num, "fp_val_loss": fp_val_loss, "fp_ppl": math.exp(fp_val_loss),
           "teacher_val_loss": teacher_val_loss, "quant_val_loss": None}
del optimizer, params, scales, groups  # make room: rank 0 gathers the whole student
state = full_state_dict(model)  # rank 0 alone ends up with it, in host memory
merged_args = ModelArgs(**{**vars(model_args), "lora_rank": 0})
if master_process:
    cpu_state = {k: v.cpu() for k, v in weights_only(state).items()}
    merged = merge_lora(cpu_state, model_args) if lora_rank else cpu_state
    if lora_rank:
        save_adapter(adapter_state_dict(cpu_state), model_args, os.path.join(out_dir, "adapter"))
    if not save_adapter_only:
        atomic_save({"model": merged, "model_args": vars(merged_args).copy(), "iter_num": iter_num, "config": config,
                     "tokenizer": data_tokenizer, "stop_ids": source_stops, "generation": generation,
                     "trained_context": trained_context}, os.path.join(out_dir, "model.pt"))
    tokenizer_files = [os.path.join(out_dir, f) for f in (data_tokenizer or {}).get("files", [])]
    provenance = {"tokenizer": data_tokenizer, "data": data_meta.get("data"), "iter_num": iter_num, "config": config,
                  "stop_ids": source_stops, "generation": generation}
    if export_format == "meta":
        export_meta(merged, merged_args, os.path.join(out_dir, "export_meta"), tokenizer_files, provenance)
    elif export_format == "hf":
        export_hf(merged, merged_args, os.path.join(out_dir, "export_hf"), tokenizer_files, data_meta.get("bos_id"),
                  stop_ids(data_meta, source_stops), provenance, generation)
if quant_bits is not None:
    # Conversion runs on rank 0 alone: torchao's quantized tensors are not shardable by FSDP, and a
    # copy converted on every rank is that many times the work and the memory. Rank 0 converts in
    # the compute dtype on its device and evaluates every window of the split; the others wait on a
    # CPU (gloo) group whose timeout outlasts that. The memory arithmetic is qat_train.py's.
    del model, teacher
    wait_group = dist.new_group(backend="gloo", timeout=timedelta(hours=6))
    # QAD only if the student was trained under fake quant: in this run's last step, or (no step
    # taken here) in the resumed checkpoint's; else the same scheme is plain rounding (PTQ)
    qad_trained = fake_quant_on(iter_num - 1) if iter_num > start_iter else ckpt_fake_quant
    result = [None, None]  # the converted model's loss; its export's, rounded again (below)
    if master_process:
        if range_learning and export_format in ("hf", "meta") and qad_trained:
            # the export holds the unquantized weights, which a tool quantizing them rounds on max-based
            # scales, not on the learned ones: another model, scored so that it is never shipped unaware
            # (first, and freed at once: one converted model at a time)
            result[1] = convert_and_evaluate(state, after_qad=False)[0]
        result[0], qmodel = convert_and_evaluate(state, after_qad=qad_trained)
        del state
    dist.broadcast_object_list(result, src=0, group=wait_group)
    quant_val_loss = result[0]
    summary.update(quant_val_loss=quant_val_loss, quant_ppl=math.exp(quant_val_loss), method="qad" if qad_trained else "ptq",
                   quantizer=quantizer, group_size=group_size, **{"export_ptq_val_loss": result[1]} if result[1] is not None else {})
    if master_process:
        atomic_save({"model": qmodel.state_dict(), "model_args": vars(model_args).copy(), "quantizer": quantizer,
                     "group_size": group_size, "quantize_embedding": quantize_embedding, "quant_skip": quant_skip,
                     "range_learning": range_learning, "iter_num": iter_num, "config": config, "tokenizer": data_tokenizer,
                     "stop_ids": source_stops, "trained_context": trained_context}, os.path.join(out_dir, "quantized.pt"))
        if export_format == "pte":  # the converted model as an ExecuTorch program, for CPUs and phones
            pte = os.path.join(out_dir, "model.pte")
            print(f"exported: {pte_summary(pte, model_args, export_executorch(qmodel.to('cpu'), pte))}")
log(summary)
if master_process:
    gap = f"  (teacher {teacher_val_loss:.4f})"
    print(f"\nstep {iter_num}  student full precision: val loss {fp_val_loss:.4f}  ppl {math.exp(fp_val_loss):.2f}{gap}")
    if quant_bits is not None:
        q = summary["quant_val_loss"]
        print(f"{summary['method'].upper()} {quantizer} g{group_size}: val loss {q:.4f}  ppl {math.exp(q):.2f}  "
              f"({100 * (math.exp(q) / math.exp(fp_val_loss) - 1):+.2f}% ppl)  -> {os.path.join(out_dir, 'quantized.pt')}")
    if "export_ptq_val_loss" in summary:
        q = summary["export_ptq_val_loss"]
        print(f"export_{export_format}/ holds the unquantized weights; the scales learned for them are in quantized.pt alone, and "
              f"a tool that quantizes the export again rounds on max-based ones: PTQ {quantizer} g{group_size} of it: val loss "
              f"{q:.4f}  ppl {math.exp(q):.2f}")
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
