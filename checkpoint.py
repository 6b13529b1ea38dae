"""
Checkpoint formats in and out of model.py's Transformer:

- nanotune's own ckpt.pt (one dict: model, model_args, optimizer, ...), written by the scripts;
- Meta directories: params.json + consolidated.NN.pth (Llama 2, Llama 3.x, and Mistral's own
  params.json with head_dim/hidden_dim/sliding_window);
- Hugging Face directories: config.json + model*.safetensors (or pytorch_model*.bin) of a
  LlamaForCausalLM or MistralForCausalLM, config in transformers 4.x style (top-level rope_theta,
  rope_scaling) or 5.x style (rope_parameters);
- PEFT adapter directories for LoRA weights.

Every config key that changes what the model computes is either implemented or refused with one
line naming it, before any tensor is read: a model loaded approximately gives numbers that look
right and are not. Exports write a directory atomically (a temp directory renamed into place).
"""

import fcntl
import hashlib
import json
import os
import pickle
import re
import shutil
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict
from glob import glob

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from model import LORA_TARGETS, ModelArgs, Transformer, adapter_state_dict, merge_lora, weights_only

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
# Meta's use_scaled_rope has these values built into its code (factor, low, high, original context);
# Llama 3.2 1B/3B need factor 32 (see _load_meta)
META_ROPE_SCALING = (8.0, 1.0, 4.0, 8192)
META_ROPE_KEYS = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len")
# params.json keys read here: Meta's, Mistral's, and nanotune's own for scalings Meta's code cannot
# express; max_batch_size only sizes Meta's KV cache. Any other key is refused.
META_KEYS = {*META_PARAMS, "use_scaled_rope", "max_seq_len", "max_batch_size", "head_dim", "hidden_dim",
             "sliding_window", *META_ROPE_KEYS}
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
# transformers' defaults for keys a config.json may leave out
HF_DEFAULTS = {"llama": dict(num_key_value_heads=None, max_position_embeddings=2048, sliding_window=None),
               "mistral": dict(num_key_value_heads=8, max_position_embeddings=4096 * 32, sliding_window=4096)}
# config.json keys that change what the model computes, each with the one value implemented here
# (absent means transformers' default, which is that value). pretraining_tp is not among them:
# transformers 4.x only split the same matmuls into slices with it, and 5.x ignores it.
HF_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "partial_rotary_factor": 1.0,
            "attention_dropout": 0.0,  # nanotune's attention has no dropout: training would differ
            "quantization_config": None, "layer_types": None, "num_local_experts": None, "num_experts": None,
            "num_experts_per_tok": None, "n_routed_experts": None, "moe_intermediate_size": None,
            # the weights file transformers 5 loads instead of model.safetensors; read here would be the other one
            "transformers_weights": None}
HF_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
NOT_A_CHECKPOINT = ("init_from={!r} is neither a nanotune checkpoint nor a Meta (params.json) or Hugging Face "
                    "(config.json) directory")


def load_checkpoint(path, weights=True):
    """(ModelArgs, state dict) from a nanotune checkpoint (a file, or a directory holding ckpt.pt),
    a Meta directory (params.json + consolidated.NN.pth) or a Hugging Face Llama/Mistral directory
    (config.json + model*.safetensors or pytorch_model*.bin). Tensors stay memory-mapped where
    they can: load them with load_state_dict(assign=True) to avoid a copy. weights=False gives
    meta tensors (shapes only): what every process but the one that broadcasts the weights needs,
    without merging shards or permuting in memory. A tied model's state dict holds output.weight
    as the same tensor as tok_embeddings.weight, as a tied Transformer's state_dict() does; loaded
    with assign=True, they become two Parameters over one storage: tie them again
    (model.output.weight = model.tok_embeddings.weight) before training such a model."""
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, "ckpt.pt")):
        return _load_nanotune(path if os.path.isfile(path) else os.path.join(path, "ckpt.pt"))
    if os.path.isfile(os.path.join(path, "params.json")) and glob(os.path.join(path, "consolidated.*.pth")):
        return _load_meta(path, weights)
    if os.path.isfile(os.path.join(path, "config.json")):
        return _load_hf(path, weights)
    if os.path.isfile(os.path.join(path, "params.json")):
        raise ValueError(f"{path} has a params.json but no consolidated.NN.pth weights (Mistral's consolidated.safetensors "
                         f"is not read: give its Hugging Face directory)")
    if d := sharded_dir(path):  # the training scripts resume these; everything else reads one file
        raise ValueError(f"{path!r} is a sharded training checkpoint; convert it with {TO_SINGLE_FILE.format(d)} and give {d + '.pt'!r}")
    raise ValueError(NOT_A_CHECKPOINT.format(path))


