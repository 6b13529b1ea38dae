"""Helpers for the training-script tests: tiny token data on disk, a script run as `python` or
`torchrun`, its log.jsonl read back. Import them with `from conftest import make_data, run, read_log`."""

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def corpus(n_tokens, vocab_size=256, n_patterns=16, seed=0):
    """A learnable token stream: random patterns of 4 to 12 tokens, repeated in random order."""
    rng = np.random.default_rng(seed)
    patterns = [rng.integers(3, vocab_size, size=rng.integers(4, 13)) for _ in range(n_patterns)]
    out, n = [], 0
    while n < n_tokens:
        out.append(patterns[rng.integers(n_patterns)])
        n += len(out[-1])
    return np.concatenate(out)[:n_tokens]


def make_data(path, vocab_size=256, train_tokens=8192, val_tokens=1536, seed=0, train=None, val=None,
              train_mask=None, val_mask=None, tokenizer_id="synthetic-0"):
    """Writes train.bin, val.bin and meta.json as data_prep.py does into the directory path (token
    arrays default to one corpus() cut in two), plus {split}_mask.bin and has_mask=True when masks
    (1 = trained on, aligned with the tokens) are given. Returns path as a str."""
    os.makedirs(path, exist_ok=True)
    if train is None or val is None:
        tokens = corpus(train_tokens + val_tokens, vocab_size, seed=seed)
        train = tokens[:train_tokens] if train is None else train
        val = tokens[train_tokens:] if val is None else val
    assert max(np.max(train), np.max(val)) < vocab_size
    np.asarray(train, dtype=np.uint16).tofile(os.path.join(path, "train.bin"))
    np.asarray(val, dtype=np.uint16).tofile(os.path.join(path, "val.bin"))
    has_mask = train_mask is not None
    if has_mask:
        for split, tokens, mask in (("train", train, train_mask), ("val", val, val_mask)):
            assert mask is not None and len(mask) == len(tokens)
            np.asarray(mask, dtype=np.uint8).tofile(os.path.join(path, f"{split}_mask.bin"))
    # fingerprints as data_prep.py writes them: of the files, and of a (here imaginary) tokenizer
    files = {f: {"bytes": os.path.getsize(os.path.join(path, f)),
                 "sha256": hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest()}
             for f in sorted(os.listdir(path)) if f.endswith(".bin")}
    tokenizer = {"kind": "synthetic", "sha256": tokenizer_id, "bos_id": None, "eos_id": 2, "vocab_size": vocab_size,
                 "files": []}
    meta = {"vocab_size": vocab_size, "dtype": "uint16", "eos_id": 2, "has_mask": has_mask, "tokenizer": tokenizer,
            "data": files}
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    return str(path)


def _flag(key, value):
    # a text setting takes its text as given; other values' repr round-trips through the configurator's
    # ast.literal_eval (inf has no literal but 1e999)
    if isinstance(value, float) and math.isinf(value):
        return f"--{key}={'-' if value < 0 else ''}1e999"
    if isinstance(value, (str, os.PathLike)):
        return f"--{key}={value}"
    return f"--{key}={value!r}"


def command(script, *args, nproc=1, **settings):
    """argv for `python script` (nproc=1) or `torchrun --standalone` (nproc > 1); settings become
    --key=value flags after the positional args."""
    script = str(ROOT / script)
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, script, *map(str, args), *(_flag(k, v) for k, v in settings.items())]


def script_env(env=None):
    # a plain `python` run must not inherit a launcher's rank variables
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**base, **(env or {})}


def run(script, *args, nproc=1, check=True, env=None, timeout=600, **settings):
    """Runs a script of the repository (cwd = repository root) to completion; returns the
    CompletedProcess (text stdout, stderr). check: assert exit code 0, showing stderr if not."""
    r = subprocess.run(command(script, *args, nproc=nproc, **settings), cwd=ROOT, env=script_env(env),
                       capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"{script} exited {r.returncode}:\n{r.stderr[-4000:]}"
    return r


def run_patched(script, patch, env=None, timeout=600, **settings):
    """Runs a script as run() does (check=False), after the Python statements `patch`: a fault
    injected for the script's own guards to catch."""
    argv = command(script, **settings)[1:]
    code = f"import runpy, sys\nsys.path.insert(0, {str(ROOT)!r})\n{patch}\nsys.argv = {argv!r}\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=script_env(env), capture_output=True, text=True,
                          timeout=timeout)


# a fault for run_patched: the fused fake quantizers pass no gradient to the weights they fake-quantize
# (per group), as a compiler that dropped that edge of the graph would
DETACHED_WEIGHTS = """import model
fake_quantize = model.FusedFakeQuantizer.forward
model.FusedFakeQuantizer.forward = lambda self, x: fake_quantize(self, x.detach() if isinstance(self.config.granularity, model.PerGroup) else x)"""

# another: the fake quant's backward passes zero gradients, as the in-place form compiled by torch 2.11
# did (pytorch/pytorch#180642), so that no weight trained on a GPU and nothing said so
ZEROED_GRADIENTS = """import model, torch
model._FakeQuantize.backward = staticmethod(lambda ctx, grad: (torch.zeros_like(grad), None, None, None, None))"""

# for run_patched: the run ends, as a kill would, right after it writes its first checkpoint
STOP_AFTER_CHECKPOINT = """import checkpoint, os
save = checkpoint.save_training_checkpoint
def save_and_stop(*args, **kwargs):
    save(*args, **kwargs)
    os._exit(0)
checkpoint.save_training_checkpoint = save_and_stop"""


# runs a script several times in one interpreter, so torch and torchao are imported once
_DRIVER = r"""
import contextlib, io, json, os, runpy, sys, traceback
import torch.distributed as dist
script, runs = sys.argv[1], json.load(sys.stdin)
sys.path.insert(0, os.path.dirname(script))
results = []
for argv, env in runs:
    saved_env = dict(os.environ)
    os.environ.update(env)
    sys.argv = [script, *argv]
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
    if dist.is_initialized():  # the scripts' fail() leaves none; a traceback would, and break the next run
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved_env)
    results.append((code, out.getvalue(), err.getvalue()))
print(json.dumps(results))
"""


def run_early_exits(script, runs, timeout=600):
    """Runs script once per (settings, env) in runs, all in one fresh Python process: a few
    seconds of imports instead of a few per run. Only for runs that stop before any real work
    (errors in the settings and files: a process group of one at most, no training). Returns a CompletedProcess per run, its
    returncode the SystemExit code (1 for an uncaught exception, whose traceback is in stderr)."""
    argvs = [(command(script, **settings)[2:], env or {}) for settings, env in runs]
    r = subprocess.run([sys.executable, "-c", _DRIVER, str(ROOT / script)], input=json.dumps(argvs), cwd=ROOT,
                       env=script_env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return [subprocess.CompletedProcess(argv, code, out, err)
            for (argv, _), (code, out, err) in zip(argvs, json.loads(r.stdout.splitlines()[-1]))]


def read_log(out_dir, name="log.jsonl"):
    """The records of out_dir/log.jsonl, in order."""
    with open(os.path.join(out_dir, name)) as f:
        return [json.loads(line) for line in f if line.strip()]
