"""
Benchmarks: how fast are the QAT and KD steps, how close to the hardware's limit, and do QAT and
KD beat their baselines? Everything is measured by running the real scripts (qat_train.py,
kd_train.py) and reading their log.jsonl, so the figures describe the code you train with.

Speed and memory (a couple of minutes on a CPU, about one on a GPU):
$ python bench.py speed                                   # the tiny preset, float32 and bfloat16
$ python bench.py speed --nproc 2                         # under torchrun: per-device and total
$ python bench.py speed --preset toy --batch_size 4 --block_size 256 --n_layer 4 --n_embd 256 --nproc 2 --compile 0
$ python bench.py speed --device cuda --preset llama3.2-1b --vocab_size 128256 --batch_size 4 --block_size 2048 --dtypes bfloat16 --compile 1 --steps_of plain,qat
$ bash .ci/gpu                                            # README's GPU figures (three such runs)

Quality (about 20 minutes on a 2-core CPU with the defaults; larger presets for GPUs):
$ python bench.py quality
$ python bench.py quality --preset tiny --base_iters 2000 --ft_iters 300 --seeds 3 --device cuda
$ python bench.py quality --base_ckpt out/bench/quality/base/ckpt.pt --schemes 8da2w --qad_kd_ratio 0.5 --kd_iters 0

Memory plan per rank, from the shapes alone (nothing allocated; seconds):
$ python bench.py memory --preset llama3.1-8b --nproc 8 --batch_size 2 --block_size 2048

Deployment (a few minutes on a CPU): full precision PyTorch with a KV cache, the converted
8da4w model in PyTorch, and its ExecuTorch program (XNNPACK): file size, decoding tokens/s at batch 1
after prefill, and validation loss, side by side; rounds interleaved, medians quoted.
$ python bench.py deploy                                  # trains the tiny preset briefly first
$ python bench.py deploy --qat_dir out/tiny_qat           # a finished qat_train.py run (ckpt.pt, quantized.pt)

KD from a stored teacher top-k against online KD and plain CE (speed and quality, one run):
$ python bench.py kd --ks 8,16,32,64
$ python bench.py kd --base_ckpt out/bench/quality/base/ckpt.pt --kd_train_tokens 0 --seeds 3

Speed: every variant (plain step, QAT step, KD step, QAD step; eager and compiled; each dtype)
runs for a few steps with a log line per step; the median step after warmup gives ms/step and
tokens/s. Variants are interleaved in rounds so that a busy moment on a shared machine hits them
alike; ratios are to the plain step of the same dtype and compile mode. MFU is the scripts' own
(median of the timed steps' log lines): FLOPs per token x tokens/s / model.peak_flops. Compiled
runs report dynamo's graph breaks and recompilations (TORCH_LOGS); every run, the weight matrices
it left as they started (a step that skips some is no figure of a training step).

Quality: from one base model trained from scratch, the same finetuning steps (a) without QAT,
(b) with QAT, (c) with quantization-aware self-distillation (QAD); then PTQ of (a), conversion
of (b) and (c), all evaluated on the whole validation split. Recovery of X = (ppl_PTQ - ppl_X)
/ (ppl_PTQ - ppl_fp). KD: a small student trained with CE alone vs with KD from the base model,
same steps and data; the share of the student-teacher gap that KD closes. Several seeds: mean
and spread.

KD: the teacher's top-k written once per k (timed, bytes per token), then students trained with CE
alone, online KD and KD from each store, same steps, data and windows: gap closed by each, and
by each store relative to online KD. Speed rows from short interleaved runs: the plain CE step
(qat_train.py, no teacher), the online KD step and the stored KD step per k.
"""

import argparse
import contextlib
import ctypes
import hashlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from checkpoint import checkpoint_digest, load_checkpoint
from configurator import QUANTIZER_ONLY, TRAINING_ONLY
from model import LOGITS_PER_CHUNK, PRESETS, ModelArgs, Transformer

HERE = os.path.dirname(os.path.abspath(__file__))
# torchtune 0.6.1's qat_distributed (eager: it refuses compile with QAT), tokens/s per rank at the
# shape of --preset torchtune, 2 ranks, fake quant on from the first step, measured side by side
# with qat_train.py under torchrun on this project's 2-core AVX512-BF16 CPU machine (2026-12-06,
# median of four interleaved runs; README); not rerun here, and the machine's speed moves between
# sittings by 20% and more
TORCHTUNE_QAT_TOKENS_PER_SEC_PER_RANK = {(2, "float32"): 1650, (2, "bfloat16"): 1972}


def run(script, args, out_dir, nproc=1, quiet=True, env=None):
    """Runs a training script to completion and returns its log.jsonl records; what it printed is
    kept in out_dir/output.txt. env: variables set for it beside this process's."""
    os.makedirs(out_dir, exist_ok=True)
    log_path = os.path.join(out_dir, "log.jsonl")
    if os.path.exists(log_path):
        os.remove(log_path)
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = launcher + [os.path.join(HERE, script), f"--out_dir={out_dir}"] + [f"--{k}={v}" for k, v in args.items()]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    with open(os.path.join(out_dir, "output.txt"), "w") as f:
        f.write(proc.stdout)
    if proc.returncode:
        sys.exit(f"bench: {' '.join(cmd)} failed:\n{proc.stdout[-3000:]}")
    with open(log_path) as f:
        records = [json.loads(line) for line in f]
    if not quiet:
        print(f"  {script} {out_dir}: {time.perf_counter() - t0:.0f} s")
    return records


def summary(records):
    return next(r for r in reversed(records) if "fp_val_loss" in r)


def quantized(records, method, out_dir):
    """The summary of a QAT or QAD run, which must have ended under fake quant: one whose settings
    left it off at the last step converted its weights as PTQ, and is no figure of the method."""
    s = summary(records)
    if s.get("method") != method:
        sys.exit(f"bench: the run in {out_dir} converted as {s.get('method')!r}, not {method!r}: its settings left fake "
                 f"quant off at its last step; drop the --qat_set / --qad_set that does")
    return s


# what a run computes beyond its arguments: the scripts and the modules they import
CODE_FILES = ("qat_train.py", "kd_train.py", "model.py", "checkpoint.py", "data_prep.py", "configurator.py")