def checkpoint_digest(path, samples=64, chunk=1 << 16):
    """A sha256 over the checkpoint at path (a file, or each file of a directory): names, sizes and
    `samples` reads of `chunk` bytes spread evenly over each file. Another training of the same
    shape differs in every weight, so in the reads; 4 MiB a file keeps it quick for an 8B model. A
    change confined to a few rows (one layer retrained, new tokens' embeddings) can fall between the
    reads and go unseen."""
    h = hashlib.sha256()
    if os.path.isfile(os.path.join(path, "ckpt.pt")):  # a run's out_dir: its checkpoint, not the logs and outputs beside it
        path = os.path.join(path, "ckpt.pt")
    files = [path] if os.path.isfile(path) else sorted(f for f in glob(os.path.join(path, "**"), recursive=True) if os.path.isfile(f))
    for file in files:
        size = os.path.getsize(file)
        h.update(f"{os.path.relpath(file, path)}:{size}".encode())
        with open(file, "rb") as f:
            if size <= samples * chunk:
                h.update(f.read())
                continue
            for i in range(samples):
                f.seek(i * (size - chunk) // (samples - 1))
                h.update(f.read(chunk))
    return h.hexdigest()


def load_provenance(path):
    """The provenance dict an export wrote to nanotune.json, or None for directories without one."""
    file = os.path.join(path, "nanotune.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)


def source_stop_ids(path, ckpt):
    """The ids a model stops generating at, as its source says beyond the tokenizer's EOS: an HF
    directory's generation_config.json (or config.json) eos_token_id, which for an Instruct model
    lists several (Llama 3.1: end of text, of a tool call, of a turn); or what a nanotune
    checkpoint `ckpt`, or export (its nanotune.json), carried on from its own source (a checkpoint
    from before they were recorded: its init_from's). [] when none says."""
    if ckpt:
        source = ckpt.get("config", {}).get("init_from")
        return list(ckpt["stop_ids"]) if "stop_ids" in ckpt else source_stop_ids(source, None) if source else []
    if "stop_ids" in (provenance := (load_provenance(path) if os.path.isdir(str(path)) else None) or {}):
        return list(provenance["stop_ids"])
    for name in ("generation_config.json", "config.json") if os.path.isdir(str(path)) else ():
        if os.path.isfile(file := os.path.join(path, name)):
            with open(file) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []


def source_generation(path, ckpt):
    """The source model's sampling defaults (do_sample, temperature, top_p: Llama 3.1 Instruct's
    0.6 and 0.9), which an export's generation_config.json keeps so that transformers and vLLM
    sample from it as from its source: an HF directory's generation_config.json less its token ids
    (the export writes those from the data), or what a nanotune checkpoint `ckpt`, or export,
    carried on from its own source. {} when none says."""
    if ckpt:
        source = ckpt.get("config", {}).get("init_from")
        return dict(ckpt["generation"]) if "generation" in ckpt else source_generation(source, None) if source else {}
    if not os.path.isdir(str(path)):
        return {}
    if "generation" in (provenance := load_provenance(path) or {}):
        return dict(provenance["generation"])
    if not os.path.isfile(file := os.path.join(path, "generation_config.json")):
        return {}
    with open(file) as f:
        return {k: v for k, v in json.load(f).items()
                if not k.endswith("token_id") and not k.startswith("_") and k != "transformers_version"}


def stop_ids(data_meta, source_ids):
    """An export's eos_token_id: the data's EOS, then the source model's stop ids, and for Llama 3's
    tiktoken tokenizer the end of a turn and of a tool call, where Meta's own code stops too; one
    id alone as an int, as transformers writes it."""
    ids = [data_meta["eos_id"]] if data_meta.get("eos_id") is not None else []
    if (data_meta.get("tokenizer") or {}).get("kind") == "tiktoken":
        from data_prep import LLAMA3_SPECIALS
        first = data_meta["vocab_size"] - len(LLAMA3_SPECIALS)
        ids += [first + LLAMA3_SPECIALS.index(t) for t in ("<|eom_id|>", "<|eot_id|>")]
    ids = list(dict.fromkeys(ids + list(source_ids)))
    return ids[0] if len(ids) == 1 else ids or None


def tokenizer_of(path, ckpt, data_kind=None):
    """The fingerprint of the tokenizer a model was trained with, where it says so: recorded in a
    nanotune checkpoint (`ckpt`, its loaded dict) or export, or the tokenizer file of an HF / Meta
    directory, of the data's kind first (HF directories often hold both)."""
    if ckpt or not os.path.isdir(path):
        return ckpt.get("tokenizer")
    if (provenance := load_provenance(path)) and provenance.get("tokenizer"):
        return provenance["tokenizer"]
    from data_prep import load_tokenizer  # data_prep is the tokenizers' home; only this reads them
    for name in sorted(("tokenizer.json", "tokenizer.model"), key=lambda n: n != ("tokenizer.json" if data_kind == "hf" else "tokenizer.model")):
        if os.path.isfile(os.path.join(path, name)):
            return load_tokenizer(os.path.join(path, name)).fingerprint()
    return None


# ---------------------------------------------------------------------------------------------
# Training checkpoints: out_dir/ckpt.pt, gathered on rank 0; or (sharded) out_dir/ckpt/, to
# which every rank writes its own shards with torch.distributed.checkpoint (DCP), the small
# things also in ckpt/state.pt. Either way a crash at any moment leaves the previous one loadable.

# one line that turns a sharded checkpoint into the single-file format every reader knows
TO_SINGLE_FILE = ("python -c \"from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                  "dcp_to_torch_save('{0}', '{0}.pt')\"")


def sharded_dir(path):
    """The sharded checkpoint `path` names (itself or its ckpt/), or None. ckpt.old/ is the previous
    one, left alone only by a crash between the two renames of a save."""
    for d in (path, os.path.join(path, "ckpt"), os.path.join(path, "ckpt.old")):
        if os.path.isfile(os.path.join(d, "state.pt")) and os.path.isfile(os.path.join(d, ".metadata")):
            return d
    return None


def lock_dir(path):
    """(the open lock file, None), or (None, the error): a POSIX lock on path/.lock, held while this
    process lives (the kernel lets go however it ends). A second run in the same directory, or a
    rank 0 that a killed torchrun left running, would write checkpoints and log lines between this
    run's; it is refused instead. A filesystem without locks gets a warning and no lock."""
    try:
        f = open(os.path.join(path, ".lock"), "a+")
    except OSError as e:
        return None, f"cannot write in {path} ({e.strerror}); give this run a directory it can write"
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        f.seek(0)
        return None, (f"{path} is in use by another run (process {f.read().strip() or '?'}); wait for it, stop it, "
                      f"or give this run another directory")
    except OSError as e:
        print(f"warning: {path} cannot be locked on this filesystem ({e.strerror}); nothing stops a second run there")
        return None, None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f, None


def leave_mark(path):
    """(name, None) of a new, empty file with a name of its own in directory path; or (None, the error)."""
    name = f".shared.{os.getpid()}.{time.time_ns()}"
    try:
        open(os.path.join(path, name), "x").close()
    except OSError as e:
        return None, f"cannot write in {path} ({e.strerror}); give this run a directory it can write"
    return name, None


def mark_wait():
    """The seconds sees_mark asks again for: NANOTUNE_SHARED_WAIT, default 90. Raises ValueError."""
    value = os.environ.get("NANOTUNE_SHARED_WAIT", "90")
    try:
        wait = float(value)
    except ValueError:
        wait = -1.0
    if not 0 <= wait <= 600:  # under the process group's timeout (30 min), which the others wait on
        raise ValueError(f"NANOTUNE_SHARED_WAIT={value!r} must be a number of seconds from 0 to 600")
    return wait


def sees_mark(path, name, wait):
    """Whether the file `name` (leave_mark's, on another node) is in directory path. An NFS client
    trusts a cached "no such file" (for path itself, made by rank 0 moments before, say) until the
    directory's attributes expire (acdirmax, 60 s by default), so a miss is asked again for `wait` seconds."""
    deadline = time.monotonic() + wait
    while not os.path.exists(os.path.join(path, name)):
        if time.monotonic() > deadline:
            return False
        time.sleep(1)
    return True


def ranks_not_sharing(path):
    """A collective: the ranks that do not see in directory path the file rank 0 leaves there (a
    directory local to each node, where every process must write into one). Raises ValueError, on
    every rank, if rank 0 cannot write there or NANOTUNE_SHARED_WAIT is not a wait."""
    wait = mark_wait()
    mark = [leave_mark(path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(mark, src=0)
    name, error = mark[0]
    if error:
        raise ValueError(error)
    seen_by = [None] * dist.get_world_size()
    dist.all_gather_object(seen_by, sees_mark(path, name, wait))
    if dist.get_rank() == 0:
        os.remove(os.path.join(path, name))
    return [r for r, seen in enumerate(seen_by) if not seen]


# what a finished run leaves in out_dir besides its checkpoint and log (either script's)
FINAL_OUTPUTS = ("quantized.pt", "model.pte", "export_hf", "export_meta", "model.pt", "adapter")


def remove_earlier_outputs(out_dir, inputs, locked):
    """Removes the FINAL_OUTPUTS an earlier run left in out_dir, which would sit beside this run's
    checkpoints as if made from them until this run writes its own (a resumed run's too: they were
    made at an earlier step). One that is, or holds, a path in `inputs` (this run's own) stays; a
    link is removed, not what it points to. So are the temp files and folders of a killed run's
    unfinished writes, when this run holds out_dir's lock (`locked`): else they may be another's."""
    inputs = {os.path.realpath(p) for p in inputs if p}

    def remove(path, why):
        if not any(_within(i, os.path.realpath(path)) for i in inputs):
            _remove(path)
            print(f"removed {path}: {why}")

    for name in FINAL_OUTPUTS:
        if os.path.lexists(path := os.path.join(out_dir, name)):
            remove(path, "an earlier run's output, not this one's")
    # what a killed run left half-written (a checkpoint's or an export's size, hidden or not):
    # NAME.tmp files and directories, and exports' .NAME.tmp* ones
    for entry in sorted(os.listdir(out_dir)) if locked else ():
        if any(entry == f"{n}.tmp" or entry.startswith(f".{n}.tmp") for n in FINAL_OUTPUTS + ("ckpt.pt", "ckpt", "log.jsonl")):
            remove(os.path.join(out_dir, entry), "an unfinished write of a run that was killed")


CHECKPOINT_NAMES = ("ckpt.pt", "ckpt", "ckpt.old")  # a single file, a sharded directory, and the one a save replaces


def set_aside_checkpoint(out_dir, inputs, move=True):
    """At a fresh start in out_dir: an earlier run's checkpoint there becomes NAME.prev until this run's
    first save replaces it. Else a crash before that save would leave it to be taken for this run's
    (init_from='resume' would continue the other run under this one's settings; sample.py would sample
    it). One that is, holds or is in a path of `inputs` (this run's init_from) stays; an input that is
    (or is in) a NAME.prev, which this run's first save removes, is refused (ValueError) first: alone,
    with move=False, on every rank before any work."""
    inputs = {os.path.realpath(p) for p in inputs if p}

    def holds_input(path):
        return any(_within(i, os.path.realpath(path)) for i in inputs)

    if prevs := [n + ".prev" for n in CHECKPOINT_NAMES if holds_input(os.path.join(out_dir, n + ".prev"))]:
        raise ValueError(f"this run reads {os.path.join(out_dir, prevs[0])}, an earlier run's checkpoint set aside, which "
                         f"its first checkpoint removes; copy it out of {out_dir}, or give this run another out_dir")
    for name in CHECKPOINT_NAMES if move else ():
        path = os.path.join(out_dir, name)
        if os.path.lexists(path) and not (holds_input(path) or any(_within(os.path.realpath(path), i) for i in inputs)):
            _remove(path + ".prev")
            os.replace(path, path + ".prev")
            print(f"{path} held an earlier run's checkpoint: moved to {name}.prev until this run saves its own")


def atomic_save(obj, path):
    # a crash mid-write leaves the previous file intact: write aside, flush to disk, then rename
    with open(path + ".tmp", "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


# how a step trains: a resume may change these (to train longer, say) when it says so, never by leaving
# one out; the learning rate's schedule (and the steps of the decay: lr_decay_iters, or max_iters), the
# optimizer's settings and the precision. A script checks those of them it has
SCHEDULE = ("learning_rate", "min_lr", "warmup_iters", "weight_decay", "beta1", "beta2", "grad_clip", "norm_lr_ratio",
            "range_lr_ratio", "optimizer_in_bwd", "dtype", "mixed_precision")


def scales_without_state(ckpt, path):
    """The learned scales (range_learning) of the checkpoint `ckpt` read from `path` that its
    optimizer holds no state for: a single file lists both; a sharded one's metadata names them."""
    if "optimizer" in ckpt:
        scales, held = [k for k in ckpt["model"] if k.endswith("learned_scale")], ckpt["optimizer"]["state"]
    elif d := sharded_dir(path):
        keys = dcp.FileSystemReader(d).read_metadata().state_dict_metadata
        scales = [k.removeprefix("model.") for k in keys if k.startswith("model.") and k.endswith("learned_scale")]
        held = {k.removeprefix("optimizer.state.").rsplit(".", 1)[0] for k in keys if k.startswith("optimizer.state.")}
    else:
        return []
    return [k for k in scales if k not in held]


def check_resume(ckpt, config, same, data_meta, path, script, asked=None):
    """Refuses (ValueError) to resume the checkpoint `ckpt` from `path` in another script than
    wrote it, with other values of the settings `same` than it was trained with, or on other data
    (data_prep's file fingerprints). With `asked` (the keys this run sets), the SCHEDULE settings
    may differ from the checkpoint's only where this run sets them (a default against the
    checkpoint's value is one the command and its config files leave out); returns a line naming
    the changes."""
    # checkpoints from before "script" was recorded: kd_train's alone carry teacher_init
    if (wrote := ckpt.get("script") or ("kd_train.py" if "teacher_init" in ckpt else "qat_train.py")) != script:
        raise ValueError(f"{path} was written by {wrote}, not {script}: resume it with {wrote}, or give this run "
                         f"another out_dir (init_from={path!r} starts from its weights)")
    if changed := {k: ckpt["config"][k] for k in same if k in ckpt["config"] and ckpt["config"][k] != config[k]}:
        raise ValueError(f"{path} was trained with {', '.join(f'{k}={v!r}' for k, v in changed.items())}; "
                         f"resume with the same settings or start a new out_dir")
    if ckpt.get("data") is None:  # hand-made data, before nanotune recorded the sizes of its files
        raise ValueError(f"{path} records nothing of the data it was trained on, so nothing shows that this run's data "
                         f"is that data; start from its weights instead: init_from={path!r}, with another out_dir")
    if ckpt["data"] != data_meta["data"]:
        raise ValueError(f"the data is not the data {path} was trained on (its files differ); "
                         f"resume with the same data_dir contents or start a new out_dir")
    if (not config.get("convert_only") and sharded_dir(path)
            and (was := ckpt["config"].get("optimizer_in_bwd", False)) != config.get("optimizer_in_bwd", False)):
        # one optimizer per parameter, or one for all: DCP maps neither layout onto the other
        raise ValueError(f"{sharded_dir(path)} holds the optimizer state of optimizer_in_bwd={was}, which a sharded "
                         f"checkpoint cannot hand to optimizer_in_bwd={not was}; resume with optimizer_in_bwd={was}")
    if not config.get("convert_only") and (missing := scales_without_state(ckpt, path)):
        d = sharded_dir(path)
        start = (f"convert it to one file with {TO_SINGLE_FILE.format(d)} and give init_from={d + '.pt'!r}" if d else
                 f"give init_from={path!r}")
        raise ValueError(f"{path} holds no optimizer state for its {len(missing)} learned scales ({missing[0]}, ...): "
                         f"nanotune before 97aaf67 wrote none before fake quant began. Resuming needs it; start from its "
                         f"weights instead: {start}, with another out_dir (the optimizer and the scales start afresh)")
    profiled = sum(config.get(f"profile_{k}", 0) for k in ("wait", "warmup", "active"))
    if config.get("profile") and not config.get("convert_only") and config["max_iters"] - ckpt["iter_num"] < profiled:
        # the profiler counts this process's steps, not the run's
        first = ckpt["iter_num"] + config["profile_wait"] + config["profile_warmup"]
        raise ValueError(f"profile=True records steps {first} to {ckpt['iter_num'] + profiled - 1} of a run resumed at step "
                         f"{ckpt['iter_num']} (its profile_wait, profile_warmup and profile_active count from there), past "
                         f"max_iters={config['max_iters']}: no trace would be written; raise max_iters or lower them")
    if asked is None:
        return ""
    theirs = ckpt["config"]
    was = {k: theirs[k] for k in SCHEDULE if k in config and theirs.get(k) is not None and theirs[k] != config[k]}
    # the decay's steps: lr_decay_iters, where either run sets it (not 0), else max_iters
    decay = "lr_decay_iters" if theirs.get("lr_decay_iters") or config["lr_decay_iters"] else "max_iters"
    if decay in theirs and (theirs.get("lr_decay_iters") or theirs["max_iters"]) != (config["lr_decay_iters"] or config["max_iters"]):
        was[decay] = theirs[decay]
    if unsaid := [k for k in was if k not in asked]:
        raise ValueError(f"{path} was trained with {', '.join(f'{k}={was[k]!r}' for k in unsaid)}, and this run has the "
                         f"default{'s' if len(unsaid) > 1 else ''} ({', '.join(f'{k}={config[k]!r}' for k in unsaid)}); "
                         f"give {'them' if len(unsaid) > 1 else 'it'}: the same to continue as it trained, another to change "
                         f"{'them' if len(unsaid) > 1 else 'it'} from the checkpoint's step")
    return "; ".join(f"{k} {v!r} -> {config[k]!r}" for k, v in was.items())


def save_training_checkpoint(model, optimizers, small, out_dir, sharded):
    """A collective: every rank calls it. `small` is what is not a tensor of model or optimizer
    (model_args, iter_num, config, ...). The other format's checkpoint is removed afterwards, and
    so is an earlier run's that set_aside_checkpoint kept."""
    master = dist.get_rank() == 0
    single, final, tmp, old = (os.path.join(out_dir, n) for n in ("ckpt.pt", "ckpt", "ckpt.tmp", "ckpt.old"))
    prevs = [os.path.join(out_dir, n + ".prev") for n in CHECKPOINT_NAMES]
    if not sharded:
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 alone ends up with the tensors
        state = {"model": get_model_state_dict(model, options=full),
                 "optimizer": get_optimizer_state_dict(model, optimizers, options=full)}
        if master:
            atomic_save({**state, **small}, single)
            for d in (final, old, *prevs):  # ckpt.old too: sharded_dir would otherwise pick it over this newer file
                _remove(d)
        return
    if master:
        shutil.rmtree(tmp, ignore_errors=True)  # a crash's half-written directory
    dist.barrier()
    # the small things go in too, so that dcp_to_torch_save turns the directory into a whole ckpt.pt;
    # DCP fsyncs each file it writes, and returns once rank 0 has written the index (.metadata)
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizers), **small},
             checkpoint_id=tmp)
    if master:  # with an id of its own: another save of the same step, config and seed is another checkpoint
        atomic_save({**small, "save_id": uuid.uuid4().hex}, os.path.join(tmp, "state.pt"))
        # a directory cannot replace another in one rename: the previous one steps aside to
        # ckpt.old, which sharded_dir reads if a crash comes between the two renames
        if os.path.isdir(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync(out_dir)  # a rename is durable once its directory is flushed
        for d in (old, *prevs):
            _remove(d)
        if os.path.exists(single):
            os.remove(single)


def load_sharded_checkpoint(model, optimizers, path, with_optimizer=True):
    """Every rank reads the pieces of its own shards from the sharded checkpoint at `path`,
    whatever number of processes wrote them (DCP reshards); the optimizer's state only to resume."""
    state = {"model": get_model_state_dict(model)}
    if with_optimizer:
        state["optimizer"] = get_optimizer_state_dict(model, optimizers)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if with_optimizer:
        set_optimizer_state_dict(model, optimizers, state["optimizer"])


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
    # scales learned by range_learning are training state, which the scripts take from the file
    # themselves: the model is its weights
    try:
        return ModelArgs.from_dict(ckpt["model_args"], strict=True), weights_only(ckpt["model"])
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


def _load_meta(path, weights=True):
    where = os.path.join(path, "params.json")
    with open(where) as f:
        params = json.load(f)
    unknown = sorted(params.keys() - META_KEYS)
    if unknown:
        raise ValueError(f"{where} has {unknown[0]}={params[unknown[0]]!r}, which nanotune does not implement")
    rope = {k: params.pop(k) for k in META_ROPE_KEYS if k in params}
    scaled = params.pop("use_scaled_rope", False)
    if rope and not scaled:
        raise ValueError(f"{where} has {sorted(rope)} without use_scaled_rope=true; add it or remove them")
    if "hidden_dim" in params and "rope_theta" not in params:
        # Mistral's code and Llama 2's default theta differently when the file leaves it out
        raise ValueError(f"{where} is in Mistral's layout but has no rope_theta; add the model's rope_theta")
    shards = [torch.load(f, mmap=True, weights_only=True, map_location="cpu")
              for f in sorted(glob(os.path.join(path, "consolidated.*.pth")))]
    # Meta's tied models (Llama 3.2 1B/3B) store output.weight as a copy of the embedding, and some
    # converters leave it out; either way they are loaded tied, so training keeps them tied. Models
    # that small are never split into shards.
    first = shards[0]
    tied = len(shards) == 1 and ("output.weight" not in first or _same(first["output.weight"], first.get("tok_embeddings.weight")))
    if tied:
        first.pop("output.weight", None)
    if scaled:
        # Meta's params.json names no factor, and its code hard-codes 8, right for Llama 3.1, 3.2 11B/90B
        # and 3.3; Llama 3.2 1B and 3B, the tied ones, were trained with 32 (their config.json, and
        # meta-llama/llama-models#241): loaded with 8, they degrade past 8k tokens with no error
        params.update({**dict(zip(META_ROPE_KEYS, META_ROPE_SCALING)), **({"rope_scaling_factor": 32.0} if tied else {}), **rope})
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
    hidden_dim = params.pop("hidden_dim", None)
    if "max_seq_len" not in params and "max_seq_len" in (provenance := load_provenance(path) or {}):
        params["max_seq_len"] = provenance["max_seq_len"]  # an export of ours; Meta's own leave it to the caller
    elif "max_seq_len" not in params and params.get("rope_theta") == 500000.0:
        # Llama 3's context, where the family says it: 8192, and 131072 from 3.1 on (scaled RoPE); an
        # export would otherwise tell transformers and vLLM the loader's default, 2048
        params["max_seq_len"] = 131072 if scaled else 8192
    elif "max_seq_len" not in params:
        # Llama 1 (2048), Llama 2 (4096), Code Llama (16384) and Mistral's files do not say it, nor
        # can they be told apart; a guess would train short or export a context the model lacks
        raise ValueError(f"{where} does not say the model's context length, and Meta's Llama 1/2 files cannot be "
                         f"told apart: write {{\"max_seq_len\": N}} to {os.path.join(path, 'nanotune.json')} (Llama 2: "
                         f"4096, Llama 1: 2048, Code Llama: 16384; Meta's own code refuses the key in params.json)")
    return _args_for(params, sd, where, hidden_dim), sd


def _same(a, b):
    # the first row settles it for untied models without reading the whole embedding
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.data_ptr() == b.data_ptr() or (torch.equal(a[:1], b[:1]) and torch.equal(a, b))


def _load_hf(path, weights=True):
    where = os.path.join(path, "config.json")
    with open(where) as f:
        cfg = json.load(f)
    params = _hf_params(cfg, where)
    hf = {}
    for file in _hf_weight_files(path, say=weights):
        if file.endswith(".safetensors"):
            part = load_file(file)  # memory-mapped
        else:
            part = torch.load(file, mmap=True, weights_only=True, map_location="cpu")
        if twice := hf.keys() & part.keys():
            raise ValueError(f"{file} holds {len(twice)} tensors that an earlier weight file of {path} holds too "
                             f"(e.g. {sorted(twice)[0]}): the directory mixes two saves")
        hf.update(part)
    if not weights:
        hf = _shapes_only(hf)
    sd = hf_to_meta(hf, ModelArgs.from_dict(params))
    if params["tie_embeddings"]:
        # an lm_head.weight beside a tied config: transformers 4 drops it, 5 keeps it untied if it differs
        if weights and "output.weight" in sd and not _same(sd["output.weight"], sd["tok_embeddings.weight"]):
            raise ValueError(f"{where} has tie_word_embeddings true, yet the weights hold an lm_head.weight unlike the "
                             f"embedding, which transformers 4 and 5 load differently; set tie_word_embeddings to what "
                             f"the weights mean")
        sd.pop("output.weight", None)
    elif "output.weight" not in sd:
        raise ValueError(f"{where} has tie_word_embeddings false but the weights have no lm_head.weight")
    return _args_for(params, sd, where, cfg["intermediate_size"], hf_names=True), sd


def _hf_params(cfg, where):
    """ModelArgs settings from a transformers config.json, refusing whatever is not implemented."""
    def refuse(key, value, why):
        raise ValueError(f"{where} has {key}={value!r}, {why}")

    model_type = cfg.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        refuse("model_type", model_type, f"and nanotune implements only {sorted(HF_ARCHITECTURES)}")
    architecture = HF_ARCHITECTURES[model_type]
    if any(a != architecture for a in cfg.get("architectures") or ()):
        refuse("architectures", cfg["architectures"], f"and nanotune implements only {architecture} for {model_type}")
    for key, value in HF_FIXED.items():
        if cfg.get(key, value) != value:
            refuse(key, cfg[key], "which nanotune does not implement" + ("" if value is None else f" (only {value!r})"))
    for key in HF_REQUIRED:
        if key not in cfg:
            raise ValueError(f"{where} has no {key}")
    cfg = {**HF_DEFAULTS[model_type], **cfg}
    if model_type == "llama" and cfg["sliding_window"] is not None:
        refuse("sliding_window", cfg["sliding_window"], "which LlamaForCausalLM ignores; for a sliding window "
               "set model_type 'mistral', else remove it")
    return dict(dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                n_kv_heads=cfg["num_key_value_heads"], head_dim=cfg.get("head_dim"), vocab_size=cfg["vocab_size"],
                norm_eps=cfg.get("rms_norm_eps", 1e-6), max_seq_len=cfg["max_position_embeddings"],
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), sliding_window=cfg["sliding_window"],
                **_hf_rope(cfg, where))


def _hf_rope(cfg, where):
    # transformers 4.x: top-level rope_theta and rope_scaling (whose type key was once "type");
    # 5.x: everything in rope_parameters. A rope_scaling wins over rope_parameters, as in transformers.
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(key) or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{where} has {key} per layer type, which nanotune does not implement")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where} has {key}.partial_rotary_factor={rope['partial_rotary_factor']!r}, "
                         f"which nanotune does not implement (only 1.0)")
    if rope_type == "default":
        return dict(rope_theta=theta)
    if rope_type != "llama3":
        raise ValueError(f"{where} has {key}.rope_type={rope_type!r}, which nanotune does not implement "
                         f"(only 'default' and 'llama3')")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in rope]
    if missing:
        raise ValueError(f"{where} has rope_type 'llama3' without {', '.join(missing)} in {key}")
    original = cfg.get("original_max_position_embeddings",
                       rope.get("original_max_position_embeddings", cfg["max_position_embeddings"]))
    return dict(rope_theta=theta, rope_scaling_factor=rope["factor"], rope_low_freq_factor=rope["low_freq_factor"],
                rope_high_freq_factor=rope["high_freq_factor"], rope_original_max_seq_len=original)


