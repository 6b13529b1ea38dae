import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configurator import ConfigError, apply_config, check_training, config_keys, configure, code_digest, ranks_disagree  # noqa: E402


def make_globals():
    # what a training script's globals() looks like at the configure() call
    return {
        "__name__": "__main__", "os": os, "configure": configure, "_private": 1,
        "out_dir": "out", "batch_size": 12, "learning_rate": 6e-4, "compile": True,
        "init_from": "scratch", "dropout": 0.0, "block_size": 256, "betas": (0.9, 0.95),
        "wandb_run_name": None,
    }


def run(argv, g=None, **kw):
    g = make_globals() if g is None else g
    kw.setdefault("print_config", False)
    return apply_config(g, config_keys(g), argv, **kw), g


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def test_configure_reports_explicit_defaults_as_set(tmp_path):
    # a key given its default value, on the command line or in a config file, is still asked for:
    # the refusals of settings that would be ignored must see it
    cfg = write(tmp_path, "c.py", """
        batch_size = 12  # the default
        dropout: float = 0.1
        if True:
            compile = True  # not top level: only a changed value counts
    """)
    g = make_globals()
    config, overridden = configure(g, [cfg, "--learning_rate=6e-4"], print_config=False)
    assert overridden == ["batch_size", "learning_rate", "dropout"]


def test_config_keys_skip_modules_functions_and_private():
    assert config_keys(make_globals())[:3] == ["out_dir", "batch_size", "learning_rate"]
    assert not {"os", "configure", "_private", "__name__"} & set(config_keys(make_globals()))


def test_file_then_cli_later_wins_and_globals_updated(tmp_path):
    cfg = write(tmp_path, "c.py", "batch_size = 4\nblock_size = batch_size * 16\nout_dir = 'out-tiny'\n")
    config, g = run([cfg, "--batch_size=8"])
    assert config["batch_size"] == 8 and g["batch_size"] == 8
    assert config["block_size"] == 64 and config["out_dir"] == "out-tiny"
    config, _ = run(["--batch_size=8", cfg])
    assert config["batch_size"] == 4
    assert list(config) == config_keys(make_globals())  # all keys, script order


@pytest.mark.parametrize("arg,key,want", [
    ("--batch_size=32", "batch_size", 32),
    ("--learning_rate=1e-3", "learning_rate", 1e-3),
    ("--compile=False", "compile", False),
    ("--betas=(0.8,0.9)", "betas", (0.8, 0.9)),
    ("--betas=[0.8,0.9]", "betas", (0.8, 0.9)),
    ("--wandb_run_name=None", "wandb_run_name", None),
    ("--init_from=resume", "init_from", "resume"),        # not a literal: raw string
    ("--init_from='gpt2 xl'", "init_from", "'gpt2 xl'"), # a str setting's text as given, quotes too
    ('--out_dir="""Doc."""  # x', "out_dir", '"""Doc."""  # x'),  # (sample.py's prompt) not parsed as Python
    ("--out_dir=123", "out_dir", "123"),                 # str default keeps the raw text
    ("--init_from=a=b", "init_from", "a=b"),             # split on the first "=" only
    ("--dropout=0", "dropout", 0.0),                     # int -> float
])
def test_cli_values(arg, key, want):
    config, _ = run([arg])
    assert config[key] == want and type(config[key]) is type(want)


@pytest.mark.parametrize("value", ["7", "'run-1'", "(1, 2)", "x y"])
def test_none_default_accepts_anything(value):
    config, _ = run([f"--wandb_run_name={value}"])
    assert config["wandb_run_name"] is not None


