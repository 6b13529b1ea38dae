"""
Override a training script's config globals from config files and --key=value flags.

A script defines its settings as plain globals (int/float/bool/str/tuple/None), then calls
configure() once, before any expensive work:

    batch_size = 12      # micro-batch size per process
    compile = True       # use torch.compile
    ...
    from configurator import configure
    config, overridden = configure(globals(), positive=("batch_size",))
    # config: the final {key: value}, for logging and checkpoints; overridden: the keys whose
    # value differs from the script's default

    $ python qat_train.py config/tiny.py --batch_size=8 --compile=False

Arguments apply left to right, so later ones win. A positional argument is a Python file
exec'd with the current settings in scope; the settings it assigns are copied back (modules,
functions, classes and _private names it defines are ignored). A --key=value flag is split on
the first "=": a setting whose default is a str takes the text after it as given (quotes too),
any other's is parsed with ast.literal_eval, falling back to the raw string. Unknown keys and
values whose type does not match the default are errors, and so are negative numbers (every
numeric setting here is a count, a size, a rate or a seed), infinite ones but for
MAY_BE_INFINITE's, and zero for the settings named `positive`. -h/--help lists the settings.
The master process prints the settings that differ from their defaults. apply_config() raises
ConfigError (for tests); configure() prints it and exits 2.
"""

import ast
import builtins
import difflib
import hashlib
import importlib.util
import json
import math
import os
import re
import sys
import types

import torch

CONFIG_TYPES = (int, float, bool, str, tuple, type(None))


class ConfigError(Exception):
    pass


def config_keys(globals_dict):
    """The settings a script defines: public globals holding plain values, in script order.
    UPPER_CASE names are constants (often imported, like IGNORE_INDEX), not settings."""
    return [k for k, v in globals_dict.items()
            if not k.startswith("_") and not k.isupper() and isinstance(v, CONFIG_TYPES)]


def _unknown(key, keys, path=None):
    dashes = "" if path else "--"  # name it the way the user wrote it
    close = difflib.get_close_matches(key, keys, n=1)
    hint = f"did you mean {dashes}{close[0]}?" if close else "run with --help to list the settings."
    where = f"config file '{path}' sets unknown setting" if path else "unknown setting"
    return ConfigError(f"{where} {dashes}{key}; {hint}")


def _convert(value, default, raw, where):
    """Return value converted to the default's type, or raise. raw is the CLI text, if any."""
    if type(default) is tuple and type(value) in (tuple, list):  # of the default's items' type; names if it has none
        if not all(type(v) is (kind := type(default[0]) if default else str) for v in value):
            raise ConfigError(f"{where} expects a tuple of {kind.__name__} (default {default!r}), got {value!r}")
        return tuple(value)
    if default is None or type(value) is type(default):
        return value  # a None default means "no type": anything goes
    # exact types on purpose: bool subclasses int, yet True is no batch size and 1 no flag
    if type(default) is float and type(value) is int:
        return float(value)
    if type(default) is float and raw is not None and raw.strip().lower() in ("inf", "+inf", "-inf", "nan"):
        return float(raw)  # --grad_clip=inf: literal_eval knows no infinity
    raise ConfigError(f"{where} expects {type(default).__name__} (default {default!r}), "
                      f"got {type(value).__name__} {value!r}")


def _check_range(key, value, positive):
    if type(value) not in (int, float):
        return
    if math.isinf(value) and key not in MAY_BE_INFINITE:  # --temperature=1e400 is an overflow, not a setting
        raise ConfigError(f"{key}={value!r} must be finite")
    if value != value or value < 0 or (key in positive and value == 0):
        need = "a positive number" if key in positive else "a number >= 0"
        raise ConfigError(f"{key}={value!r} must be {need}")


def changed(defaults, config):
    """The keys whose value differs from the default (a type change counts: 1 is not 1.0 here)."""
    return [k for k, d in defaults.items() if type(config[k]) is not type(d) or config[k] != d]