def _hf_weight_files(path, say=False):
    """The files transformers reads, in its order: model.safetensors, else the files of
    model.safetensors.index.json, else pytorch_model.bin, else pytorch_model.bin.index.json's. A
    single file wins over an index beside it (a stale shard set left by an older save is not read),
    and shards without their index are refused, as transformers refuses them."""
    incomplete = None  # repositories often ship both formats' indexes; a download may hold one format's files
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if os.path.isfile(os.path.join(path, single)):
            files = [os.path.join(path, single)]
        elif os.path.isfile(index := os.path.join(path, index)):
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
            if missing := [n for n in names if not os.path.isfile(os.path.join(path, n))]:
                incomplete = incomplete or ValueError(f"{index} names {len(missing)} weight files that are not in {path} "
                                                      f"(e.g. {missing[0]}): finish the download")
                continue
            files = [os.path.join(path, n) for n in names]
        else:
            continue
        if incomplete and say:
            print(f"note: {incomplete}; reading {os.path.basename(files[0])} instead")
        return files
    if incomplete:
        raise incomplete
    # model*, not *.safetensors: Mistral's directories also hold consolidated.safetensors in Meta's names
    if shards := sorted(glob(os.path.join(path, "model*.safetensors")) + glob(os.path.join(path, "pytorch_model*.bin"))):
        raise ValueError(f"{path} holds weight shards ({os.path.basename(shards[0])}, ...) without the index that says "
                         f"which belong to the model (model.safetensors.index.json or pytorch_model.bin.index.json): "
                         f"copy it from the checkpoint's source")
    raise ValueError(f"{path} has a config.json but no model*.safetensors or pytorch_model*.bin files")