def code_digest():
    h = hashlib.sha256()
    for name in CODE_FILES:
        with open(os.path.join(HERE, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def library_versions():
    return {name: importlib.metadata.version(name) for name in ("torch", "torchao")}


# the runs this invocation reused though other code or library versions made them: every report says so
REUSED_FROM_OTHER = []


def run_once(script, args, out_dir, nproc=1, quiet=True):
    """run(), unless out_dir holds a finished run of exactly these arguments, input checkpoints and data:
    the plain finetunes and PTQ evaluations are then shared by every QAT/QAD setting compared
    against them, and a base trained again differently is not mistaken for the one they started from.
    A run made by other code (CODE_FILES changed since) or other torch / torchao versions is reused,
    and said to be."""
    stamp, log_path = os.path.join(out_dir, "bench_args.json"), os.path.join(out_dir, "log.jsonl")
    inputs = {k: checkpoint_digest(args[k]) for k in ("init_from", "teacher_init") if os.path.exists(str(args.get(k, "")))}
    # and the data's fingerprints: data prepared again in place is other data under the same path
    with open(os.path.join(args["data_dir"], "meta.json")) as f:
        data = {k: v for k, v in json.load(f).items() if k in ("data", "tokenizer", "vocab_size")}
    key = json.loads(json.dumps({"script": script, "nproc": nproc, **args, "input_digests": inputs, "data": data}))
    if os.path.exists(stamp) and os.path.exists(log_path):
        with open(stamp) as f:
            stamped = json.load(f)
        code = stamped.pop("code", None)  # stamps from before they were recorded have neither
        versions = stamped.pop("versions", None)
        if stamped == key:
            with open(log_path) as g:
                records = [json.loads(line) for line in g]
            if any("fp_val_loss" in r for r in records):
                other = [what for what, same in (("other code than this checkout's", code == code_digest()),
                                                 (f"other versions ({versions})", versions in (None, library_versions())))
                         if not same]
                print(f"  {script} {out_dir}: reused" + (f", though run by {' and '.join(other)} (remove the directory "
                                                         f"to run it again)" if other else ""))
                if other:
                    REUSED_FROM_OTHER.append(f"{out_dir}: {' and '.join(other)}")
                return records
    if os.path.exists(stamp):
        print(f"  bench: {out_dir} holds a run of other arguments; it is rerun over (name the setting apart to keep both)")
        os.remove(stamp)
    code = code_digest()  # the code the run starts with: an edit while it runs must not be credited with it
    records = run(script, args, out_dir, nproc, quiet)
    if code_digest() != code:
        print(f"  bench: {CODE_FILES} changed while {out_dir} ran; it will not be reused as this checkout's run")
        code = "changed during the run"
    with open(stamp, "w") as f:
        json.dump({**key, "code": code, "versions": library_versions()}, f)
    return records


def settings(pairs):
    """--qat_set/--qad_set/--quant_set's KEY=VALUE strings as script flags, and a name for them."""
    if any("=" not in p for p in pairs):
        sys.exit(f"bench: settings are KEY=VALUE, got {[p for p in pairs if '=' not in p]}")
    args = dict(p.split("=", 1) for p in pairs)
    return args, "".join("_" + re.sub(r"[^\w.=+-]", "", f"{k}={v}") for k, v in args.items())


def file_fingerprint(data):
    """A data file's entry in meta.json, as data_prep.py writes it (the scripts check the size)."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def short_val_copy(data_dir, out, n_tokens):
    """The data with its val split cut to n_tokens (train.bin linked, not copied; meta.json's file
    sizes made the cut ones'): the scripts always end with a whole-split evaluation, which is not
    what a speed run times."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    for name in os.listdir(data_dir):
        dst = os.path.join(out, name)
        if os.path.lexists(dst):
            os.remove(dst)
        if name.startswith("val"):
            kind = "mask" if "mask" in name else "pos" if "pos" in name else ""
            itemsize = np.dtype(meta.get(f"{kind}_dtype") or "uint8" if kind else meta["dtype"]).itemsize
            with open(os.path.join(data_dir, name), "rb") as f, open(dst, "wb") as g:
                g.write(data := f.read(n_tokens * itemsize))
            if name in (meta.get("data") or {}):
                meta["data"][name] = file_fingerprint(data)
        elif name != "meta.json":
            os.symlink(os.path.abspath(os.path.join(data_dir, name)), dst)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f)
    return out


def random_tokens(out, vocab_size, val_tokens):
    """Data of random token ids below vocab_size, as hand-made data is laid out (no tokenizer files):
    enough train tokens for a speed run and val_tokens of val. A step's time does not depend on the
    text, its vocabulary does: the real presets' output layers, e.g. Llama 3's 128256 rows."""
    os.makedirs(out, exist_ok=True)
    dtype = np.uint16 if vocab_size <= 2 ** 16 else np.uint32
    rng = np.random.default_rng(0)
    for name, n in (("train.bin", max(val_tokens, 2 ** 20)), ("val.bin", val_tokens)):
        rng.integers(vocab_size, size=n, dtype=dtype).tofile(os.path.join(out, name))
    meta = {"vocab_size": vocab_size, "dtype": np.dtype(dtype).name, "eos_id": None, "bos_id": None, "tokenizer": None}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f)
    return out


# -----------------------------------------------------------------------------
def speed(opt):
    out = os.path.join(opt.out_dir, "speed")
    if opt.device == "cpu" and sys.platform == "linux":
        # freed host memory kept for reuse, as in the scripts (qat_train.py says why): else the teacher
        # forwards timed in this process page-fault their vocabulary-sized temporaries in afresh
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, 1 << 30)
            libc.mallopt(-1, (1 << 31) - 1)
    shape = shape_args(opt)
    val_tokens = opt.batch_size * opt.nproc * (opt.block_size + 1)
    if opt.vocab_size:
        data_dir = random_tokens(os.path.join(out, f"data_{opt.vocab_size}"), opt.vocab_size, val_tokens)
    else:
        data_dir = short_val_copy(opt.data_dir, os.path.join(out, "data"), val_tokens)
    common = dict(data_dir=data_dir, preset=opt.preset, batch_size=opt.batch_size, block_size=opt.block_size,
                  gradient_accumulation_steps=opt.nproc, max_iters=opt.warmup + opt.steps, log_interval=1,
                  eval_interval=10 ** 9, eval_iters=1, ckpt_interval=10 ** 9, device=opt.device,
                  **shape)
    if opt.peak_flops:
        common["peak_flops_per_device"] = opt.peak_flops
    teacher = os.path.join(out, "teacher.pt")  # the student's own shape: KD then costs one extra forward
    run("qat_train.py", {**common, "quantizer": "none", "max_iters": 1, "eval_iters": 1}, os.path.join(out, "init"))
    os.replace(os.path.join(out, "init", "ckpt.pt"), teacher)
    common = {k: v for k, v in common.items() if k not in ("preset", *shape)}  # the checkpoint has the shape
    kinds = opt.steps_of.split(",")
    variants = []
    for dtype in opt.dtypes.split(","):
        for comp in [int(c) for c in opt.compile.split(",")]:
            base = {**common, "dtype": dtype, "compile": bool(comp), "mixed_precision": False}
            variants += [v for v in [
                ((dtype, comp, "plain"), "qat_train.py", {**base, "quantizer": "none", "init_from": teacher}),
                ((dtype, comp, "qat"), "qat_train.py", {**base, "quantizer": opt.quantizer, "group_size": opt.group_size, "init_from": teacher,
                                                         "ptq_baseline": False}),
                ((dtype, comp, "kd"), "kd_train.py", {**base, "teacher_init": teacher, "init_from": teacher}),
                ((dtype, comp, "qad"), "kd_train.py", {**base, "teacher_init": teacher, "init_from": teacher,
                                                       "quantizer": opt.quantizer, "group_size": opt.group_size}),
            ] if v[0][2] in kinds]
    times = {key: [] for key, _, _ in variants}  # seconds per timed step
    rates = {key: [] for key, _, _ in variants}  # FLOP/s per device as each run counts them (its MFU times its peak)
    peaks = {dtype: 0.0 for dtype in opt.dtypes.split(",")}  # the highest peak any run of the dtype measured
    mems = {key: 0.0 for key, _, _ in variants}
    # what dynamo says of a compiled run (TORCH_LOGS): the graph breaks and the recompilations, with
    # their first reason; a compiled step is fast only as one graph per block shape, compiled once
    compiled = {}
    untrained = {}  # the weights a run left as they started: a step that skips them is no figure of a step
    tokens_step = opt.batch_size * opt.block_size * opt.nproc
    forwards = {dtype: [] for dtype in opt.dtypes.split(",")}  # seconds per teacher forward, one process
    teacher_model = load_checkpoint(teacher)  # (args, state), read once for every round's forwards
    for r in range(opt.rounds):
        for key, script, args in variants:
            run_dir = os.path.join(out, "_".join(map(str, key)))
            recs = [x for x in run(script, args, run_dir, opt.nproc, env={"TORCH_LOGS": "graph_breaks,recompiles"} if key[1] else None)
                    if "loss" in x]
            if key[1]:
                compiled[key] = dynamo_events(os.path.join(run_dir, "output.txt"))
            if r == 0:
                untrained[key] = unchanged_weights(teacher_model, os.path.join(run_dir, "ckpt.pt"))
            times[key] += [tokens_step / x["tokens_per_sec"] for x in recs[opt.warmup:]]
            rates[key] += [x["mfu"] * x["peak_flops"] for x in recs[opt.warmup:]]
            peaks[key[0]] = max(peaks[key[0]], *(x["peak_flops"] for x in recs))
            mems[key] = max(mems[key], recs[-1]["peak_mem_gib"])
            print(f"round {r + 1}/{opt.rounds} {'/'.join(map(str, key)):>22}: {1e3 * statistics.median(times[key]):8.1f} ms/step")
        if opt.nproc == 1 and "0" in opt.compile.split(",") and "kd" in kinds:  # the bound of the eager KD step
            for dtype in forwards:
                forwards[dtype] += teacher_forward_times(opt, *teacher_model, dtype)
    rows, results = [], []
    for dtype in opt.dtypes.split(","):
        for comp in [int(c) for c in opt.compile.split(",")]:
            plain = statistics.median(times[(dtype, comp, "plain")])
            for kind in kinds:
                key = (dtype, comp, kind)
                t = statistics.median(times[key])
                tps = tokens_step / t
                res = dict(dtype=dtype, compile=bool(comp), step=kind, ms_per_step=1e3 * t, tokens_per_sec=tps,
                           tokens_per_sec_per_device=tps / opt.nproc, ratio_to_plain=t / plain,
                           mfu=statistics.median(rates[key]) / peaks[dtype], peak_mem_gib=mems[key])
                if comp:
                    res |= compiled[key]
                res["untrained"] = untrained[key]
                results.append(res)
                graphs = f"{res['graph_breaks']} / {res['recompiles']} (+{res['recompiles_grad_mode']})" if comp else "–"
                rows.append(f"| {dtype} | {'compiled' if comp else 'eager'} | {kind} | {res['ms_per_step']:.1f} | "
                            f"{tps:,.0f} | {tps / opt.nproc:,.0f} | {res['ratio_to_plain']:.2f}x | {100 * res['mfu']:.0f}% | "
                            f"{res['peak_mem_gib']:.2f} | {graphs} |")
    table = ["| dtype | mode | step | ms/step | tokens/s | tokens/s/device | vs plain | MFU | peak mem GiB | graph breaks / recompiles (+ for a grad mode) |",
             "|---|---|---|---|---|---|---|---|---|---|"] + rows
    notes = [f"- {r['dtype']} compiled {r['step']}: {r[what]} {what.replace('_', ' ')}, the first: {r[what + '_first']}"
             for r in results for what in ("graph_breaks", "recompiles") if r.get(what)]
    notes += [f"- **{r['dtype']} {'compiled' if r['compile'] else 'eager'} {r['step']}: {len(r['untrained'])} weights ended "
              f"as they started ({', '.join(r['untrained'][:3])}...): its steps did not train them, so its time is not "
              f"a training step's**" for r in results if r["untrained"]]
    ms = {(r["dtype"], r["compile"], r["step"]): r["ms_per_step"] for r in results}
    for dtype, ts in forwards.items():
        if not ts:
            continue
        # what the KD step should cost at most: a plain step and the teacher's forward, nothing more
        fwd, plain, kd = 1e3 * statistics.median(ts), ms[(dtype, False, "plain")], ms[(dtype, False, "kd")]
        notes.append(f"- {dtype}: one teacher forward, timed alone (eager, no_grad: hidden states, output layer, "
                     f"log-softmax) {fwd:.1f} ms; plain step + it = {(plain + fwd) / plain:.2f}x plain, the eager KD step "
                     f"{kd / plain:.2f}x")
    ref = TORCHTUNE_QAT_TOKENS_PER_SEC_PER_RANK
    with open(os.path.join(data_dir, "meta.json")) as f:  # torchtune's work: 8da4w g32 over a vocabulary of 4096
        same_work = (opt.quantizer, opt.group_size, json.load(f)["vocab_size"]) == ("8da4w", 32, 4096)
    for r in results:
        if (r["step"] == "qat" and (opt.nproc, r["dtype"]) in ref and opt.device == "cpu" and opt.preset_is_torchtune
                and same_work):
            theirs = ref[(opt.nproc, r["dtype"])]
            notes.append(f"- QAT {r['dtype']} {'compiled' if r['compile'] else 'eager'}: {r['tokens_per_sec_per_device']:,.0f} "
                         f"tokens/s per rank, {r['tokens_per_sec_per_device'] / theirs:.2f}x torchtune 0.6.1 qat_distributed "
                         f"({theirs:,} tokens/s per rank, measured earlier on a 2-core CPU, not in this run)")
    report = (f"Speed: preset {opt.preset} {shape or ''}, batch {opt.batch_size} x {opt.block_size} per device, "
              f"{opt.nproc} process(es) on {opt.device} ({device_name(opt.device)}, torch {torch.__version__}), "
              f"{opt.quantizer} g{opt.group_size}, "
              f"median of {opt.steps} steps x {opt.rounds} round(s) after {opt.warmup} warmup steps; "
              f"KD's teacher has the student's shape (one extra forward, ~1.33x a plain step's FLOPs); MFU against the "
              f"highest peak any run measured or was given, per device: "
              f"{', '.join(f'{d} {p / 1e12:.3g} TFLOP/s' for d, p in peaks.items())}\n\n"
              + "\n".join(table) + "\n\n" + "\n".join(notes) + "\n")
    write(opt, "speed", report, {"options": vars(opt), "results": results})