def apply_config(globals_dict, keys, argv=None, master_process=None, print_config=True, positive=(), assigned=None):
    """Apply argv (default sys.argv[1:]) to the settings `keys` of globals_dict, in place.

    Returns the final {key: value} in script order. Prints the settings that changed when
    print_config and this is the master process (default: env RANK unset or "0"). Adds to the set
    `assigned`, if given, every key a --key=value or a config file's top-level assignment names,
    whatever the value (a default given explicitly is still a request). Raises ConfigError on bad input.
    """
    assigned = set() if assigned is None else assigned
    argv = sys.argv[1:] if argv is None else argv
    if master_process is None:
        master_process = os.environ.get("RANK", "0") == "0"
    keys = list(keys)
    defaults = {k: globals_dict[k] for k in keys}
    if "-h" in argv or "--help" in argv:
        width = max(map(len, keys), default=0)
        print("usage: python script.py [config_file.py ...] [--key=value ...]\nsettings (default):")
        for k in keys:
            print(f"  {k:<{width}} = {defaults[k]!r}")
        sys.exit(0)

    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise ConfigError(f"expected --key=value, got '{arg}'; add '=' and a value")
            key, raw = arg[2:].split("=", 1)
            if key not in defaults:
                raise _unknown(key, keys)
            if type(defaults[key]) is str:  # text as given: --start='"""Doc."""' keeps its quotes
                value = raw
            else:
                try:
                    value = ast.literal_eval(raw)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    value = raw  # --teacher_init=path: a bare word is a string
            globals_dict[key] = _convert(value, defaults[key], raw, f"--{key}")
            assigned.add(key)
        else:
            if not os.path.isfile(arg):
                raise ConfigError(f"config file '{arg}' not found; check the path")
            with open(arg) as f:
                source = f.read()
            code = compile(source, arg, "exec")
            # the names its top level assigns (x = ..., x: T = ..., x += ...): set, even to their defaults
            for node in ast.parse(source, arg).body:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                    node, (ast.AnnAssign, ast.AugAssign)) else []
                assigned.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and n.id in defaults)
            # a fresh namespace, so the file sees the current settings but cannot clobber
            # the script's imports or helpers; we pick out only the settings afterwards
            ns = {k: globals_dict[k] for k in keys}
            ns.update(__builtins__=builtins, __file__=arg, __name__="__config__")
            exec(code, ns)
            for name, value in ns.items():
                if name.startswith("_") or isinstance(value, types.ModuleType) or callable(value):
                    continue  # import math, def helper(), class X, _tmp: the file's own business
                if name not in defaults:
                    raise _unknown(name, keys, arg)
                globals_dict[name] = _convert(value, defaults[name], None, f"{name} in '{arg}'")

    config = {k: globals_dict[k] for k in keys}
    for k, v in config.items():
        _check_range(k, v, positive)
    if print_config and master_process:
        for k in changed(defaults, config):
            print(f"{k} = {config[k]!r}  (default {defaults[k]!r})")
    return config


def configure(globals_dict, argv=None, print_config=True, positive=()):
    """The call a script makes: config, overridden = configure(globals(), positive=(...)).
    Exits 2 with a one-line error."""
    keys = config_keys(globals_dict)
    defaults = {k: globals_dict[k] for k in keys}
    assigned = set()
    try:
        config = apply_config(globals_dict, keys, argv, print_config=print_config, positive=positive, assigned=assigned)
        # what the run asks for: a changed value, or one given explicitly (the refusals of settings
        # that would be ignored read this, so that --group_size=32 without a quantizer is one too)
        asked = assigned | set(changed(defaults, config))
        return config, [k for k in keys if k in asked]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# the settings whose infinity means something (no clipping); for any other it is refused
MAY_BE_INFINITE = ("grad_clip",)

# the settings that only a run with a quantizer reads (range_lr_ratio needs range_learning too)
QUANTIZER_ONLY = ("group_size", "fake_quant_after_n_steps", "quantize_embedding", "quant_skip", "range_learning")

# the settings of the training loop alone, which a run that trains nothing (qat_train's convert_only,
# kd_train's topk_write) refuses on its command line
TRAINING_ONLY = ("max_iters", "learning_rate", "min_lr", "lr_decay_iters", "warmup_iters", "weight_decay", "beta1", "beta2",
                 "grad_clip", "optimizer_in_bwd", "range_lr_ratio", "norm_lr_ratio", "gradient_accumulation_steps", "accumulate_unsharded",
                 "eval_interval", "eval_iters", "log_interval", "ckpt_interval", "sharded_checkpoint", "fake_quant_after_n_steps",
                 "activation_checkpointing", "activation_offloading", "profile", "profile_wait", "profile_warmup",
                 "profile_active", "peak_flops_per_device", "seed", "ema_decay")