def _args_for(params, sd, where, hidden_dim=None, hf_names=False):
    """ModelArgs that fit the weights, or one line saying where they do not: the SwiGLU size comes
    from w1's shape (HF stores only the number; Meta a rounding rule that need not match it), a
    missing output means tied, and every tensor must have the shape the args give it."""
    def name(k):  # as the user's files call it
        return _rename(k.removesuffix(".weight"), HF_NAMES) + ".weight" if hf_names else k

    w1 = sd.get("layers.0.feed_forward.w1.weight")
    if w1 is None:
        raise ValueError(f"the weights beside {where} have no layers.0 feed-forward (w1, gate_proj) weight")
    if hidden_dim is not None and hidden_dim != w1.shape[0]:
        raise ValueError(f"{where} gives a SwiGLU size of {hidden_dim} but the weights have {w1.shape[0]}")
    args = ModelArgs.from_dict({**params, "tie_embeddings": "output.weight" not in sd})
    if args.hidden_dim != w1.shape[0]:
        args = ModelArgs.from_dict({**asdict(args), **ffn_settings(args.dim, w1.shape[0])})
    if args.tie_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]  # as a tied model's state_dict() has it
    with torch.device("meta"):
        expected = Transformer(args).state_dict()
    for k in sorted(expected.keys() | sd.keys()):
        if k not in sd:
            raise ValueError(f"the weights beside {where} have no {name(k)}, which its settings imply")
        if k not in expected:
            raise ValueError(f"the weights beside {where} have a tensor {name(k)} that a Llama of its settings has not")
        if sd[k].shape != expected[k].shape:
            raise ValueError(f"the weights beside {where} have {name(k)} of shape {tuple(sd[k].shape)}, "
                             f"but its settings imply {tuple(expected[k].shape)}")
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
    sd = merge_lora(state_dict, args) if any(k.endswith("lora_a") for k in state_dict) else dict(state_dict)
    if args.tie_embeddings:  # one tensor under both names, whether or not the caller passed both
        sd["output.weight"] = sd["tok_embeddings.weight"]
    return sd