def unchanged_weights(start, ckpt):
    """The names of the weight matrices in checkpoint ckpt equal to their start (args, state), in
    ckpt's dtype: none after a few steps of training, whose every weight a gradient reaches (AdamW
    skips a weight that gets none; the norms' gains, all 1.0, can stay there in bfloat16 at the
    warmup's small learning rates, which the values near 0 of a matrix do not)."""
    state = load_checkpoint(ckpt)[1]
    return [k for k, v in start[1].items() if v.dim() > 1 and torch.equal(v.to(state[k].dtype), state[k])]


def dynamo_events(path):
    """The graph breaks and recompilations dynamo logged (TORCH_LOGS=graph_breaks,recompiles) in a
    run's output: their counts and the first of each, where and why. A recompilation that a change of
    grad mode triggered (the evaluations after the timed steps, a frozen teacher's forward; none
    before them, a speed run evaluating only at its end) is one graph per mode, counted apart."""
    with open(path) as f:
        lines = [line.rstrip() for line in f]
    events = {"graph_breaks": [], "recompiles": []}  # (text, reasons) of each
    for line in lines:
        tag = "[__graph_breaks]" if "[__graph_breaks]" in line else "[__recompiles]" if "[__recompiles]" in line else None
        text = line.split(tag, 1)[1].strip() if tag else ""
        if text.startswith("Graph break") or text.startswith("Recompiling function"):
            events["graph_breaks" if tag == "[__graph_breaks]" else "recompiles"].append([text, []])
        elif tag == "[__recompiles]" and events["recompiles"] and (m := re.match(r"- \d+/\d+: (.*)", text)):
            events["recompiles"][-1][1].append(m.group(1))  # a guard that failed against a graph compiled before
    every = events["recompiles"]
    events["recompiles"] = [e for e in every if not any("grad_mode" in reason for reason in e[1])]
    res = {"recompiles_grad_mode": len(every) - len(events["recompiles"])}
    for what, found in events.items():
        res |= {what: len(found), f"{what}_first": " ".join([found[0][0]] + found[0][1][:1])[:300] if found else ""}
    return res


def device_name(device):
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"{os.cpu_count()} cores"


def teacher_forward_times(opt, args, state, dtype):
    """Seconds of each timed teacher forward of one micro-batch (the KD step's teacher work: hidden
    states, output layer, fp32 log-softmax), eager and under no_grad, in this process."""
    m = Transformer(args)
    m.load_state_dict(state)
    m.to(device=opt.device, dtype=getattr(torch, dtype))
    x = torch.randint(args.vocab_size, (opt.batch_size, opt.block_size), device=opt.device)
    times = []
    with torch.no_grad():
        for _ in range(opt.warmup + opt.steps):
            t0 = time.perf_counter()
            torch.log_softmax(m.output(m.hidden(x)).float(), -1)
            if opt.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return times[opt.warmup:]


def shape_args(opt):
    return {k: getattr(opt, k) for k in ("n_layer", "n_embd", "n_head", "n_kv_head") if getattr(opt, k) is not None}