@pytest.mark.parametrize("arg,msg", [
    ("--batch_size=abc", "--batch_size expects int (default 12), got str 'abc'"),
    ("--batch_size=1.5", "--batch_size expects int"),    # float -> int rejected
    ("--batch_size=True", "--batch_size expects int"),   # bool is not an int here
    ("--dropout=True", "--dropout expects float"),
    ("--compile=1", "--compile expects bool"),           # nor is an int a bool
    ("--compile=false", "--compile expects bool"),
    ("--betas=0.9", "--betas expects tuple"),
    ("--betas=(0,)", "--betas expects a tuple of float (default (0.9, 0.95)), got (0,)"),  # quant_skip=(0,) crashed later
    ("--betas=[0.9, None]", "--betas expects a tuple of float"),
])
def test_type_errors(arg, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        run([arg])


def test_unknown_cli_key_names_nearest():
    with pytest.raises(ConfigError, match=r"unknown setting --batch_sise; did you mean --batch_size\?"):
        run(["--batch_sise=8"])
    with pytest.raises(ConfigError, match="--help"):
        run(["--zzzzzz=1"])


def test_unknown_file_key_names_file_and_nearest(tmp_path):
    cfg = write(tmp_path, "bad.py", "learning_rat = 1e-3\n")
    with pytest.raises(ConfigError) as e:
        run([cfg])
    assert cfg in str(e.value) and "learning_rat" in str(e.value) and "did you mean learning_rate?" in str(e.value)


def test_file_type_error_names_file(tmp_path):
    cfg = write(tmp_path, "bad.py", "compile = 0\n")
    with pytest.raises(ConfigError, match="compile in '.*bad.py' expects bool"):
        run([cfg])


def test_missing_file_and_malformed_flag(tmp_path):
    with pytest.raises(ConfigError, match="config file 'nope.py' not found"):
        run(["nope.py"])
    with pytest.raises(ConfigError, match="expected --key=value, got '--compile'"):
        run(["--compile"])


def test_file_may_import_define_helpers_and_private_names(tmp_path):
    cfg = write(tmp_path, "c.py", """
        import math
        from functools import partial
        from math import sqrt
        class Helper: pass
        def double(x): return 2 * x
        _scale = 3
        learning_rate = sqrt(4) * 1e-4 * _scale
        batch_size = double(int(math.log2(64)))
    """)
    config, g = run([cfg])
    assert config["learning_rate"] == pytest.approx(6e-4) and config["batch_size"] == 12
    assert g["os"] is os and "math" not in g and "_scale" not in g  # script namespace not clobbered


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        run(["--batch_size=8", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "batch_size" in out and "= 12" in out  # defaults, not overrides


def test_prints_on_master_only(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    run(["--batch_size=8"], print_config=True)
    out = capsys.readouterr().out
    assert out.splitlines() == ["batch_size = 8  (default 12)"]  # only what differs from the defaults
    monkeypatch.setenv("RANK", "1")
    run(["--batch_size=8"], print_config=True)
    assert capsys.readouterr().out == ""


SCRIPT = """
import sys
batch_size = 12  # micro-batch size
compile = True
from configurator import configure
config, overridden = configure(globals(), positive=("batch_size",))
print("final", config["batch_size"], batch_size, overridden)
"""


def run_script(tmp_path, *args):
    script = write(tmp_path, "train.py", SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env, cwd=tmp_path)


def test_script_wrapper_ok(tmp_path):
    p = run_script(tmp_path, "--batch_size=8")
    assert p.returncode == 0, p.stderr
    assert "final 8 8 ['batch_size']" in p.stdout


@pytest.mark.parametrize("arg,words", [("--batch_size=0", "positive"), ("--batch_size=-3", "positive"),
                                       ("--compile=-1", "expects bool")])
def test_ranges_are_enforced(tmp_path, arg, words):
    p = run_script(tmp_path, arg)
    assert p.returncode == 2 and words in p.stderr and p.stderr.count("\n") == 1


def test_negative_numbers_are_refused():
    with pytest.raises(ConfigError, match="learning_rate=-0.001 must be a number >= 0"):
        run(["--learning_rate=-1e-3"])
    with pytest.raises(ConfigError, match="nan"):
        run(["--learning_rate=nan"])


@pytest.mark.parametrize("arg", ["--batch_size=abc", "--batchsize=8", "--compile", "missing.py"])
def test_script_wrapper_exits_2_with_one_line(tmp_path, arg):
    p = run_script(tmp_path, arg)
    assert p.returncode == 2
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1
    assert p.stdout == ""


def test_infinity_for_float_settings():
    g = {"grad_clip": 1.0}
    assert apply_config(g, ["grad_clip"], ["--grad_clip=inf"], print_config=False)["grad_clip"] == float("inf")
    with pytest.raises(ConfigError):
        apply_config({"grad_clip": 1.0}, ["grad_clip"], ["--grad_clip=infinite"], print_config=False)
    # elsewhere infinity is an overflow or a slip (a temperature of inf samples noise), from a file too
    for arg in ("--temperature=inf", "--temperature=1e400", "--learning_rate=-inf"):
        with pytest.raises(ConfigError, match=r"(temperature|learning_rate)=-?inf must be finite"):
            apply_config({"temperature": 0.8, "learning_rate": 1e-3}, ["temperature", "learning_rate"], [arg], print_config=False)


def test_constants_are_not_settings():
    g = {"IGNORE_INDEX": -100, "LOGITS_PER_CHUNK": 2 ** 25, "batch_size": 4}
    assert config_keys(g) == ["batch_size"]
    with pytest.raises(ConfigError, match="IGNORE_INDEX"):
        apply_config(g, config_keys(g), ["--IGNORE_INDEX=0"], print_config=False)


TRAINING = dict(quantizer="8da4w", dtype="float32", device="cpu", export_format="none", mixed_precision=False,
                cpu_offload=False, activation_offloading=False, gradient_accumulation_steps=0, replicate_degree=1,
                group_size=32, quantize_embedding=False, init_from="scratch", range_learning=False, range_lr_ratio=1.0,
                wandb_log=False, learning_rate=3e-4, min_lr=3e-5, profile=False, max_iters=300, profile_wait=5,
                profile_warmup=2, profile_active=3, ema_decay=0.0, beta1=0.9, beta2=0.95)


@pytest.mark.parametrize("settings, overridden, world_size, words", [
    (dict(quantizer="4w-gpu", range_learning=True), ["range_learning"], 1, "'4w-gpu' does not use"),
    (dict(quantizer="none", range_learning=True), ["range_learning"], 1, "range_learning only matter with a quantizer"),
    (dict(range_lr_ratio=0.1), ["range_lr_ratio"], 1, "set range_learning=True or drop it"),
    (dict(range_learning=True, range_lr_ratio=0.0), ["range_learning", "range_lr_ratio"], 1, "positive multiple"),
    (dict(quantizer="3bit"), [], 1, "quantizer='3bit' is unknown"),
    (dict(gradient_accumulation_steps=3), [], 2, "must be a multiple of the 2 processes"),
    (dict(replicate_degree=3), [], 4, "replicate_degree=3 must divide"),
    (dict(init_from="out/x/ckpt.pt", n_layer=4), ["n_layer"], 1, "carries its own shape"),
    (dict(min_lr=1e-3), [], 1, "min_lr=0.001 is above learning_rate=0.0003"),
    (dict(beta1=1.5), [], 1, "beta1=1.5 and beta2=0.95 are AdamW's averaging weights: each must lie in [0, 1)"),
    (dict(beta2=1.0), [], 1, "beta2=1.0 are AdamW's"),  # torch refused it only after the model was built
    (dict(ema_decay=1.0), [], 1, "ema_decay=1.0 is the weight each step keeps of the running average (0: off)"),
    (dict(ema_decay=0.9, dtype="bfloat16"), [], 1, "in bfloat16 the rounding swallows the small steps between them"),
    (dict(profile=True, max_iters=9), [], 1, "past max_iters=9: no trace would be written"),
    (dict(wandb_project="p"), ["wandb_project"], 1, "wandb_project only matter with wandb_log=True"),
    (dict(), ["profile_wait", "wandb_run_name"], 1, "wandb_run_name, profile_wait only matter with profile and wandb_log=True"),
    (dict(accumulate_unsharded=True, gradient_accumulation_steps=4), [], 4, "each process has one micro-batch a step"),
    (dict(lr_decay_iters=30, warmup_iters=30), ["lr_decay_iters"], 1, "lr_decay_iters=30 ends the cosine before warmup_iters=30"),
])
def test_check_training_refuses(settings, overridden, world_size, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        check_training({**TRAINING, **settings}, overridden, world_size)


def test_wandb_without_the_package_is_refused(monkeypatch):
    # refused before any work: the import used to fail after the old log.jsonl was set aside
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else object())
    with pytest.raises(ConfigError, match="wandb_log=True needs the wandb package"):
        check_training({**TRAINING, "wandb_log": True}, ["wandb_log"], 1)


def test_check_training_accepts_settings_in_their_mode():
    ok = [(dict(profile=True, profile_wait=1), ["profile", "profile_wait"], 1),
          (dict(accumulate_unsharded=True, gradient_accumulation_steps=8), ["accumulate_unsharded"], 4),
          (dict(lr_decay_iters=31, warmup_iters=30), ["lr_decay_iters"], 1)]
    for settings, overridden, world_size in ok:
        check_training({**TRAINING, "wandb_log": False, **settings}, overridden, world_size)


def test_check_training_resolves_bits_and_accumulation():
    assert check_training(TRAINING, [], 4) == ((8, 4), 4)  # 0: one micro-batch per process
    assert check_training({**TRAINING, "quantizer": "2w", "gradient_accumulation_steps": 8}, [], 2) == ((None, 2), 8)
    assert check_training({**TRAINING, "quantizer": "none"}, [], 1) == (None, 1)


def test_ranks_disagree_names_what_differs():
    job = {"learning_rate": 3e-4, "code": {"model.py": "a", "torch": "2.13.0"}, "note": "x" * 80}
    assert ranks_disagree([job, dict(job)]) is None
    other = {**job, "code": {"model.py": "b", "torch": "2.13.0"}, "note": "y" * 80}
    assert ranks_disagree([job, job, {**job, "learning_rate": 1e-4}, other]).startswith(
        "the processes were not given one job: rank 2 (and 1 more) differs from rank 0 in learning_rate (0.0003 on rank 0, "
        "0.0001 on rank 2). ")
    # digests by the names of their parts; values too long to read by name alone
    assert "rank 1 differs from rank 0 in code (model.py); note. " in ranks_disagree([job, other])
    nan = {**job, "store": {"teacher_val_loss": float("nan")}}
    assert ranks_disagree([nan, {**nan, "store": {"teacher_val_loss": float("nan")}}]) is None
    # a process that failed on its own files hands over its error, which is the line for every node
    assert ranks_disagree([job, {"failed": "data/train.bin is missing"}, other, {"failed": "x"}]) == \
        "rank 1 (and 1 more) stopped: data/train.bin is missing"


def test_code_digest_hashes_the_modules_beside_the_script(tmp_path, monkeypatch):
    import torchao
    (tmp_path / "repo").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "repo" / "train.py").write_text("import helper\n")
    (tmp_path / "elsewhere" / "helper.py").write_text("x = 1\n")
    (tmp_path / "repo" / "helper.py").symlink_to(tmp_path / "elsewhere" / "helper.py")  # a module linked in
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "train.py").symlink_to(tmp_path / "repo" / "train.py")  # the script run through a link
    helper = types.ModuleType("helper")
    helper.__file__ = str(tmp_path / "repo" / "helper.py")
    monkeypatch.setitem(sys.modules, "helper", helper)
    for script in (tmp_path / "repo" / "train.py", tmp_path / "link" / "train.py"):
        code = code_digest(str(script))
        assert sorted(code) == ["helper.py", "torch", "torchao", "train.py"] and code["torchao"] == torchao.__version__
    before = code_digest(str(tmp_path / "repo" / "train.py"))
    (tmp_path / "elsewhere" / "helper.py").write_text("x = 2\n")
    assert code_digest(str(tmp_path / "repo" / "train.py"))["helper.py"] != before["helper.py"]