def _within(a, b):
    """Whether path a is b or inside it (both real paths)."""
    return a == b or a.startswith(b + os.sep)


def _remove(path):
    """Removes a file, a link or a directory tree at path, if there is one."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)  # a directory too: its entries, a rename's result
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        for root, _, files in os.walk(tmp):  # on disk before the rename: a power cut never leaves it holding empty files
            for name in files:  # readable by others too: safetensors writes its files 0o600 whatever the umask
                os.chmod(os.path.join(root, name), 0o644)
            for name in files + ["."]:
                _fsync(os.path.join(root, name))
        if os.path.exists(out_dir):  # rename cannot replace a non-empty directory
            os.rename(out_dir, tmp + ".old")
        os.rename(tmp, out_dir)
        _fsync(os.path.dirname(out_dir))
        shutil.rmtree(tmp + ".old", ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_json(obj, path):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def _check_tokenizer_files(tokenizer_files, written):
    # before anything is written, so a wrong path leaves no half-made export behind
    for f in tokenizer_files:
        if not os.path.isfile(f):
            raise ValueError(f"tokenizer file {f!r} does not exist or is not a file")
        if os.path.basename(f) in written:
            raise ValueError(f"tokenizer file {f!r} has the name of a file the export writes itself")


def _finish(tmp, tokenizer_files, provenance):
    for f in tokenizer_files:
        shutil.copy(f, os.path.join(tmp, os.path.basename(f)))
    _write_json(dict(provenance or {}), os.path.join(tmp, "nanotune.json"))


def export_meta(state_dict, args, out_dir, tokenizer_files=(), provenance=None):
    """params.json + consolidated.00.pth, as Meta's llama code loads them, plus copies of
    tokenizer_files and nanotune.json holding the provenance dict. Tied embeddings are saved as
    Meta's Llama 3.2 has them, output.weight beside tok_embeddings.weight (here one storage).
    Settings Meta's params.json has no word for get Mistral's keys (head_dim, sliding_window) or
    nanotune's (a RoPE scaling other than the one Meta's code fixes for use_scaled_rope), which
    nanotune reads back and Meta's code would ignore."""
    _check_tokenizer_files(tokenizer_files, ("params.json", "consolidated.00.pth", "nanotune.json"))
    params = {k: getattr(args, k) for k in META_PARAMS}
    if args.head_dim * args.n_heads != args.dim:
        params["head_dim"] = args.head_dim
    if args.sliding_window is not None:
        params["sliding_window"] = args.sliding_window
    weights = _plain(state_dict, args)
    if args.rope_scaling is not None:
        params["use_scaled_rope"] = True
        # _load_meta gives 32 to a model it reads as tied: one whose output equals its embedding, tied
        # or not (an untied model fresh from a tied one)
        if args.rope_scaling != META_ROPE_SCALING or _same(weights.get("output.weight"), weights.get("tok_embeddings.weight")):
            params.update(zip(META_ROPE_KEYS, args.rope_scaling))
    with _atomic_dir(out_dir) as tmp:
        _write_json(params, os.path.join(tmp, "params.json"))
        torch.save(weights, os.path.join(tmp, "consolidated.00.pth"))
        # the context length goes to nanotune.json: Meta's loader passes max_seq_len beside params.json
        _finish(tmp, tokenizer_files, {**(provenance or {}), "max_seq_len": args.max_seq_len})