# -----------------------------------------------------------------------------
def quality(opt):
    out = os.path.join(opt.out_dir, "quality")
    common = dict(data_dir=opt.data_dir, batch_size=opt.batch_size, block_size=opt.block_size, device=opt.device,
                  dtype=opt.dtype, mixed_precision=opt.dtype == "bfloat16", eval_interval=10 ** 9, eval_iters=1,
                  log_interval=50, ckpt_interval=10 ** 9, gradient_accumulation_steps=opt.nproc)
    convert = {k: v for k, v in common.items() if k not in TRAINING_ONLY}  # convert_only refuses training settings
    # the settings, checked before a base is trained: what bench sets for every run is its own option
    per_run = {*common, "init_from", "out_dir", "seed", "max_iters", "quantizer", "group_size", "teacher_init",
               "convert_only", "sharded_checkpoint"}
    # a method's own settings must leave the grid alone: its recovery is measured against PTQ on the same one
    for flag, kvs, theirs in (("--ft_set", opt.ft_set, set()), ("--qat_set", opt.qat_set, {"quantize_embedding", "quant_skip"}),
                              ("--qad_set", opt.qad_set, {"quantize_embedding", "quant_skip"})):
        if own := sorted(k for k in settings(kvs)[0] if k in per_run | theirs):
            sys.exit(f"bench: {flag} {', '.join(own)}=... is not read; bench sets it for each run (its own options: "
                     f"--ft_iters, --batch_size, --block_size, --dtype, --group_size, --seeds, --qad_teacher; the grid's "
                     f"settings for PTQ, QAT and QAD alike: --quant_set)")
    if other := sorted(k for k in settings(opt.quant_set)[0] if k not in ("quantize_embedding", "quant_skip")):
        sys.exit(f"bench: --quant_set {', '.join(other)}=... is no setting of the grid (quantize_embedding, quant_skip): "
                 f"PTQ, QAT and QAD would run under it and the full-precision reference not")
    ft_set, ft_name = settings(opt.ft_set)  # every finetune's, the plain one's too: named apart from the default's
    quant_set, quant_name = settings(opt.quant_set)
    learned = ["range_learning=True"] * bool(opt.range_learning)  # named, so that its runs never land on the others
    qat_set, qat_name = settings(learned + opt.qat_set)
    teacher_named = [f"teacher_init={opt.qad_teacher}"] * (opt.qad_teacher != "base")
    qad_set, qad_name = settings(learned + opt.qad_set + teacher_named)
    # the full-precision distillation: QAD's run without its quantizer, the teacher's share of what QAD wins
    kd_set, kd_name = settings([p for p in opt.qad_set + teacher_named
                                if p.split("=", 1)[0] not in (*QUANTIZER_ONLY, "range_lr_ratio")])
    stage = "_after_plain" * (opt.start == "plain")  # a stage after the plain finetune: its runs named apart
    methods = opt.methods.split(",")
    if unknown := set(methods) - {"qat", "qad", "kd", "none"}:
        sys.exit(f"bench: --methods {opt.methods!r} names {sorted(unknown)}; use qat, qad, kd, a list (qat,qad) or none")
    if "kd" in methods and "qad" not in methods:
        sys.exit("bench: --methods kd is QAD's reference (QAD without its quantizer): run it with qad, e.g. --methods qad,kd")
    t_start = time.perf_counter()
    base_dir = os.path.join(out, "base")
    base_args = {**common, "preset": opt.preset, **shape_args(opt), "quantizer": "none", "max_iters": opt.base_iters,
                 "learning_rate": opt.base_lr, "min_lr": opt.base_lr / 10, "warmup_iters": max(1, opt.base_iters // 20),
                 "seed": 1}
    base_ckpt = os.path.join(base_dir, "ckpt.pt")
    if opt.base_ckpt:  # an earlier run's base: its fp loss is read again on this data
        base_ckpt = opt.base_ckpt
        print(f"base model: {base_ckpt}")
        base = summary(run_once("qat_train.py", {**convert, "init_from": base_ckpt, "quantizer": "8da4w", "convert_only": True},
                                os.path.join(out, "base_eval"), opt.nproc))
    else:
        print(f"base model: {opt.preset}, {opt.base_iters} steps")
        base = summary(run("qat_train.py", base_args, base_dir, opt.nproc, quiet=False))
    teacher_loss = base["fp_val_loss"]
    ft = {**common, "init_from": base_ckpt, "max_iters": opt.ft_iters, "learning_rate": opt.ft_lr,
          "min_lr": opt.ft_lr / 10, "warmup_iters": max(1, opt.ft_iters // 10)}
    ft.update(ft_set)
    schemes = opt.schemes.split(",")
    runs = {s: [] for s in schemes}  # per scheme, one dict of perplexities per seed
    kd_runs = []  # per seed, the student's val loss trained with CE alone and with KD

    def rounded(ckpt, q, run_dir, **extra):  # a checkpoint converted without training: PTQ, or GPTQ with extra
        return summary(run_once("qat_train.py", {**convert, "init_from": ckpt, **q, "convert_only": True, **extra}, run_dir,
                                opt.nproc))["quant_val_loss"]

    for seed in range(opt.seeds):
        print(f"seed {seed}")
        plain_dir = os.path.join(out, f"s{seed}_plain{ft_name}")
        plain = summary(run_once("qat_train.py", {**ft, "quantizer": "none", "seed": seed}, plain_dir, opt.nproc, quiet=False))
        models = {"base": base_ckpt, "plain": os.path.join(plain_dir, "ckpt.pt")}
        teacher, start = models[opt.qad_teacher], models[opt.start]
        # a stage's batches: another seed's, as the same seed's would be the plain finetune's again (a second
        # epoch over them, which a model of this size overfits)
        run_seed = seed + 1000 * bool(stage)
        if stage:  # the same steps again in full precision: what a stage wins by training longer, not by quantizing
            more_dir = os.path.join(out, f"s{seed}_plain{ft_name}{stage}")
            more = summary(run_once("qat_train.py", {**ft, "quantizer": "none", "seed": run_seed, "init_from": start}, more_dir,
                                    opt.nproc, quiet=False))
        if "kd" in methods:
            kd_dir = os.path.join(out, f"s{seed}_kdfp{ft_name}{kd_name}{stage}")
            kd_fp = summary(run_once("kd_train.py", {**ft, "quantizer": "none", "seed": run_seed, "kd_ratio": opt.qad_kd_ratio,
                                                     "kd_temperature": opt.qad_kd_temperature, **kd_set, "teacher_init": teacher,
                                                     "init_from": start}, kd_dir, opt.nproc, quiet=False))
        for s in schemes:
            q = {"quantizer": s, "group_size": opt.group_size, **quant_set}
            r = {"fp": plain["fp_val_loss"],
                 "ptq": rounded(models["plain"], q, os.path.join(out, f"s{seed}_ptq_{s}{ft_name}{quant_name}"))}
            if stage:
                r["fp_more"] = more["fp_val_loss"]
                r["ptq_more"] = rounded(os.path.join(more_dir, "ckpt.pt"), q,
                                        os.path.join(out, f"s{seed}_ptq_{s}{ft_name}{quant_name}{stage}"))
            if "kd" in methods:
                r["fp_kd"] = kd_fp["fp_val_loss"]
                r["ptq_kd"] = rounded(os.path.join(kd_dir, "ckpt.pt"), q,
                                      os.path.join(out, f"s{seed}_ptq_{s}{ft_name}{quant_name}_kdfp{kd_name}{stage}"))
            if opt.gptq_tokens:  # the stronger PTQ a 4-bit QAT run has to beat: GPTQ of the same plain finetune
                r["gptq"] = rounded(models["plain"], q, os.path.join(out, f"s{seed}_gptq{opt.gptq_tokens}_{s}{ft_name}{quant_name}"),
                                    range_learning=True, gptq_tokens=opt.gptq_tokens)
            if "qat" in methods:
                qat_dir = os.path.join(out, f"s{seed}_qat_{s}{ft_name}{quant_name}{qat_name}{stage}")
                qat = quantized(run_once("qat_train.py", {**ft, **q, "seed": run_seed, **qat_set, "init_from": start}, qat_dir,
                                         opt.nproc, quiet=False),
                                "qat", qat_dir)
                r.update(qat=qat["quant_val_loss"], fp_qat=qat["fp_val_loss"])
            if "qad" in methods:
                qad_dir = os.path.join(out, f"s{seed}_qad_{s}{ft_name}{quant_name}{qad_name}{stage}")
                qad = quantized(run_once("kd_train.py", {**ft, **q, "seed": run_seed, "kd_ratio": opt.qad_kd_ratio, "kd_temperature":
                                                         opt.qad_kd_temperature, **qad_set, "teacher_init": teacher,
                                                         "init_from": start},
                                         qad_dir, opt.nproc, quiet=False), "qad", qad_dir)
                r.update(qad=qad["quant_val_loss"], fp_qad=qad["fp_val_loss"])
            runs[s].append({k: math.exp(v) for k, v in r.items()})
            print("  " + s + ": ppl " + "  ".join(f"{k} {v:.3f}" for k, v in runs[s][-1].items()))
        if not opt.kd_iters:
            continue
        kd_common = {**common, "teacher_init": base_ckpt, "init_from": "scratch", "preset": opt.student_preset,
                     "max_iters": opt.kd_iters, "learning_rate": opt.kd_lr, "min_lr": opt.kd_lr / 10,
                     "warmup_iters": max(1, opt.kd_iters // 10), "seed": seed}
        ce = summary(run_once("kd_train.py", {**kd_common, "kd_ratio": 0.0}, os.path.join(out, f"s{seed}_student_ce"), opt.nproc, quiet=False))
        kd = summary(run_once("kd_train.py", {**kd_common, "kd_ratio": opt.kd_ratio, "kd_divergence": opt.kd_divergence,
                                              "kd_temperature": opt.kd_temperature},
                              os.path.join(out, f"s{seed}_student_kd_{opt.kd_ratio}_{opt.kd_divergence}_{opt.kd_temperature}"),
                              opt.nproc, quiet=False))
        kd_runs.append({"ce": ce["fp_val_loss"], "kd": kd["fp_val_loss"]})
        print(f"  student val loss: CE only {ce['fp_val_loss']:.4f}  KD {kd['fp_val_loss']:.4f}  teacher {teacher_loss:.4f}")

    def ms(xs):
        return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0:.3f}" if xs else "-"

    def pm(xs):  # a share, in percent, mean ± std over seeds
        return f"{100 * statistics.mean(xs):.1f}% ± {100 * (statistics.stdev(xs) if len(xs) > 1 else 0):.1f}" if xs else "-"

    results = {"options": vars(opt), "base_val_loss": teacher_loss, "schemes": {}, "kd": {}}
    table = ["| scheme | ppl fp | ppl PTQ | PTQ degradation | ppl QAT | ppl QAD | QAT recovers | QAD recovers |"
             + " ppl GPTQ | GPTQ recovers |" * bool(opt.gptq_tokens), "|---" * (8 + 2 * bool(opt.gptq_tokens)) + "|"]
    notes = []
    for s in schemes:
        col = {k: [r.get(k) for r in runs[s]] for k in ("fp", "ptq", "qat", "qad", "gptq")}
        col = {k: v if None not in v else [] for k, v in col.items()}  # a method not run leaves its column empty
        deg = [p / f - 1 for p, f in zip(col["ptq"], col["fp"])]
        # recovery of X: the share of PTQ's perplexity loss that X wins back
        rec = {m: [(r["ptq"] - r[m]) / (r["ptq"] - r["fp"]) if r["ptq"] != r["fp"] else float("nan") for r in runs[s]]
               for m in ("qat", "qad", "gptq") if m in methods or m == "gptq" and opt.gptq_tokens}
        results["schemes"][s] = {"runs": runs[s], "ptq_degradation": deg, **{f"{m}_recovery": v for m, v in rec.items()}}
        if stage:  # against the plain finetune trained as many steps as the stage's total
            same = {m: [(r["ptq_more"] - r[m]) / (r["ptq_more"] - r["fp_more"]) for r in runs[s]] for m in ("qat", "qad") if m in methods}
            results["schemes"][s].update({f"{m}_recovery_same_steps": v for m, v in same.items()})
            notes.append(f"- {s}: the plain finetune trained {opt.ft_iters} more steps in full precision: ppl "
                         f"{ms([r['fp_more'] for r in runs[s]])}, PTQ of it {ms([r['ptq_more'] for r in runs[s]])}; "
                         f"against it (the same steps as the stage) "
                         + ", ".join(f"{m.upper()} recovers {pm(v)}" for m, v in same.items()))
        if "kd" in methods:  # against the same steps, rate and teacher in full precision: what quantizing alone costs
            vs_kd = [(r["ptq_kd"] - r["qad"]) / (r["ptq_kd"] - r["fp_kd"]) for r in runs[s]]
            results["schemes"][s]["qad_recovery_vs_kd"] = vs_kd
            notes.append(f"- {s}: the full-precision distillation at QAD's settings (QAD without its quantizer): ppl "
                         f"{ms([r['fp_kd'] for r in runs[s]])}, PTQ of it {ms([r['ptq_kd'] for r in runs[s]])}; against it "
                         f"QAD recovers {pm(vs_kd)}")
        table.append(f"| {s} g{opt.group_size}{quant_name} | {ms(col['fp'])} | {ms(col['ptq'])} | {pm(deg)} | {ms(col['qat'])} | "
                     f"{ms(col['qad'])} | {pm(rec.get('qat'))} | {pm(rec.get('qad'))} |"
                     + f" {ms(col['gptq'])} | {pm(rec.get('gptq'))} |" * bool(opt.gptq_tokens))
        # the degradation is paired (PTQ of the same seed's model), so its own spread says whether it is real
        if len(deg) > 1 and statistics.mean(deg) <= 2 * statistics.stdev(deg):
            notes.append(f"- {s}: PTQ's degradation ({100 * statistics.mean(deg):.2f}%) is within twice its seed "
                         f"spread: recovery is noise at this size")
        # the reference must be a finetune that helped: one that ends worse than the base it started
        # from (lr too high for this base) credits every method with undoing that damage
        if col["fp"] and (fp := statistics.mean(col["fp"])) > (base_ppl := math.exp(teacher_loss)):
            notes.append(f"- {s}: the plain finetunes end worse than the base (ppl {fp:.3f} against "
                         f"{base_ppl:.3f}): lr {float(ft['learning_rate']):g} undoes some of the base's training, and the "
                         f"recoveries count winning that back; measure again with a lower --ft_lr")
    if kd_runs:
        ce, kd = [r["ce"] for r in kd_runs], [r["kd"] for r in kd_runs]
        closed = [(c - k) / (c - teacher_loss) for c, k in zip(ce, kd)]
        results["kd"] = {"runs": kd_runs, "teacher_val_loss": teacher_loss, "gap_closed": closed}
        table += ["", "| student | val loss CE only | val loss KD | teacher val loss | gap closed by KD |", "|---|---|---|---|---|",
                  f"| {opt.student_preset} | {ms(ce)} | {ms(kd)} | {teacher_loss:.3f} | {pm(closed)} |"]
    origin = opt.base_ckpt or f"{opt.preset} trained {opt.base_iters} steps"
    report = (f"Quality: base {origin} on {opt.data_dir}; finetunes of {opt.ft_iters} steps "
              f"(lr {float(ft['learning_rate']):g} to {float(ft['min_lr']):g}); methods {opt.methods}"
              + (f", from the {opt.start}{' (a stage after it)' * (opt.start == 'plain')}" if {"qat", "qad"} & set(methods) else "")
              + (f", QAT's scales learned: {qat_set.get('range_learning', 'False')}" if "qat" in methods else "")
              + (f", QAD's scales learned: {qad_set.get('range_learning', 'False')}, kd_ratio {qad_set.get('kd_ratio', opt.qad_kd_ratio)} "
                 f"at T={qad_set.get('kd_temperature', opt.qad_kd_temperature)}, teacher {opt.qad_teacher}" if "qad" in methods else "")
              + f"; settings: every finetune {ft_set or '-'}, quantization {quant_set or '-'}, QAT {qat_set or '-'}, QAD {qad_set or '-'}; "
              + (f"student {opt.student_preset} {opt.kd_iters} steps, kd_ratio {opt.kd_ratio}, {opt.kd_divergence} at "
                 f"T={opt.kd_temperature}; " if opt.kd_iters else "")
              + f"batch {opt.batch_size} x {opt.block_size}, {opt.dtype}, {opt.seeds} seed(s); "
              f"whole-val-split perplexities, mean ± std over seeds; {time.perf_counter() - t_start:.0f} s\n\n"
              + "\n".join(table) + "\n\n" + "\n".join(notes) + "\n")
    write(opt, "quality" + ft_name + quant_name + qat_name + qad_name + stage, report, results)


# -----------------------------------------------------------------------------
def fake_quant_bytes(quantizer, c, group_size):
    """(bytes per element of a fake-quantized weight, per element of a fake-quantized input) that QAT's
    backward keeps, c bytes per element of the compute dtype: the scripts' fused fake quantizers keep
    each weight's fake-quantized copy and a bool clamp mask, and int8 activation grids (8daNw) a mask
    per input element; torchao's own for 4w-gpu (asymmetric, bf16 scales) four fp32 intermediates per
    weight (and its bf16 result in bfloat16 runs), and per group a scale and zero point twice."""
    if quantizer == "none":
        return 0, 0
    per_weight = 16 + 2 * (c == 2) + 16 / group_size if quantizer == "4w-gpu" else c + 1
    return per_weight, int(quantizer.startswith("8da"))


def activation_bytes(args, c, quantizer="none", group_size=32):
    """Bytes autograd keeps per token for one transformer block's backward, c bytes per element of
    the compute dtype: per token (B*T of them) and per block (the fake-quantized weights QAT's
    forward keeps). Counted with saved_tensors_hooks on CPU (float32 and bfloat16, torch 2.13,
    SDPA's fused kernel: no T x T attention matrix, as on GPUs), exact there for plain training
    and for QAT with the scripts' fake quantizers in eager mode, static scales (learned ones,
    range_learning, keep more). tests/test_bench.py measures them again."""
    d, q, kv, h = args.dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.hidden_dim
    # the block's input, norms' outputs, q, k, v and their RoPE'd copies, the attention output,
    # w1/w3/silu/product; bf16 runs also keep the fp32 intermediates of RMSNorm and RoPE;
    # attention's log-sum-exp and the norms' reciprocal RMS in fp32
    per_token = c * (4 * d + 4 * q + 2 * kv + 4 * h) + (2 * (d + q) if c == 2 else 0) + 4 * args.n_heads + 8
    per_weight, per_input = fake_quant_bytes(quantizer, c, group_size)
    if per_input:  # a clamp mask per fake-quantized input (q/k/v and w1/w3 share theirs), and one more
        # block-input-wide tensor
        per_token += per_input * (2 * d + q + h) + c * d
    return per_token, per_weight * (2 * d * q + 2 * d * kv + 3 * d * h)


def memory_plan(args, nproc, batch_size, block_size, dtype, mixed_precision=False, activation_checkpointing=False,
                quantizer="none", replicate_degree=1, group_size=32):
    """Per-rank bytes of one training step with FSDP2 sharding over nproc / replicate_degree
    processes, from the shapes alone (a model on the meta device: nothing is allocated), QAT with
    every linear layer fake-quantized, the output layer too (quant_skip empty)."""
    with torch.device("meta"):
        model = Transformer(args)
    n_params = sum(p.numel() for p in model.parameters())  # a tied output is counted once
    block_params = sum(p.numel() for p in model.layers[0].parameters())
    shard = nproc // replicate_degree
    c = 4 if dtype == "float32" else 2  # compute dtype
    master = 4 if dtype == "float32" or mixed_precision else 2  # parameters, gradients, AdamW moments
    tokens = batch_size * block_size
    per_token, per_block = activation_bytes(args, c, quantizer, group_size)
    L = args.n_layers
    if activation_checkpointing:  # each block's input, plus one block recomputed at a time
        acts = L * tokens * c * args.dim + tokens * per_token + per_block
    else:
        acts = L * (tokens * per_token + per_block)
    chunk = min(tokens, LOGITS_PER_CHUNK // args.vocab_size)
    per_weight, per_input = fake_quant_bytes(quantizer, c, group_size)
    return {
        "parameters": n_params * master / shard,
        "gradients": n_params * master / shard,
        "optimizer": 2 * n_params * master / shard,
        # FSDP gathers a block (and prefetches the next) in the compute dtype; the root keeps the
        # output layer gathered through forward and backward
        "gathered weights": 2 * block_params * c + args.vocab_size * args.dim * c,
        "activations": acts,
        # the final hidden states, and one chunk of fp32 logits with their gradient; under QAT what the
        # output layer's fake quant keeps for a chunk's backward (each chunk's recomputed in turn)
        "loss": tokens * args.dim * c + 2 * chunk * args.vocab_size * 4
                + per_weight * args.vocab_size * args.dim + per_input * chunk * args.dim,
    }


def memory(opt):
    if opt.quantizer not in ("none", "4w-gpu") and not re.fullmatch(r"(8da)?[2-8]w", opt.quantizer):
        sys.exit(f"bench: --quantizer {opt.quantizer!r} is unknown; use none, 8daNw, Nw (N from 2 to 8) or 4w-gpu")
    # the vocabulary: the preset's (a real model's), or the one the scripts take from the data
    vocab = PRESETS[opt.preset].get("vocab_size") or opt.vocab_size
    if not vocab:
        meta = os.path.join(opt.data_dir, "meta.json")
        if not os.path.exists(meta):
            sys.exit(f"bench: --preset {opt.preset} takes its vocabulary from the data, and {opt.data_dir} has none; "
                     f"give --vocab_size or --data_dir")
        with open(meta) as f:
            vocab = json.load(f)["vocab_size"]
    elif opt.vocab_size and opt.vocab_size != vocab:
        sys.exit(f"bench: --preset {opt.preset} has a vocabulary of {vocab}; drop --vocab_size")
    args = ModelArgs(**{**PRESETS[opt.preset], "vocab_size": vocab, **{k: v for k, v in (
        ("n_layers", opt.n_layer), ("dim", opt.n_embd), ("n_heads", opt.n_head), ("n_kv_heads", opt.n_kv_head)) if v is not None}})
    rows = ["| dtype | activation checkpointing | QAT | parameters | gradients | AdamW | gathered | activations | loss | total per rank |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for dtype, mixed in (("bfloat16", True), ("bfloat16", False)):
        for ac in (False, True):
            plan = memory_plan(args, opt.nproc, opt.batch_size, opt.block_size, dtype, mixed, ac, opt.quantizer,
                               opt.replicate_degree, opt.group_size)
            gb = {k: v / 2 ** 30 for k, v in plan.items()}
            rows.append(f"| {'bf16 + fp32 master' if mixed else 'bf16'} | {'every block' if ac else 'off'} | "
                        f"{opt.quantizer} | " + " | ".join(f"{v:.1f}" for v in gb.values()) + f" | **{sum(gb.values()):.1f}** |")
    report = (f"Memory plan, GiB per rank: {opt.preset}, vocabulary {vocab}, {opt.nproc} process(es) (shards of "
              f"{opt.nproc // opt.replicate_degree}), batch {opt.batch_size} x {opt.block_size} per process, "
              f"{opt.quantizer} g{opt.group_size} on every linear layer, the output too, static scales; allocator overhead "
              f"and CUDA context not included\n\n"
              + "\n".join(rows) + "\n")
    write(opt, f"memory_{opt.preset}_{opt.nproc}", report, {"options": vars(opt)})



def deploy(opt):
    import logging

    logging.getLogger("torchao").setLevel(logging.ERROR)
    import torch
    import torchao  # noqa: F401  (registers the quantized tensor types quantized.pt holds)

    from checkpoint import ExecuTorchModel, export_executorch, load_checkpoint
    from data_prep import tokenizer_mismatch
    from model import Transformer

    qat_dir = opt.qat_dir
    if qat_dir is None:
        qat_dir = os.path.join(opt.out_dir, "deploy")
        run("qat_train.py", {"data_dir": opt.data_dir, "preset": opt.preset, **shape_args(opt), "batch_size": opt.batch_size,
                             "block_size": opt.block_size, "max_iters": opt.base_iters, "quantizer": "8da4w",
                             "group_size": opt.group_size, "export_format": "pte"}, qat_dir)
    for name in ("ckpt.pt", "quantized.pt"):
        if not os.path.exists(os.path.join(qat_dir, name)):
            sys.exit(f"error: {os.path.join(qat_dir, name)} is missing; give --qat_dir of a finished qat_train.py run with a quantizer")
    with open(os.path.join(opt.data_dir, "meta.json")) as f:
        data_meta = json.load(f)
    trained = torch.load(os.path.join(qat_dir, "quantized.pt"), map_location="cpu", mmap=True, weights_only=False).get("tokenizer")
    if trained and data_meta.get("tokenizer") and (diff := tokenizer_mismatch(trained, data_meta["tokenizer"])):
        sys.exit(f"error: {opt.data_dir} was tokenized with another tokenizer than {qat_dir}'s model ({diff}); its losses "
                 f"would compare unrelated tokens")
    models = {}
    for label, name in (("full precision", "ckpt.pt"), ("converted", "quantized.pt")):
        args, state = load_checkpoint(os.path.join(qat_dir, name))
        args.tie_embeddings = False
        with torch.device("meta"):
            models[label] = Transformer(args)
        models[label].load_state_dict(state, assign=True)
        models[label].reset_buffers("cpu")
        models[label].eval()
    # the full-precision file without the optimizer state ckpt.pt carries (what one would ship), and the
    # converted model as an ExecuTorch program, exported here: a model.pte in qat_dir may stand for another model
    files_dir = os.path.join(opt.out_dir, "deploy_files")
    os.makedirs(files_dir, exist_ok=True)
    fp_file, pte = os.path.join(files_dir, "fp_model.pt"), os.path.join(files_dir, "model.pte")
    torch.save(models["full precision"].state_dict(), fp_file)
    export_executorch(models["converted"], pte)
    et = ExecuTorchModel(pte)
    files = {"full precision": fp_file, "converted": os.path.join(qat_dir, "quantized.pt"), "executorch": pte}

    if data_meta.get("packed"):  # padded rows with masks and positions: not one stream to slide over
        sys.exit(f"error: {opt.data_dir} holds packed prompt/response samples; give --data_dir of plain text data")
    val = np.fromfile(os.path.join(opt.data_dir, "val.bin"), dtype=data_meta["dtype"]).astype(np.int64)  # uint32 past 65,536 ids
    T = min(opt.block_size, et.max_seq_len)
    windows = [torch.from_numpy(val[i:i + T + 1])[None] for i in range(0, len(val) - T, T)][:opt.eval_windows]
    prompt = torch.from_numpy(val[:opt.prompt_tokens])[None]
    n_new = min(opt.new_tokens, et.max_seq_len - prompt.shape[1])

    def generate(label, n):
        if label == "executorch":
            return et.generate(prompt, n)
        return models[label].generate(prompt, n, temperature=0)

    def val_loss(label, w):
        x, y = w[:, :-1], w[:, 1:]
        logits = et(x, torch.arange(x.shape[1])) if label == "executorch" else models[label](x)
        return torch.nn.functional.cross_entropy(logits[0].float(), y[0]).item()

    if n_new < 2:
        sys.exit(f"error: {n_new} new tokens leave no decoding to time past the first; raise --new_tokens")

    def decode_rate(label):
        """tokens/s of decoding alone: an n_new-token call less a 1-token one (prefill and the first
        step), timed back to back; a pair whose difference noise erased is timed again"""
        for _ in range(5):
            t0 = time.perf_counter()
            generate(label, 1)
            t1 = time.perf_counter()
            generate(label, n_new)
            t2 = time.perf_counter()
            if (decoding := (t2 - t1) - (t1 - t0)) > 0:
                return (n_new - 1) / decoding
        sys.exit(f"error: {label}: {n_new} tokens took no longer to generate than 1, five times; raise --new_tokens")

    labels = list(files)
    rates, losses = {k: [] for k in labels}, {k: [] for k in labels}
    with torch.no_grad():
        for label in labels:  # untimed: a first call's one-time costs would land in the 1-token timing
            generate(label, 1), generate(label, n_new)
        for _ in range(opt.rounds):
            for label in labels:  # interleaved: a busy moment on a shared machine hits every format alike
                rates[label].append(decode_rate(label))
        for w in windows:
            for label in labels:
                losses[label].append(val_loss(label, w))
    results = [{"format": k, "file_mb": os.path.getsize(files[k]) / 1e6, "decode_tokens_per_sec": statistics.median(rates[k]),
                "val_loss": statistics.mean(losses[k])} for k in labels]
    fp_mb = results[0]["file_mb"]
    table = [f"| format | file MB | vs full precision | decode tokens/s (batch 1, {n_new} tokens) | val loss ({len(windows)} x {T}) |",
             "|---|---|---|---|---|"]
    table += [f"| {r['format']} | {r['file_mb']:.2f} | {100 * r['file_mb'] / fp_mb:.0f}% | {r['decode_tokens_per_sec']:.0f} | "
              f"{r['val_loss']:.4f} |" for r in results]
    write(opt, "deploy", "\n".join(table) + "\n", {"qat_dir": qat_dir, "rounds": opt.rounds, "new_tokens": n_new, "results": results})


def small_train_copy(data_dir, out, n_tokens):
    """The data with its train split cut to n_tokens (0: whole), its fingerprint recomputed: a store
    covers every train window, more than a short benchmark trains on."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("has_mask") or meta.get("has_pos"):
        sys.exit("bench kd: give plain (unmasked, unpacked) data")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for name in ("train.bin", "val.bin"):
        with open(os.path.join(data_dir, name), "rb") as f:
            data = f.read(n_tokens * itemsize) if name == "train.bin" and n_tokens else f.read()
        with open(os.path.join(out, name), "wb") as g:
            g.write(data)
        meta["data"][name] = file_fingerprint(data)
    for name in (meta.get("tokenizer") or {}).get("files", []):  # the tokenizer travels with the data
        shutil.copy(os.path.join(data_dir, name), os.path.join(out, name))
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f)
    return out


def kd(opt):
    out = os.path.join(opt.out_dir, "kd")
    data_dir = small_train_copy(opt.data_dir, os.path.join(out, "data"), opt.kd_train_tokens)
    common = dict(data_dir=data_dir, batch_size=opt.batch_size, block_size=opt.block_size, device=opt.device,
                  dtype=opt.dtype, eval_interval=10 ** 9, eval_iters=1, log_interval=1, ckpt_interval=10 ** 9)
    t_start = time.perf_counter()
    base_ckpt = opt.base_ckpt or os.path.join(out, "base", "ckpt.pt")
    if not opt.base_ckpt:
        print(f"teacher: {opt.preset}, {opt.base_iters} steps")
        run("qat_train.py", {**common, "preset": opt.preset, **shape_args(opt), "quantizer": "none", "max_iters": opt.base_iters,
                             "learning_rate": opt.base_lr, "min_lr": opt.base_lr / 10, "warmup_iters": max(1, opt.base_iters // 20),
                             "seed": 1, "log_interval": 50}, os.path.join(out, "base"), quiet=False)
    ks = [int(k) for k in opt.ks.split(",")]
    stores, bytes_per_token = {}, {}
    for k in ks:
        stores[k] = os.path.join(out, f"store_{k}")  # a complete store of this data and teacher is kept
        t0 = time.perf_counter()
        args = {**{k: v for k, v in common.items() if k not in TRAINING_ONLY}, "teacher_init": base_ckpt, "topk_write": True, "teacher_topk": k, "teacher_topk_dir": stores[k],
                "kd_temperature": opt.kd_temperature, "out_dir": os.path.join(out, f"write_{k}")}
        proc = subprocess.run([sys.executable, os.path.join(HERE, "kd_train.py")] + [f"--{a}={v}" for a, v in args.items()],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # a write keeps no log.jsonl
        if proc.returncode:
            sys.exit(f"bench: writing {stores[k]} failed:\n{proc.stdout[-3000:]}")
        with open(os.path.join(stores[k], "meta.json")) as f:
            meta = json.load(f)
        bytes_per_token[k] = k * (np.dtype(meta["ids_dtype"]).itemsize + 2)  # ids + float16 log-probs
        print(f"  top-{k} store: {time.perf_counter() - t0:.0f} s, {bytes_per_token[k]} bytes per token")
    student = {**common, "teacher_init": base_ckpt, "init_from": "scratch", "preset": opt.student_preset,
               "learning_rate": opt.kd_lr, "min_lr": opt.kd_lr / 10, "kd_ratio": opt.kd_ratio,
               "kd_divergence": opt.kd_divergence, "kd_temperature": opt.kd_temperature}
    variants = [("online", {})] + [(f"top{k}", {"teacher_topk_dir": stores[k]}) for k in ks]
    # speed: short runs, interleaved in rounds; the plain step is qat_train.py's (no teacher at all)
    times = {name: [] for name in ["plain"] + [v for v, _ in variants]}
    tokens_step = opt.batch_size * opt.block_size
    short = {**student, "max_iters": opt.warmup + opt.steps, "warmup_iters": 1}
    for r in range(opt.rounds):
        for name, extra in [("plain", None)] + variants:
            if extra is None:
                args = {k: v for k, v in short.items() if not k.startswith(("teacher", "kd_"))}
                recs = run("qat_train.py", {**args, "quantizer": "none"}, os.path.join(out, "speed_plain"))
            else:
                recs = run("kd_train.py", {**short, **extra}, os.path.join(out, f"speed_{name}"))
            times[name] += [tokens_step / x["tokens_per_sec"] for x in recs if "loss" in x][opt.warmup:]
        print(f"round {r + 1}/{opt.rounds}: " + "  ".join(f"{n} {1e3 * statistics.median(t):.1f}" for n, t in times.items()) + " ms/step")
    # quality: CE alone vs online KD vs KD from each store, same steps, data and windows
    long = {**student, "max_iters": opt.kd_iters, "warmup_iters": max(1, opt.kd_iters // 10), "log_interval": 50}
    losses = {name: [] for name in ["ce"] + [v for v, _ in variants]}
    with open(os.path.join(stores[ks[0]], "meta.json")) as f:
        teacher_loss = json.load(f)["teacher_val_loss"]
    for seed in range(opt.seeds):
        for name, extra in [("ce", {"kd_ratio": 0.0})] + variants:
            args = {k: v for k, v in long.items() if name != "ce" or k not in ("kd_divergence", "kd_temperature")}  # kd_ratio 0 refuses them
            res = summary(run("kd_train.py", {**args, **extra, "seed": seed}, os.path.join(out, f"s{seed}_{name}")))
            losses[name].append(res["fp_val_loss"])
        print(f"seed {seed}: " + "  ".join(f"{n} {v[-1]:.4f}" for n, v in losses.items()) + f"  teacher {teacher_loss:.4f}")

    def pm(xs):
        return f"{100 * statistics.mean(xs):.0f}% ± {100 * (statistics.stdev(xs) if len(xs) > 1 else 0):.0f}"

    plain = statistics.median(times["plain"])
    closed = {n: [(c - x) / (c - teacher_loss) for c, x in zip(losses["ce"], losses[n])] for n, _ in variants}
    rows, results = [], []
    for name in ["plain"] + [v for v, _ in variants]:
        t = statistics.median(times[name])
        res = {"step": name, "ms_per_step": 1e3 * t, "ratio_to_plain": t / plain}
        if not opt.seeds:  # speed only
            quality_cells = "- | - | -"
        elif name != "plain":
            rel = [s / o for s, o in zip(closed[name], closed["online"])]  # per seed: a share of online's share
            res.update(val_loss=losses[name], gap_closed=closed[name], of_online=rel)
            quality_cells = f"{statistics.mean(losses[name]):.4f} | {pm(closed[name])} | {pm(rel)}"
        else:
            quality_cells = f"{statistics.mean(losses['ce']):.4f} (CE only) | 0% | -"
        bytes_cell = f"{bytes_per_token[int(name[3:])]}" if name.startswith("top") else "-"
        rows.append(f"| {name} | {1e3 * t:.1f} | {t / plain:.2f}x | {bytes_cell} | {quality_cells} |")
        results.append(res)
    table = ["| step | ms/step | vs plain CE | store bytes/token | val loss | gap closed | of online's |",
             "|---|---|---|---|---|---|---|"] + rows
    report = (f"KD from a stored top-k: teacher {opt.base_ckpt or opt.preset} (val loss {teacher_loss:.4f}), student "
              f"{opt.student_preset}, {opt.kd_divergence} at T={opt.kd_temperature}, kd_ratio {opt.kd_ratio}, {opt.kd_iters} steps "
              f"of {opt.batch_size} x {opt.block_size}, {opt.dtype} on {opt.device}, train split {opt.kd_train_tokens or 'whole'} "
              f"tokens; speed: median of {opt.steps} steps x {opt.rounds} interleaved rounds after {opt.warmup}; quality: "
              f"{opt.seeds} seed(s), mean ± std; {time.perf_counter() - t_start:.0f} s\n\n" + "\n".join(table) + "\n")
    write(opt, "kd", report, {"options": vars(opt), "teacher_val_loss": teacher_loss, "results": results})


def write(opt, name, report, data):
    """The report as NAME_TAG.md and .json, TAG a digest of the options: a second run of other options
    (schemes, seeds, a base, a learning rate) in the same out_dir writes beside the first, not over it."""
    tag = hashlib.sha256(json.dumps({k: v for k, v in vars(opt).items() if k != "out_dir"}, sort_keys=True).encode())
    name = f"{name}_{tag.hexdigest()[:8]}"
    if REUSED_FROM_OTHER:
        report += "\nReused, though not run by this checkout's code and library versions:\n" + "".join(
            f"- {r}\n" for r in REUSED_FROM_OTHER)
        data = {**data, "reused_from_other_code": REUSED_FROM_OTHER}
    os.makedirs(opt.out_dir, exist_ok=True)
    with open(os.path.join(opt.out_dir, f"{name}.md"), "w") as f:
        f.write(report)
    with open(os.path.join(opt.out_dir, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1)
    print("\n" + report)
    print(f"written to {opt.out_dir}/{name}.md and {name}.json")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("speed", "quality", "memory", "deploy", "kd"))
    p.add_argument("--data_dir", default="data/stdlib")
    p.add_argument("--out_dir", default="out/bench")
    p.add_argument("--device", default="cpu")
    p.add_argument("--nproc", type=int, default=1, help="processes (torchrun) per run")
    p.add_argument("--preset", default="tiny", help="model preset (model.PRESETS), or 'torchtune' for the comparison shape")
    p.add_argument("--n_layer", type=int)
    p.add_argument("--n_embd", type=int)
    p.add_argument("--n_head", type=int)
    p.add_argument("--n_kv_head", type=int)
    p.add_argument("--batch_size", type=int, default=16, help="micro-batch per process")
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--group_size", type=int, default=32)
    p.add_argument("--peak_flops", type=float, help="per-device peak FLOP/s, overriding the measured or table value")
    p.add_argument("--replicate_degree", type=int, default=1, help="memory: HSDP replicas (shards over nproc / this)")
    # speed
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--compile", default="0,1", help="compile modes to run: 0 eager, 1 compiled")
    p.add_argument("--quantizer", default="8da4w")
    p.add_argument("--steps_of", default="plain,qat,kd,qad", help="speed: the steps to time (plain always)")
    p.add_argument("--vocab_size", type=int, help="speed: time on random tokens of this vocabulary instead of "
                                                  "--data_dir's text, e.g. Llama 3's 128256; memory: the vocabulary of a "
                                                  "preset that takes it from the data (default: --data_dir's)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps per run (compilation happens here)")
    p.add_argument("--rounds", type=int, default=2)
    # quality
    p.add_argument("--dtype", default="float32")
    p.add_argument("--schemes", default="8da4w,8da2w")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--base_iters", type=int, default=600)
    p.add_argument("--base_ckpt", help="reuse this base model instead of training one")
    p.add_argument("--base_lr", type=float, default=2e-3)
    p.add_argument("--ft_iters", type=int, default=100)
    p.add_argument("--ft_lr", type=float, default=3e-4)
    # the defaults that won on both seeds and both base sizes (README, "Quality")
    p.add_argument("--qad_kd_ratio", type=float, default=0.5, help="QAD's kd_ratio")
    p.add_argument("--qad_kd_temperature", type=float, default=2.0, help="QAD's kd_temperature")
    p.add_argument("--range_learning", type=int, default=0,
                   help="1: QAT and QAD learn the weight scales (range_learning; it helped at 2 bits and hurt QAT at 4)")
    p.add_argument("--qad_teacher", choices=("base", "plain"), default="base",
                   help="QAD's teacher: the base model, or the same seed's plain full-precision finetune")
    p.add_argument("--start", choices=("base", "plain"), default="base",
                   help="where QAT and QAD start: the base, as the plain finetune does (the same steps from the same model), "
                        "or the same seed's plain finetune (a quantization stage of --ft_iters more steps after it, on the batches "
                        "of seed + 1000, beside the same steps of it in full precision)")
    p.add_argument("--gptq_tokens", type=int, default=0,
                   help="quality: also score GPTQ of each plain finetune over this many train tokens (qat_train's gptq_tokens), "
                        "the PTQ a 4-bit QAT run has to beat")
    p.add_argument("--methods", default="qat,qad",
                   help="quality: the quantization-aware finetunes to run (qat, qad, or none), and kd: beside qad, the same "
                        "distillation in full precision, PTQ of it, and QAD's recovery counted against that")
    p.add_argument("--ft_set", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of every finetune, the plain one included (which --qat_set / --qad_set then "
                        "override), e.g. beta2=0.999; its runs are named apart from the default's; repeatable")
    p.add_argument("--quant_set", action="append", default=[], metavar="KEY=VALUE",
                   help="a quantization setting for PTQ, QAT and QAD alike, e.g. \"quant_skip=('output',)\"; repeatable")
    p.add_argument("--qat_set", action="append", default=[], metavar="KEY=VALUE",
                   help="a qat_train.py setting for the QAT runs alone, e.g. learning_rate=1e-3 (with min_lr=1e-4: "
                        "the finetunes' min_lr is ft_lr / 10); repeatable")
    p.add_argument("--qad_set", action="append", default=[], metavar="KEY=VALUE",
                   help="a kd_train.py setting for the QAD runs alone, e.g. kd_temperature=2.0 or kd_divergence=jsd; "
                        "repeatable. Runs whose arguments match a finished run in out_dir are reused")
    p.add_argument("--student_preset", default="tiny-student")
    p.add_argument("--kd_iters", type=int, default=300, help="0 skips the KD comparison")
    p.add_argument("--kd_lr", type=float, default=2e-3)
    p.add_argument("--kd_ratio", type=float, default=0.9, help="the KD student's kd_ratio (0.9 closed the most of its gap)")
    p.add_argument("--qat_dir", help="deploy: a finished qat_train.py run to measure; default: train --preset for --base_iters")
    p.add_argument("--new_tokens", type=int, default=200, help="deploy: tokens decoded per timing")
    p.add_argument("--prompt_tokens", type=int, default=16)
    p.add_argument("--eval_windows", type=int, default=20, help="deploy: validation windows of block_size")

    # kd (also --preset, --base_*, --student_preset, --kd_*, --seeds, --dtype, --steps, --warmup, --rounds)
    p.add_argument("--ks", default="8,16,32,64", help="top-k stores to compare")
    p.add_argument("--kd_divergence", default="fkl")
    p.add_argument("--kd_temperature", type=float, default=1.0)
    p.add_argument("--kd_train_tokens", type=int, default=2 ** 18, help="train split cut to this many tokens (0: whole)")
    opt = p.parse_args()
    # what each mode reads: another option given to it would be ignored without a word (deploy measures
    # 8da4w in float32 on this machine's CPU, kd one process; quality takes its schemes, not --quantizer)
    shape = {"preset", "n_layer", "n_embd", "n_head", "n_kv_head", "batch_size", "block_size", "out_dir"}
    reads = {"speed": shape | {"data_dir", "device", "nproc", "group_size", "peak_flops", "dtypes", "compile", "quantizer",
                               "steps_of", "vocab_size", "steps", "warmup", "rounds"},
             "memory": shape | {"nproc", "quantizer", "group_size", "replicate_degree", "vocab_size", "data_dir"},
             "quality": shape | {"data_dir", "device", "nproc", "group_size", "dtype", "schemes", "seeds", "base_iters",
                                 "base_ckpt", "base_lr", "ft_iters", "ft_lr", "qad_kd_ratio", "qad_kd_temperature",
                                 "range_learning", "qad_teacher", "start", "gptq_tokens", "methods", "ft_set", "quant_set", "qat_set",
                                 "qad_set", "student_preset", "kd_iters", "kd_lr", "kd_ratio", "kd_divergence",
                                 "kd_temperature"},
             "deploy": shape | {"data_dir", "base_iters", "group_size", "qat_dir", "new_tokens", "prompt_tokens",
                                "eval_windows", "rounds"},
             "kd": shape | {"data_dir", "device", "dtype", "base_ckpt", "base_iters", "base_lr", "seeds", "steps", "warmup",
                            "rounds", "student_preset", "kd_iters", "kd_lr", "kd_ratio", "kd_divergence", "kd_temperature",
                            "kd_train_tokens", "ks"}}[opt.mode]
    if unread := [k for k in vars(opt) if k not in reads | {"mode"} and getattr(opt, k) != p.get_default(k)]:
        p.error(f"{opt.mode} does not read {', '.join('--' + k for k in unread)}")
    opt.preset_is_torchtune = opt.preset == "torchtune"
    if opt.preset_is_torchtune:  # the shape torchtune's recipe was measured with
        if fixed := [k for k in ("n_layer", "n_embd", "n_head", "n_kv_head", "batch_size", "block_size")
                     if getattr(opt, k) != p.get_default(k)]:
            p.error(f"--preset torchtune sets the shape torchtune was measured with; drop {', '.join('--' + k for k in fixed)}")
        opt.preset, opt.n_layer, opt.n_embd, opt.n_head, opt.n_kv_head = "tiny", 4, 256, 4, 4
        opt.batch_size, opt.block_size = 4, 256
    if opt.base_ckpt and shape_args(opt):
        p.error("--n_layer/--n_embd/--n_head/--n_kv_head shape a new base model; --base_ckpt carries its own shape")
    if opt.preset not in PRESETS:
        p.error(f"--preset {opt.preset!r} is unknown; choose from {sorted(PRESETS)} or 'torchtune'")
    steps_of = opt.steps_of.split(",")
    if "plain" not in steps_of or set(steps_of) - {"plain", "qat", "kd", "qad"} or len(set(steps_of)) < len(steps_of):
        p.error(f"--steps_of {opt.steps_of!r}: name each of plain (the reference, always), qat, kd, qad at most once")
    if opt.mode == "memory":
        if opt.replicate_degree < 1 or opt.nproc % opt.replicate_degree:
            p.error(f"--replicate_degree {opt.replicate_degree} must divide --nproc {opt.nproc}, as the scripts require")
        sys.exit(memory(opt))
    if opt.vocab_size is not None and opt.vocab_size < 2:
        p.error(f"--vocab_size {opt.vocab_size}: a vocabulary needs 2 tokens at least")
    if not opt.vocab_size and not os.path.exists(os.path.join(opt.data_dir, "meta.json")):
        p.error(f"{opt.data_dir} has no prepared data; run python data_prep.py first")
    {"speed": speed, "quality": quality, "deploy": deploy, "kd": kd}[opt.mode](opt)