def command_line_keys(argv=None):
    """The keys of the --key=value arguments in argv (default sys.argv[1:]): what this command asks
    for, apart from its config files, which describe a whole job and may be shared between modes."""
    return {a[2:].partition("=")[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}


def check_training(c, overridden, world_size):
    """Checks of the settings both training scripts share, given the final config `c`, the keys
    the run sets (changed, or given explicitly) and the number of processes. Returns (quant_bits: (activation
    bits or None for weight-only, weight bits), or None without a quantizer; the number of
    micro-batches per step, 0 resolved to one per process). Raises ConfigError."""
    quantizer, dtype, device, export_format = c["quantizer"], c["dtype"], c["device"], c["export_format"]
    quant = re.fullmatch(r"(8da)?([2-8])w", quantizer)
    if quantizer not in ("none", "4w-gpu") and not quant:
        raise ConfigError(f"quantizer={quantizer!r} is unknown; use 'none', '8daNw' (e.g. '8da4w'), 'Nw' (e.g. '4w'), "
                          f"N from 2 to 8, or '4w-gpu' (int4 weight-only for CUDA)")
    quant_bits = (None, 4) if quantizer == "4w-gpu" else (8 if quant[1] else None, int(quant[2])) if quant else None
    accumulation = c["gradient_accumulation_steps"] or world_size
    problems = [
        (quantizer == "4w-gpu" and c.get("range_learning"),
         "range_learning=True learns the scales of torchao's intN fake quantizers, which '4w-gpu' does not use; "
         "use an 'Nw' or '8daNw' quantizer"),
        ("range_lr_ratio" in overridden and not (c.get("range_learning") and c["range_lr_ratio"] > 0),
         f"range_lr_ratio={c.get('range_lr_ratio')} sets the learning rate of scales that only range_learning=True learns, "
         f"as a positive multiple of the weights'; set range_learning=True or drop it"),
        (quantizer == "4w-gpu" and (device != "cuda" or dtype != "bfloat16"),
         "quantizer='4w-gpu' converts to torchao's int4 CUDA kernels, which run in bfloat16 on a GPU only; "
         "set device='cuda' and dtype='bfloat16', or use '8da4w' on a CPU"),
        (dtype not in ("float32", "bfloat16"),
         f"dtype={dtype!r} is not supported; use 'float32' or 'bfloat16' (float16 needs loss scaling, which these loops omit)"),
        (c["mixed_precision"] and dtype != "bfloat16",
         "mixed_precision=True needs dtype='bfloat16' (it computes in bf16 over fp32 master weights)"),
        (device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()),
         f"device={device!r} is not available here; use 'cpu' or, with a visible GPU, 'cuda'"),
        (device == "cpu" and (c["cpu_offload"] or c["activation_offloading"]),
         "cpu_offload and activation_offloading move data off a GPU; they need device='cuda'"),
        (accumulation % world_size,
         f"gradient_accumulation_steps={accumulation} must be a multiple of the {world_size} processes"),
        (world_size % c["replicate_degree"],
         f"replicate_degree={c['replicate_degree']} must divide the {world_size} processes"),
        (export_format not in ("none", "hf", "meta", "pte"),
         f"export_format={export_format!r} is unknown; use 'none', 'hf', 'meta' or 'pte' (the quantized model for ExecuTorch)"),
        (export_format == "pte" and not (quant_bits and quant_bits[0] and quant_bits[1] <= 4 and c["group_size"] % 32 == 0
                                         and not c["quantize_embedding"] and dtype == "float32"),
         "export_format='pte' lowers an '8daNw' model to XNNPACK, which needs N <= 4, group_size a multiple of 32, "
         "quantize_embedding=False and dtype='float32'"),
        (export_format == "pte" and importlib.util.find_spec("executorch") is None,
         "export_format='pte' needs the executorch package: pip install executorch"),
        # checked before any work: a failed import later would come after the old log was set aside
        (c["wandb_log"] and importlib.util.find_spec("wandb") is None,
         "wandb_log=True needs the wandb package: pip install wandb"),
        (not 0 <= c["ema_decay"] < 1,
         f"ema_decay={c['ema_decay']} is the weight each step keeps of the running average (0: off); give a value in [0, 1), "
         f"e.g. 0.9 for about the last 10 steps"),
        (c["ema_decay"] and dtype == "bfloat16" and not c["mixed_precision"],
         "ema_decay averages the weights in their dtype, and in bfloat16 the rounding swallows the small steps between "
         "them (the average would stay near where it started); set mixed_precision=True (fp32 master weights) or drop ema_decay"),
        (not (0 <= c["beta1"] < 1 and 0 <= c["beta2"] < 1),
         f"beta1={c['beta1']} and beta2={c['beta2']} are AdamW's averaging weights: each must lie in [0, 1)"),
        (c["min_lr"] > c["learning_rate"],
         f"min_lr={c['min_lr']} is above learning_rate={c['learning_rate']}, the peak the schedule decays from"),
        (c["profile"] and not c.get("convert_only") and c["max_iters"] < sum(c[f"profile_{k}"] for k in ("wait", "warmup", "active")),
         f"profile=True records steps {c['profile_wait'] + c['profile_warmup']} to "
         f"{c['profile_wait'] + c['profile_warmup'] + c['profile_active'] - 1} of a run (profile_wait, profile_warmup, "
         f"profile_active), past max_iters={c['max_iters']}: no trace would be written"),
    ]
    # a setting that would be ignored in this mode is a mistake to point out, not to run with
    if quant_bits is None and (unused := [k for k in QUANTIZER_ONLY if k in overridden]):
        problems.append((True, f"{', '.join(unused)} only matter with a quantizer, and quantizer='none'; set a quantizer or drop them"))
    needs = {"wandb_project": "wandb_log", "wandb_run_name": "wandb_log", "profile_wait": "profile", "profile_warmup": "profile",
             "profile_active": "profile"}
    if unused := [k for k, switch in needs.items() if k in overridden and not c[switch]]:
        problems.append((True, f"{', '.join(unused)} only matter with {' and '.join(sorted({needs[k] for k in unused}))}=True; "
                               f"set it or drop them"))
    if c.get("accumulate_unsharded") and accumulation == world_size:
        problems.append((True, "accumulate_unsharded=True saves gradient reductions between micro-batches, and each process "
                               "has one micro-batch a step; raise gradient_accumulation_steps or drop it"))
    if "lr_decay_iters" in overridden and 0 < c["lr_decay_iters"] <= c["warmup_iters"]:
        problems.append((True, f"lr_decay_iters={c['lr_decay_iters']} ends the cosine before warmup_iters={c['warmup_iters']} "
                               f"ends: the rate would drop from its peak to min_lr in one step; set it past warmup_iters"))
    shape = [k for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "preset") if k in overridden]
    if c["init_from"] not in ("scratch", "resume") and shape:  # resume compares them with the checkpoint
        problems.append((True, f"{', '.join(shape)} shape a model built from scratch; init_from={c['init_from']!r} carries its own shape"))
    for bad, message in problems:
        if bad:
            raise ConfigError(message)
    return quant_bits, accumulation