def hf_unexportable(args):
    """Why transformers would not load args' shape from an HF export ('' if it would): a shape the
    training scripts refuse at start, before the export at their end could fail."""
    if args.dim % args.n_heads:
        return (f"export_format='hf': transformers refuses a model of dim {args.dim} over {args.n_heads} heads "
                f"(not a multiple, whatever head_dim says); export it as 'meta'")
    return ""


def _hf_config(args, dtype, bos_id=None, eos_id=None):
    """config.json for transformers, in the 4.x style (top-level rope_theta and rope_scaling) that
    transformers 5 reads too. A sliding window makes it a Mistral: Llama's config has none."""
    if why := hf_unexportable(args):
        raise ValueError(why)
    model_type = "llama" if args.sliding_window is None else "mistral"
    scaling = args.rope_scaling and dict(zip(("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings"), args.rope_scaling))
    config = {"architectures": [HF_ARCHITECTURES[model_type]], "model_type": model_type, "hidden_act": "silu",
              "torch_dtype": str(dtype).removeprefix("torch."), "hidden_size": args.dim,
              "intermediate_size": args.hidden_dim, "num_hidden_layers": args.n_layers,
              "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
              "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
              "rope_scaling": scaling and {"rope_type": "llama3", **scaling},
              "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
              "bos_token_id": bos_id, "eos_token_id": eos_id}
    if model_type == "mistral":
        config["sliding_window"] = args.sliding_window
    return config


def _hf_tokenizer_config(names):
    """The tokenizer_config.json an export writes, so that transformers' AutoTokenizer encodes text as
    data_prep did (None: the data's files do as they are). Without a config, it puts no BOS before a
    text from a tokenizer.model, and reads a tiktoken file without its special tokens. A
    SentencePiece model's or a tokenizer.json's own config may name a tokenizer_class (Llama 2's
    LlamaTokenizer), which transformers 5 builds with a pipeline of its own instead of the file's,
    or say legacy false, which there and for a tokenizer.model leaves out the space SentencePiece
    puts before a text that starts with one: those go. Without them it reads the file's own
    pipeline, as data_prep does."""
    from data_prep import LLAMA3_SPECIALS, load_tokenizer
    main = names.get("tokenizer.json", names.get("tokenizer.model"))
    if "tokenizer_config.json" in names:
        with open(names["tokenizer_config.json"]) as f:
            config = json.load(f)
        sentencepiece = main == names.get("tokenizer.model")
        keys = ["legacy"] if sentencepiece else []
        if config.get("tokenizer_class") not in ("PreTrainedTokenizerFast", "TokenizersBackend"):  # which read the file as it is
            keys = ["tokenizer_class", "legacy"]
        dropped = {k: config.pop(k) for k in keys if k in config}
        if main is None or (tok := load_tokenizer(main)).kind == "tiktoken" or not (dropped or sentencepiece):
            return None
        if dropped:
            print(f"export_hf: tokenizer_config.json written without its {', '.join(f'{k} {v!r}' for k, v in dropped.items())}, "
                  f"with which transformers 5 encodes otherwise than {os.path.basename(main)} did for the data")
        # said where transformers' default differs from what data_prep read: a SentencePiece model's BOS when
        # unsaid (transformers 5 adds none without its LlamaTokenizer class), and no EOS after a prompt
        said = {"add_bos_token": tok.bos_id is not None, **({"add_eos_token": False} if sentencepiece else {})}
        if config.get("add_eos_token") and sentencepiece:
            print("export_hf: tokenizer_config.json written with add_eos_token False: the data's documents end with "
                  "an EOS, a prompt (sample.py's, a server's) does not")
        return {**config, **said}
    if main is None or main == names.get("tokenizer.json"):
        return None
    tok = load_tokenizer(main)
    if tok.kind == "tiktoken":
        specials = dict(enumerate(LLAMA3_SPECIALS, tok.vocab_size - len(LLAMA3_SPECIALS)))
        special = dict(lstrip=False, rstrip=False, normalized=False, single_word=False, special=True)
        config = {"bos_token": specials[tok.bos_id], "eos_token": specials[tok.eos_id],
                  "added_tokens_decoder": {str(i): {"content": t, **special} for i, t in specials.items()}}
    else:
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor(model_file=main)
        # the BOS and EOS the data holds: a special_tokens_map.json beside the model may name others than its own
        bos = tok.bos_id if tok.bos_id is not None else sp.bos_id()
        config = {"bos_token": sp.id_to_piece(bos) if bos >= 0 else None, "eos_token": sp.id_to_piece(tok.eos_id)}
    return {**config, "add_bos_token": tok.bos_id is not None, "add_eos_token": False}