def code_digest(script):
    """What code a process runs: the sha256 of the script and of each module it imported from beside
    it (model.py, ...), by file name, and the torch and torchao versions."""
    # beside it: where the script is named, or where its link leads (where Python looks for modules)
    here = {os.path.dirname(os.path.abspath(script)), os.path.dirname(os.path.realpath(script))}
    files = {os.path.realpath(script)} | {os.path.realpath(f) for m in list(sys.modules.values())
                                          if isinstance(f := getattr(m, "__file__", None), str) and os.path.isabs(f)
                                          and os.path.dirname(os.path.abspath(f)) in here and os.path.isfile(f)}
    code = {"torch": torch.__version__, "torchao": getattr(sys.modules.get("torchao"), "__version__", None)}
    for file in sorted(files):
        with open(file, "rb") as f:
            code[os.path.basename(file)] = hashlib.sha256(f.read()).hexdigest()
    return code


def ranks_disagree(jobs):
    """A line naming what the processes disagree on, given each rank's account of its job (a flat
    dict: settings, and what it read: code, data and checkpoint digests), or None when all agree.
    A process that failed before the comparison gives {"failed": its error} instead: that is the line."""
    if failed := [r for r, job in enumerate(jobs) if "failed" in job]:
        others = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        return f"rank {failed[0]}{others} stopped: {jobs[failed[0]]['failed']}"
    def same(a, b):  # as JSON, so that a NaN (a store's teacher_val_loss, say) equals itself
        return json.dumps(a, sort_keys=True, default=repr) == json.dumps(b, sort_keys=True, default=repr)

    odd = [r for r, job in enumerate(jobs) if not same(job, jobs[0])]
    if not odd:
        return None
    mine, theirs, r = jobs[0], jobs[odd[0]], odd[0]

    def difference(k):
        a, b = mine.get(k), theirs.get(k)
        if isinstance(a, dict) and isinstance(b, dict):  # digests: the names of the parts that differ
            return f"{k} ({', '.join(n for n in {**a, **b} if not same(a.get(n), b.get(n)))})"
        return f"{k} ({a!r} on rank 0, {b!r} on rank {r})" if len(repr(a)) + len(repr(b)) < 100 else k

    others = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
    return (f"the processes were not given one job: rank {r}{others} differs from rank 0 in "
            f"{'; '.join(difference(k) for k in {**mine, **theirs} if not same(mine.get(k), theirs.get(k)))}. Each node reads its "
            f"own code, config, data and checkpoints: make them the same on every node")