def export_hf(state_dict, args, out_dir, tokenizer_files=(), bos_id=None, eos_id=None, provenance=None, generation=None):
    """config.json + model.safetensors + generation_config.json, as transformers'
    LlamaForCausalLM (MistralForCausalLM with a sliding window) loads them, plus copies of
    tokenizer_files and nanotune.json holding the provenance dict. eos_id may be a list; generation
    holds the source's sampling defaults (source_generation). A tokenizer.model without a
    tokenizer_config.json gets one (_hf_tokenizer_config)."""
    _check_tokenizer_files(tokenizer_files, ("config.json", "generation_config.json", "model.safetensors",
                                             "nanotune.json"))
    names = {os.path.basename(f): f for f in tokenizer_files}
    tokenizer_config = _hf_tokenizer_config(names)
    sd = _plain(state_dict, args)
    if args.tie_embeddings:  # safetensors refuses shared tensors, and transformers re-ties them
        del sd["output.weight"]
    config = _hf_config(args, sd["tok_embeddings.weight"].dtype, bos_id, eos_id)
    generation = {**(generation or {}), **{k: v for k, v in (("bos_token_id", bos_id), ("eos_token_id", eos_id)) if v is not None}}
    with _atomic_dir(out_dir) as tmp:
        _write_json(config, os.path.join(tmp, "config.json"))
        _write_json(generation, os.path.join(tmp, "generation_config.json"))
        # transformers refuses safetensors files without the format in their metadata
        save_file({k: v.contiguous() for k, v in meta_to_hf(sd, args).items()},
                  os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if tokenizer_config:  # in place of the data's
            _write_json(tokenizer_config, os.path.join(tmp, "tokenizer_config.json"))
            tokenizer_files = [f for f in tokenizer_files if os.path.basename(f) != "tokenizer_config.json"]
        _finish(tmp, tokenizer_files, provenance)


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
    # adapters on some layers alone, trained biases or whole modules saved beside them: read as nanotune's
    # LoRA they would be another model
    if odd := {k: cfg[k] for k in ("layers_to_transform", "layers_pattern", "modules_to_save") if cfg.get(k)} | (
            {"bias": cfg["bias"]} if cfg.get("bias", "none") != "none" else {}):
        raise ValueError(f"{path} sets {', '.join(f'{k}={v!r}' for k, v in odd.items())}, which nanotune's LoRA "
                         f"does not implement (adapters on every layer, no biases, no other modules)")
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


# ---------------------------------------------------------------------------------------------
# ExecuTorch: the converted model as a .pte program, its linears lowered to XNNPACK

class _ExportCache(torch.nn.Module):
    """One layer's keys and values (1, n_kv_heads, max_len, head_dim) as buffers: torch.export turns
    the in-place writes into buffer mutations, which ExecuTorch keeps between calls."""

    def __init__(self, args, max_len):
        super().__init__()
        shape = (1, args.n_kv_heads, max_len, args.head_dim)
        self.register_buffer("k", torch.zeros(shape), persistent=False)
        self.register_buffer("v", torch.zeros(shape), persistent=False)

    def update(self, k, v, input_pos):
        # positions are a tensor, not the int start of model.KVCache, so that one program serves
        # every position; attention then reads the whole cache and the mask hides what is not yet written
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class _ExportDecoder(torch.nn.Module):
    """forward(tokens (1, T), input_pos (T,)) -> logits (1, T, V): the tokens at positions input_pos,
    attending to everything cached before them."""

    def __init__(self, model, max_len):
        super().__init__()
        self.model, self.max_len = model, max_len
        self.caches = torch.nn.ModuleList(_ExportCache(model.args, max_len) for _ in model.layers)

    def forward(self, tokens, input_pos):
        m = self.model
        h = m.tok_embeddings(tokens)
        cos, sin = m.rope_cos[input_pos], m.rope_sin[input_pos]  # (T, D/2)
        key_pos = torch.arange(self.max_len, device=tokens.device)
        mask = key_pos[None, :] <= input_pos[:, None]  # (T, max_len)
        if m.args.sliding_window is not None:
            mask = mask & (input_pos[:, None] - key_pos[None, :] < m.args.sliding_window)
        for layer, cache in zip(m.layers, self.caches):
            h = layer(h, cos, sin, mask, cache, input_pos)
        return m.output(m.norm(h))


def _xnnpack_weights(model):
    """Checks that every quantized weight is one XNNPACK runs (int8 dynamic activations, symmetric
    4-bit groups of a multiple of 32) and returns the model with 2- and 3-bit weights relabelled as
    4-bit: their integers and scales are unchanged, so this is exact, and XNNPACK has 4-bit kernels only."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    quantized = False
    for name, p in list(model.named_parameters()):
        if not type(p).__module__.startswith("torchao"):
            continue
        quantized = True
        if name.startswith("tok_embeddings"):
            raise ValueError("ExecuTorch's XNNPACK backend cannot run a quantized embedding; "
                             "convert with quantize_embedding=False to export a .pte")
        if type(p) is not IntxUnpackedToInt8Tensor or p.activation_quantization is None:
            raise ValueError(f"{name} is a {type(p).__name__} without int8 activations, which XNNPACK cannot run; "
                             f"export a model converted with an '8daNw' quantizer (N from 2 to 4)")
        bits, group = int(str(p.target_dtype).removeprefix("torch.int")), p.block_size[-1]
        if bits > 4 or group % 32 or (p.zero_point != 0).any():
            raise ValueError(f"{name} has {bits}-bit weights in groups of {group}: XNNPACK runs 2- to 4-bit "
                             f"symmetric weights in groups of a multiple of 32; use an '8daNw' quantizer with N <= 4")
        if bits < 4:
            module, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            setattr(module, attr, torch.nn.Parameter(IntxUnpackedToInt8Tensor(
                p.qdata, p.scale, p.zero_point, torch.int4, p.block_size, p.dtype, p.activation_quantization),
                requires_grad=False))
    if not quantized:
        raise ValueError("the model has no quantized weights: export_executorch takes a converted model "
                         "(quantized.pt, or a model after QATConfig's convert step)")
    return model


# the .pte's KV cache by default: float32 keys and values of every position, allocated when the
# program loads (Llama 3.2 1B's whole 131072-position context would take 8.6 GB on a phone)
PTE_CONTEXT = 2048


def export_executorch(model, path, max_seq_len=None):
    """Writes a converted 8daNw model (N <= 4) as an ExecuTorch program lowered to XNNPACK, with a
    KV cache of max_seq_len positions (default the model's context, at most PTE_CONTEXT) inside it;
    returns that length. The program's forward
    takes tokens (1, T) and their positions input_pos (T,), both int64, T from 1 to max_seq_len,
    writes their keys and values into the cache and returns float32 logits (1, T, V): prefill
    the prompt at positions 0..T-1, then one token at a time. A new sequence simply starts again
    at position 0. Refuses, with one line, a model that was never converted or a scheme XNNPACK
    cannot run. Needs the executorch package, imported only here."""
    import copy

    max_len = max_seq_len or min(model.args.max_seq_len, PTE_CONTEXT)
    if not 2 <= max_len <= model.args.max_seq_len:
        raise ValueError(f"max_seq_len={max_len} must be from 2 to the model's {model.args.max_seq_len}")
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise ValueError(f"the model computes in {', '.join(sorted(map(str, dtypes)))}; "
                         f"export a float32 model (dtype='float32')")
    # no gradients: a model loaded with load_state_dict(assign=True) keeps requires_grad on its
    # integer weights, which the lowering refuses
    decoder = _ExportDecoder(_xnnpack_weights(copy.deepcopy(model).requires_grad_(False)).eval(), max_len).eval()

    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torch.export import Dim, export

    T = Dim("T", min=1, max=max_len)
    example = (torch.zeros(1, 2, dtype=torch.long), torch.arange(2))
    with torch.no_grad():
        program = export(decoder, example, dynamic_shapes=({1: T}, {0: T}), strict=False)
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()],
                                       constant_methods={"max_seq_len": max_len, "vocab_size": model.args.vocab_size})
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(edge.to_executorch().buffer)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return max_len


def pte_summary(path, args, max_len):
    """What an export_executorch call wrote, in one line: the file, its context and the cache's memory."""
    cache = 2 * args.n_layers * max_len * args.n_kv_heads * args.head_dim * 4
    return (f"{path} ({os.path.getsize(path) / 2 ** 20:,.1f} MiB; a KV cache of {max_len:,} positions, {cache / 2 ** 20:,.1f} MiB "
            f"when it runs{'' if max_len == args.max_seq_len else f'; the model has {args.max_seq_len:,}: sample.py --export_pte with --pte_max_seq_len for more'})")


class ExecuTorchModel:
    """A .pte written by export_executorch, run by ExecuTorch's own runtime: `model(tokens,
    input_pos)` is the program's forward, `generate` decodes greedily as Transformer.generate does."""

    def __init__(self, path):
        from executorch.runtime import Runtime

        program = Runtime.get().load_program(path)
        self.forward = program.load_method("forward")
        self.max_seq_len = program.load_method("max_seq_len").execute([])[0]
        self.vocab_size = program.load_method("vocab_size").execute([])[0]

    def __call__(self, tokens, input_pos):
        return self.forward.execute([tokens, input_pos])[0]

    def generate(self, tokens, max_new_tokens, eos_id=None):
        """Greedy continuation of tokens (1, T): the prompt once, then one token per call, to a stop id
        in eos_id (an id or a list of them)."""
        T = tokens.shape[1]
        stops = [] if eos_id is None else [eos_id] if isinstance(eos_id, int) else list(eos_id)
        if T + max_new_tokens > self.max_seq_len:
            raise ValueError(f"{T} + {max_new_tokens} tokens do not fit the program's cache of {self.max_seq_len}")
        logits = self(tokens, torch.arange(T))
        for pos in range(T, T + max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat((tokens, nxt), 1)
            if nxt.item() in stops or pos == T + max_new_tokens - 1:
                break
            logits = self(nxt, torch.tensor([pos]))
        return tokens
