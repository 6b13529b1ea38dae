"""kd_train.py end to end on toy models: the logged losses against reference formulas, kd_ratio=0
against qat_train.py, 2 processes against 1, resume against a straight run, LoRA exports, QAD and
the errors a user can cause.

Most runs go through run_in_one_process: one Python process executes the script several times
(runpy), so torch and torchao are imported once rather than once per run; the script builds all
its state from scratch on every run (seed, process group, models)."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import DETACHED_WEIGHTS, ROOT, STOP_AFTER_CHECKPOINT, command, make_data, read_log, run, run_patched, script_env

sys.path.insert(0, str(ROOT))
from checkpoint import load_adapter, load_checkpoint  # noqa: E402
from model import IGNORE_INDEX, PRESETS, ModelArgs, Transformer, initial_scales, learn_scales  # noqa: E402
from torchao.quantization import quantize_  # noqa: E402
from torchao.quantization.qat import QATConfig  # noqa: E402
from test_qat_train import base_config, is_linear, running_average  # noqa: E402

V = 256  # the data's vocabulary
ENV = {"OMP_NUM_THREADS": "1"}  # the toy models are far slower with threads competing for 2 cores
# every run: toy sizes, a log line per step, no matmul benchmark
BASE = dict(batch_size=4, block_size=32, warmup_iters=0, log_interval=1, eval_interval=1000, eval_iters=1,
            ckpt_interval=1000, peak_flops_per_device=1e12, seed=7)

DRIVER = """
import contextlib, io, json, runpy, sys, traceback
import torch.distributed as dist
root, runs, results_file = sys.argv[1:]
sys.path.insert(0, root)
results = []
for argv in json.loads(runs):
    sys.argv, err, code = argv, io.StringIO(), 0
    try:
        with contextlib.redirect_stderr(err):
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:
        code = traceback.format_exc()
    if dist.is_initialized():  # a run that crashed mid-way must not break the next one
        dist.destroy_process_group()
    results.append([code, err.getvalue()])
with open(results_file, "w") as f:
    json.dump(results, f)
"""


def run_in_one_process(runs, tmp_path, check=True):
    """Runs [(script, settings), ...] in order in one process; returns [(exit code, stderr)]."""
    argvs = [command(script, **settings)[1:] for script, settings in runs]
    results_file = str(tmp_path / "results.json")
    r = subprocess.run([sys.executable, "-c", DRIVER, str(ROOT), json.dumps(argvs), results_file], cwd=ROOT,
                       env=script_env(ENV), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    with open(results_file) as f:
        results = json.load(f)
    if check:
        for (script, settings), (code, err) in zip(runs, results):
            assert code in (0, None), f"{script} {settings} exited {code}:\n{err[-4000:]}"
    return results


def save_model(path, seed, vocab=V, out_scale=1.0):
    """A toy checkpoint; out_scale sharpens the output distribution, so that divergences are O(1)."""
    args = ModelArgs(**PRESETS["toy"], vocab_size=vocab)
    m = Transformer(args)
    m.init_weights(seed)
    with torch.no_grad():
        m.output.weight.mul_(out_scale)
    torch.save({"model": m.state_dict(), "model_args": vars(args)}, path)
    return str(path)


def load_model(ckpt):
    """The model of a checkpoint dict or file, in eval mode."""
    if isinstance(ckpt, (str, os.PathLike)):
        ckpt = torch.load(ckpt, weights_only=True)
    m = Transformer(ModelArgs.from_dict(ckpt["model_args"]))
    m.load_state_dict(ckpt["model"])
    return m.eval()


def train_lines(log):
    return [r for r in log if "loss" in r]


def weights(path):
    return torch.load(path, weights_only=True)["model"]


def assert_same_weights(a, b, atol=1e-5, stray=False):
    """stray: one weight in a thousand (at least one) per tensor may be off, for steps that sum in
    another order (AdamW's first step moves a weight by lr * g / (|g| + eps): where a gradient is within
    rounding of zero, |g| near eps, another order moves it by another amount; on an AVX512 Intel CPU,
    one of w2's 12,288 weights 4.9e-5 apart)."""
    assert a.keys() == b.keys()
    for k in a:
        if not stray:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)
        else:
            off = (a[k].float() - b[k].float()).abs() > atol
            assert off.sum() <= max(1, a[k].numel() // 1000), f"{k}: {off.sum()} of {a[k].numel()} weights differ"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("kd")
    n_train, n_val = 8192, 1536
    rng = np.random.default_rng(1)
    # prompt/response-like masks: runs of ignored and trained tokens
    masks = [np.repeat(rng.integers(0, 2, n // 8 + 1), 8)[:n] for n in (n_train, n_val)]
    return dict(
        dir=d,
        data=make_data(d / "data"),
        masked=make_data(d / "masked", train_mask=masks[0], val_mask=masks[1]),
        teacher=save_model(d / "teacher.pt", seed=1, out_scale=15.0),
        teacher320=save_model(d / "teacher320.pt", seed=2, vocab=320, out_scale=15.0),  # 64 padding rows
        student=save_model(d / "student.pt", seed=3, out_scale=3.0),
    )


# -----------------------------------------------------------------------------
# the logged losses of the first step against formulas written here


def first_batch(data_dir, seed, block_size, global_batch):
    """The windows of step 0 as kd_train.py draws them: the epoch-0 order seeded by seed."""
    tokens = np.fromfile(os.path.join(data_dir, "train.bin"), dtype=np.uint16).astype(np.int64)
    n_windows = (len(tokens) - 1) // block_size
    epoch_seed = int(np.random.SeedSequence([seed, 0]).generate_state(1)[0])  # (seed, epoch 0)
    order = torch.randperm(n_windows, generator=torch.Generator().manual_seed(epoch_seed))
    starts = [w * block_size for w in order[:global_batch].tolist()]
    rows = torch.from_numpy(np.stack([tokens[s: s + block_size + 1] for s in starts]))
    x, y = rows[:, :-1], rows[:, 1:].clone()
    mask_file = os.path.join(data_dir, "train_mask.bin")
    if os.path.exists(mask_file):
        mask = np.fromfile(mask_file, dtype=np.uint8)
        keep = torch.from_numpy(np.stack([mask[s + 1: s + block_size + 1] for s in starts]).astype(bool))
        y[~keep] = IGNORE_INDEX
    return x, y


def reference_divergence(kind, s_logits, t_logits, T, beta):
    """Per-token divergence in float64, from probabilities (no log-space tricks)."""
    p = F.softmax(t_logits.double() / T, -1)  # teacher
    q = F.softmax(s_logits.double() / T, -1)  # student

    def kl(a, b):
        return (a * (a / b).log()).sum(-1)

    if kind == "fkl":
        return kl(p, q)
    if kind == "rkl":
        return kl(q, p)
    if kind == "skl":
        return (kl(p, q) + kl(q, p)) / 2
    m = beta * p + (1 - beta) * q
    return (beta * kl(p, m) + (1 - beta) * kl(q, m)) / (beta * (1 - beta))


@torch.no_grad()
def reference_record(settings):
    s = settings
    global_batch = s["batch_size"] * s.get("gradient_accumulation_steps", 1)
    x, y = first_batch(s["data_dir"], s["seed"], s["block_size"], global_batch)
    s_logits, t_logits = load_model(s["init_from"])(x), load_model(s["teacher_init"])(x)
    s_logits, t_logits = s_logits[..., :V].flatten(0, 1), t_logits[..., :V].flatten(0, 1)  # padding rows dropped
    y = y.flatten()
    keep = y != IGNORE_INDEX
    n = keep.sum()
    T = s.get("kd_temperature", 1.0)
    div = reference_divergence(s["kd_divergence"], s_logits, t_logits, T, s.get("jsd_beta", 0.5))
    kd = (div * keep).sum() * T ** 2 / n
    ce = F.cross_entropy(s_logits.double(), y, ignore_index=IGNORE_INDEX, reduction="sum") / n
    r = s["kd_ratio"]
    return {"class_loss": ce.item(), "kd_loss": kd.item(), "loss": ((1 - r) * ce + r * kd).item()}


LOSS_CASES = {
    "fkl": dict(kd_divergence="fkl"),
    "rkl": dict(kd_divergence="rkl"),
    "skl": dict(kd_divergence="skl"),
    "jsd": dict(kd_divergence="jsd", jsd_beta=0.3),
    "jsd-beta-1e-4": dict(kd_divergence="jsd", jsd_beta=1e-4),
    "jsd-beta-0.9999": dict(kd_divergence="jsd", jsd_beta=0.9999),
    # temperature, a prompt mask and a teacher with padding rows
    "fkl-T2-masked-padded": dict(kd_divergence="fkl", kd_temperature=2.0, data="masked", teacher="teacher320"),
    # 17 * 64 = 1088 tokens a micro-batch: the chunked path (chunks of 1024)
    "rkl-chunked": dict(kd_divergence="rkl", batch_size=17, block_size=64, loss_chunk=1024),
    "jsd-T2-masked-padded-chunked": dict(kd_divergence="jsd", jsd_beta=0.7, kd_temperature=2.0, data="masked",
                                         teacher="teacher320", batch_size=17, block_size=64, loss_chunk=1024),
}
# exact endpoints of the JSD and a chunked step against an unchunked one, checked against other runs
EXTRA_CASES = {
    "jsd-beta-0": dict(kd_divergence="jsd", jsd_beta=0.0),
    "jsd-beta-1": dict(kd_divergence="jsd", jsd_beta=1.0),
    "chunked-1x18": dict(kd_divergence="skl", batch_size=18, block_size=64, loss_chunk=1024),  # 1152 tokens: 2 chunks
    "unchunked-2x9": dict(kd_divergence="skl", batch_size=9, block_size=64, gradient_accumulation_steps=2),
    # QAD: the chunks share the output weight's fake quant
    "qad-chunked-1x18": dict(kd_divergence="skl", batch_size=18, block_size=64, loss_chunk=1024, quantizer="8da4w"),
    "qad-unchunked-2x9": dict(kd_divergence="skl", batch_size=9, block_size=64, gradient_accumulation_steps=2, quantizer="8da4w"),
}


@pytest.fixture(scope="module")
def loss_runs(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("loss")
    runs, settings = [], {}
    for name, case in {**LOSS_CASES, **EXTRA_CASES}.items():
        case = dict(case)
        data, teacher = setup[case.pop("data", "data")], setup[case.pop("teacher", "teacher")]
        s = dict(BASE, data_dir=data, teacher_init=teacher, init_from=setup["student"], out_dir=str(out / name),
                 max_iters=1, kd_ratio=0.3, learning_rate=1e-2, **case)
        settings[name] = s
        runs.append(("kd_train.py", s))
    run_in_one_process(runs, out)
    return {name: (s, read_log(s["out_dir"])) for name, s in settings.items()}


@pytest.mark.parametrize("name", LOSS_CASES)
def test_first_step_losses_match_reference(loss_runs, name):
    settings, log = loss_runs[name]
    logged = train_lines(log)[0]
    assert logged["iter"] == 1
    expected = reference_record(settings)
    assert expected["kd_loss"] > 0.05  # the models differ: a divergence mix-up would show
    # near beta = 0 or 1 the script's float32 JSD loses digits to cancellation, amplified by 1 / (beta (1 - beta))
    rel = 5e-3 if name.startswith("jsd-beta") else 2e-5
    for key in ("class_loss", "kd_loss", "loss"):
        assert logged[key] == pytest.approx(expected[key], rel=rel), key


def test_jsd_tends_to_forward_and_reverse_kl(loss_runs):
    first = {name: train_lines(log)[0]["kd_loss"] for name, (_, log) in loss_runs.items()}
    assert first["fkl"] != pytest.approx(first["rkl"], rel=0.05)  # else the limits prove nothing
    assert first["jsd-beta-1e-4"] == pytest.approx(first["fkl"], rel=1e-2)
    assert first["jsd-beta-0.9999"] == pytest.approx(first["rkl"], rel=1e-2)
    assert first["jsd-beta-0"] == first["fkl"]
    assert first["jsd-beta-1"] == first["rkl"]


@pytest.mark.parametrize("qad", ["", "qad-"])
def test_chunked_step_equals_unchunked(loss_runs, qad):
    (sa, log_a), (sb, log_b) = loss_runs[qad + "chunked-1x18"], loss_runs[qad + "unchunked-2x9"]
    a, b = train_lines(log_a)[0], train_lines(log_b)[0]
    for key in ("class_loss", "kd_loss", "grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    wa, wb = weights(os.path.join(sa["out_dir"], "model.pt")), weights(os.path.join(sb["out_dir"], "model.pt"))
    assert_same_weights(wa, wb, stray=True)  # the sums run in another order
    assert (wa["output.weight"] - weights(sa["init_from"])["output.weight"]).abs().max() > 1e-3  # it did train


# -----------------------------------------------------------------------------
# kd_ratio=0 is plain cross-entropy training; the teacher is never optimized

TRAIN = dict(BASE, max_iters=3, gradient_accumulation_steps=2, learning_rate=1e-2, min_lr=1e-3, warmup_iters=1,
             weight_decay=0.1, beta1=0.8, beta2=0.9, grad_clip=0.5)


def test_kd_ratio_zero_equals_ce_training(setup, tmp_path):
    common = dict(TRAIN, data_dir=setup["masked"], init_from=setup["student"])
    kd = dict(common, out_dir=str(tmp_path / "kd"), teacher_init=setup["teacher"], kd_ratio=0.0)
    ce = dict(common, out_dir=str(tmp_path / "ce"), quantizer="none")
    run_in_one_process([("kd_train.py", kd), ("qat_train.py", ce)], tmp_path)
    kd_log, ce_log = train_lines(read_log(kd["out_dir"])), train_lines(read_log(ce["out_dir"]))
    assert [r["iter"] for r in kd_log] == [r["iter"] for r in ce_log] == [1, 2, 3]
    for a, b in zip(kd_log, ce_log):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["class_loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["kd_loss"] > 0.05  # computed, just not trained on
    kd_ckpt = torch.load(os.path.join(kd["out_dir"], "ckpt.pt"), weights_only=True)
    final = kd_ckpt["model"]
    assert_same_weights(final, weights(os.path.join(ce["out_dir"], "ckpt.pt")))
    wq = "layers.0.attention.wq.weight"
    assert (final[wq] - weights(setup["student"])[wq]).abs().max() > 1e-3  # it did train

    # the optimizer holds state for exactly the student's parameters: none of the teacher's
    student_params = set(final)
    state = kd_ckpt["optimizer"]["state"]
    assert set(state) == student_params
    assert sorted(p for g in kd_ckpt["optimizer"]["param_groups"] for p in g["params"]) == sorted(student_params)


def test_compiled_step_equals_eager(setup, tmp_path):
    # compile=True (each block, and the loss chunks: the student's log-probabilities and the forward
    # KL in one autograd.Function) computes what eager does, its gradient included: a gradient sent
    # to the wrong output (torch 2.11's compiled autograd.Function, pytorch/pytorch#180642) would
    # part the later steps' losses and the final weights
    common = dict(TRAIN, data_dir=setup["masked"], init_from=setup["student"], teacher_init=setup["teacher"])
    eager, compiled = dict(common, out_dir=str(tmp_path / "eager")), dict(common, out_dir=str(tmp_path / "compiled"), compile=True)
    run_in_one_process([("kd_train.py", eager), ("kd_train.py", compiled)], tmp_path)
    logs = [train_lines(read_log(c["out_dir"])) for c in (eager, compiled)]
    assert [r["iter"] for r in logs[0]] == [r["iter"] for r in logs[1]] == [1, 2, 3]
    for a, b in zip(*logs):
        for key in ("class_loss", "kd_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), (a["iter"], key)
    final = [weights(os.path.join(c["out_dir"], "ckpt.pt")) for c in (eager, compiled)]
    start = weights(setup["student"])
    for k in final[0]:
        # over the whole tensor: AdamW moves a weight whose gradient is near zero by about the rate, of
        # either sign, so one element may part by a share of what the step moves (3e-5 of 0.02 on an AVX2
        # machine), where a gradient sent astray moves the whole tensor otherwise
        moved = (final[0][k] - start[k]).norm()
        assert (final[1][k] - final[0][k]).norm() <= 1e-3 * moved + 1e-6, k


def test_qad_weights_no_gradient_reaches_stop_the_run(setup, tmp_path):
    # as in qat_train.py: a weight without a gradient, which AdamW would pass over, stops the first step
    r = run_patched("kd_train.py", DETACHED_WEIGHTS, env=ENV, **TRAIN, data_dir=setup["data"], init_from=setup["student"],
                    teacher_init=setup["teacher"], quantizer="8da4w", group_size=32, out_dir=tmp_path / "qad")
    assert r.returncode == 2 and re.search(r"error: step 1: no gradient reached layers\.0\.attention\.wq\.weight, .* and "
                                           r"others: the loss does not depend on them as trained\n", r.stderr), r.stderr[-2000:]


def test_non_finite_teacher(setup, tmp_path):
    # a teacher whose logits hold an inf: kd_ratio 0 trains on the labels alone, not on 0 * nan;
    # with weight on the KD term the run stops at its first step and writes no checkpoint
    state = torch.load(setup["teacher"], weights_only=True)
    state["model"]["output.weight"][5, 0] = float("inf")
    state["stop_ids"] = [7, 2]  # (and the stop ids of its source, which a student from scratch takes on)
    torch.save(state, tmp_path / "inf_teacher.pt")
    common = dict(TRAIN, data_dir=setup["data"], init_from=setup["student"], teacher_init=str(tmp_path / "inf_teacher.pt"))
    (tmp_path / "half").mkdir()  # holding an earlier run's checkpoint, which is set aside: it is not this run's
    shutil.copyfile(setup["student"], tmp_path / "half" / "ckpt.pt")
    (code0, err0), (code, err), (code_s, err_s) = run_in_one_process([
        ("kd_train.py", dict(common, out_dir=str(tmp_path / "zero"), kd_ratio=0.0)),
        ("kd_train.py", dict(common, out_dir=str(tmp_path / "half"), kd_ratio=0.5, ckpt_interval=1, log_interval=5)),
        ("kd_train.py", dict(common, out_dir=str(tmp_path / "scratch"), kd_ratio=0.0, init_from="scratch", preset="toy", max_iters=1)),
    ], tmp_path, check=False)
    assert code0 in (0, None) and code_s in (0, None), (err0 + err_s)[-2000:]
    assert torch.load(tmp_path / "scratch" / "ckpt.pt", weights_only=True)["stop_ids"] == [7, 2]
    assert torch.load(tmp_path / "zero" / "ckpt.pt", weights_only=True)["stop_ids"] == []
    assert all(math.isfinite(r["loss"]) and math.isnan(r["kd_loss"]) for r in train_lines(read_log(tmp_path / "zero")))
    assert code == 2 and (f"step 1: the KD term is not finite; stopped, and no checkpoint was written; check the teacher "
                          f"({tmp_path / 'inf_teacher.pt'})") in err, err[-2000:]
    assert not (tmp_path / "half" / "ckpt.pt").exists() and (tmp_path / "half" / "ckpt.pt.prev").exists()
    # a teacher in out_dir's checkpoint, or final model, would be replaced by the student's
    for name in ("ckpt.pt", "model.pt"):
        shutil.copyfile(setup["teacher"], tmp_path / "half" / name)
        r = run("kd_train.py", check=False, env=ENV, **dict(common, out_dir=str(tmp_path / "half"),
                                                            teacher_init=str(tmp_path / "half" / name)))
        assert r.returncode == 2 and f"is this run's own {name} in out_dir, which the run replaces" in r.stderr, r.stderr


# -----------------------------------------------------------------------------
# 2 processes against 1, and resume against a straight run


@pytest.fixture(scope="module")
def parity_runs(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    common = dict(TRAIN, max_iters=4, data_dir=setup["masked"], init_from=setup["student"],
                  teacher_init=setup["teacher"], kd_ratio=0.6, kd_divergence="skl", kd_temperature=1.5)
    dirs = {k: str(out / k) for k in ("one", "two", "resumed")}
    run("kd_train.py", nproc=2, env=ENV, **dict(common, out_dir=dirs["two"]))
    run_in_one_process([
        ("kd_train.py", dict(common, out_dir=dirs["one"])),
        # stop after 2 of the 4 steps, on the 4-step schedule, then resume
        ("kd_train.py", dict(common, out_dir=dirs["resumed"], max_iters=2, lr_decay_iters=4)),
        ("kd_train.py", dict(common, out_dir=dirs["resumed"], init_from="resume")),
    ], out)
    return dirs


def assert_same_training(log_a, log_b, rel=1e-5):
    assert [r["iter"] for r in log_a] == [r["iter"] for r in log_b]
    for a, b in zip(log_a, log_b):
        for key in ("loss", "class_loss", "kd_loss", "lr"):
            assert a[key] == pytest.approx(b[key], rel=rel), (a["iter"], key)
        # Adam's update barely depends on the gradient's scale, its norm does
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), a["iter"]


def test_two_processes_match_one(parity_runs):
    one, two = (train_lines(read_log(parity_runs[k])) for k in ("one", "two"))
    assert [r["iter"] for r in two] == [1, 2, 3, 4]
    assert_same_training(one, two)
    assert_same_weights(weights(os.path.join(parity_runs["one"], "model.pt")),
                        weights(os.path.join(parity_runs["two"], "model.pt")))


def assert_resume_equals_straight_run(straight_dir, resumed_dir, weights_file=None):
    straight, resumed = (train_lines(read_log(d)) for d in (straight_dir, resumed_dir))
    assert [r["iter"] for r in resumed] == [1, 2, 3, 4]
    assert_same_training(straight, resumed)
    if weights_file:
        assert_same_weights(weights(os.path.join(straight_dir, weights_file)), weights(os.path.join(resumed_dir, weights_file)))


def test_resume_equals_straight_run(parity_runs):
    assert_resume_equals_straight_run(parity_runs["one"], parity_runs["resumed"])
    a = torch.load(os.path.join(parity_runs["one"], "ckpt.pt"), weights_only=True)
    b = torch.load(os.path.join(parity_runs["resumed"], "ckpt.pt"), weights_only=True)
    assert a["iter_num"] == b["iter_num"] == 4
    assert_same_weights(a["model"], b["model"])
    for k in a["optimizer"]["state"]:
        torch.testing.assert_close(a["optimizer"]["state"][k]["exp_avg_sq"], b["optimizer"]["state"][k]["exp_avg_sq"])


# -----------------------------------------------------------------------------
# LoRA: merged exports, adapters, resume

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.1, lora_targets=("wq", "wv", "w2", "output"))


@pytest.fixture(scope="module")
def lora_runs(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    # peak_flops_per_device=0 (measured): the CPU matmul benchmark must not disturb the dropout RNG that resume restores
    common = dict(TRAIN, **LORA, max_iters=4, data_dir=setup["data"], init_from=setup["student"],
                  teacher_init=setup["teacher"], kd_ratio=0.5, learning_rate=3e-2, peak_flops_per_device=0.0)
    dirs = {k: str(out / k) for k in ("straight", "resumed", "adapter_only")}
    run_in_one_process([
        ("kd_train.py", dict(common, out_dir=dirs["straight"], export_format="hf")),
        ("kd_train.py", dict(common, out_dir=dirs["resumed"], max_iters=2, lr_decay_iters=4)),
        ("kd_train.py", dict(common, out_dir=dirs["resumed"], init_from="resume")),
        ("kd_train.py", dict(common, out_dir=dirs["adapter_only"], max_iters=1, save_adapter_only=True)),
    ], out)
    return dirs


@torch.no_grad()
def test_lora_merged_exports_match_base_plus_adapters(setup, lora_runs):
    ckpt = torch.load(os.path.join(lora_runs["straight"], "ckpt.pt"), weights_only=True)
    assert "layers.0.attention.wq.base.weight" in ckpt["model"] and "output.lora_b" in ckpt["model"]
    assert ckpt["model"]["layers.1.feed_forward.w2.lora_b"].abs().max() > 1e-3  # the adapters trained
    # the base weights are frozen
    student = weights(setup["student"])
    for name in ("layers.1.attention.wv.weight", "layers.0.feed_forward.w1.weight", "tok_embeddings.weight"):
        trained = ckpt["model"].get(name.replace(".weight", ".base.weight"), ckpt["model"].get(name))
        torch.testing.assert_close(trained, student[name], rtol=0, atol=0, msg=name)

    x = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(0))
    lora_logits = load_model(ckpt)(x)  # eval(): no dropout
    merged = torch.load(os.path.join(lora_runs["straight"], "model.pt"), weights_only=True)
    assert merged["model_args"]["lora_rank"] == 0 and not any("lora" in k for k in merged["model"])
    torch.testing.assert_close(load_model(merged)(x), lora_logits, rtol=0, atol=1e-5)
    args, sd = load_checkpoint(os.path.join(lora_runs["straight"], "export_hf"))
    hf = Transformer(args)
    hf.load_state_dict(sd)
    torch.testing.assert_close(hf.eval()(x), lora_logits, rtol=0, atol=1e-5)
    # the student, not the teacher, was exported
    assert (load_model(setup["teacher"])(x) - lora_logits).abs().max() > 0.1


def test_lora_adapter_round_trip(lora_runs):
    ckpt = torch.load(os.path.join(lora_runs["straight"], "ckpt.pt"), weights_only=True)
    base_args = ModelArgs.from_dict({**ckpt["model_args"], "lora_rank": 0})
    settings, sd = load_adapter(os.path.join(lora_runs["straight"], "adapter"), base_args)
    assert settings["lora_rank"] == LORA["lora_rank"] and settings["lora_alpha"] == LORA["lora_alpha"]
    assert set(settings["lora_targets"]) == set(LORA["lora_targets"])
    expected = {k: v for k, v in ckpt["model"].items() if k.endswith(("lora_a", "lora_b"))}
    assert sd.keys() == expected.keys() and len(sd) == 2 * (3 * 2 + 1)  # 3 targets in 2 layers, plus output
    for k in sd:
        torch.testing.assert_close(sd[k], expected[k], rtol=0, atol=0, msg=k)


def test_save_adapter_only_writes_no_merged_model(lora_runs):
    files = os.listdir(lora_runs["adapter_only"])
    assert "adapter" in files and "model.pt" not in files
    assert sorted(os.listdir(os.path.join(lora_runs["adapter_only"], "adapter"))) == [
        "adapter_config.json", "adapter_model.safetensors"]


def test_resume_refuses_another_objective_or_teacher(parity_runs, setup, tmp_path):
    # the divergence's settings, and the teacher's bytes at the same path, decide what is trained
    common = dict(TRAIN, data_dir=setup["masked"], init_from="resume", teacher_init=setup["teacher"], kd_ratio=0.6,
                  kd_divergence="skl", kd_temperature=1.5, max_iters=6)
    out = shutil.copytree(parity_runs["resumed"], tmp_path / "resumed")
    r = run("kd_train.py", check=False, env=ENV, **dict(common, out_dir=str(out), kd_temperature=2.0))
    assert r.returncode == 2 and "was trained with kd_temperature=1.5; resume with the same settings" in r.stderr, r.stderr
    # a field of another version's model_args, which could build another model: refused, not dropped
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    torch.save({**ckpt, "model_args": {**ckpt["model_args"], "qk_norm": True}}, out / "ckpt.pt")
    r = run("kd_train.py", check=False, env=ENV, **dict(common, out_dir=str(out)))
    assert r.returncode == 2 and "its model_args hold qk_norm=True, which this version" in r.stderr, r.stderr
    teacher = tmp_path / "teacher.pt"
    shutil.copyfile(setup["teacher"], teacher)
    run("kd_train.py", env=ENV, **dict(common, out_dir=str(tmp_path / "t"), init_from=setup["student"],
                                       teacher_init=str(teacher), max_iters=1))
    shutil.copyfile(setup["student"], teacher)  # retrained in place
    r = run("kd_train.py", check=False, env=ENV, **dict(common, out_dir=str(tmp_path / "t"), teacher_init=str(teacher)))
    assert r.returncode == 2 and "is not the one" in r.stderr and "its bytes differ" in r.stderr, r.stderr


def test_lora_resume_equals_straight_run(lora_runs):
    assert_resume_equals_straight_run(lora_runs["straight"], lora_runs["resumed"], "ckpt.pt")


# -----------------------------------------------------------------------------
# QAD, vocabularies, and the errors a user can cause


@pytest.fixture(scope="module")
def misc_runs(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("misc")
    d = setup["dir"]
    big_vocab = save_model(d / "student2000.pt", seed=4, vocab=2000)  # another tokenizer, not padding
    small_vocab = save_model(d / "teacher200.pt", seed=5, vocab=200)
    odd = Transformer(ModelArgs(**{**PRESETS["toy"], "n_heads": 6, "head_dim": 16}, vocab_size=V))  # 64 over 6 heads
    torch.save({"model": odd.state_dict(), "model_args": vars(odd.args)}, d / "odd_heads.pt")
    common = dict(BASE, data_dir=setup["data"], init_from=setup["student"], teacher_init=setup["teacher"],
                  max_iters=1)
    cases = {
        # QAD: the student starts as the teacher; fake quant from step 1 on
        "qad": dict(common, init_from=setup["teacher"], quantizer="8da4w", fake_quant_after_n_steps=1, max_iters=3,
                    learning_rate=1e-3, kd_ratio=1.0),
        "kd_divergence": dict(common, kd_divergence="kl"),
        "kd_ratio": dict(common, kd_ratio=1.5),
        "kd_ratio_negative": dict(common, kd_ratio=-0.1),
        "lora_with_quantizer": dict(common, lora_rank=4, quantizer="8da4w"),
        "norm_lr_ratio_with_lora": dict(common, lora_rank=4, norm_lr_ratio=3.0),
        "norm_lr_ratio_zero": dict(common, norm_lr_ratio=0.0),
        "lora_alpha_zero": dict(common, lora_rank=4, lora_alpha=0.0),  # adapters scaled by 0: nothing would train
        "lora_dropout_one": dict(common, lora_rank=4, lora_dropout=1.0),  # every adapter input dropped: the same
        "adapter_only_without_lora": dict(common, save_adapter_only=True),
        "student_vocab": dict(common, init_from=big_vocab),
        "teacher_vocab": dict(common, teacher_init=small_vocab),
        "lora_setting_without_lora": dict(common, lora_alpha=8.0),
        "jsd_beta_without_jsd": dict(common, jsd_beta=0.3),
        "group_size_without_quantizer": dict(common, group_size=64),
        "range_learning_without_quantizer": dict(common, range_learning=True),
        "teacher_topk_online": dict(common, teacher_topk=256),  # the default, given explicitly
        "hf_export_transformers_refuses": dict(common, init_from=str(d / "odd_heads.pt"), export_format="hf"),
    }
    for name, s in cases.items():
        s["out_dir"] = str(out / name)
    results = run_in_one_process([("kd_train.py", s) for s in cases.values()], out, check=False)
    return {name: (s, code, err) for (name, s), (code, err) in zip(cases.items(), results)}


def test_qad_ends_with_a_converted_model(misc_runs):
    settings, code, err = misc_runs["qad"]
    assert code in (0, None), err[-4000:]
    log = read_log(settings["out_dir"])
    steps = train_lines(log)
    # step 1 without fake quant: the student is the teacher, so they agree exactly
    assert steps[0]["kd_loss"] == pytest.approx(0.0, abs=1e-6) and not steps[0]["fake_quant"]
    assert steps[1]["kd_loss"] > 1e-5 and steps[1]["fake_quant"]
    assert any(r.get("event") == "fake_quant_enabled" and r["iter"] == 1 for r in log)
    assert [r["fake_quant"] for r in log if "val_loss" in r] == [True]  # the evaluation's model is the fake-quantized one
    summary = log[-1]
    assert summary["method"] == "qad" and summary["quantizer"] == "8da4w"
    assert math.isfinite(summary["quant_val_loss"]) and math.isfinite(summary["fp_val_loss"])
    assert summary["teacher_val_loss"] == pytest.approx(log[0]["teacher_val_loss"])
    q = torch.load(os.path.join(settings["out_dir"], "quantized.pt"), weights_only=False)
    assert q["quantizer"] == "8da4w" and "layers.0.attention.wq.weight" in q["model"]


def test_qad_learned_scales_resume_and_convert(setup, tmp_path):
    # QAD with range_learning: the learned scales are restored on resume (the steps after it and
    # the converted model equal the straight run's) and stay out of the student's model.pt
    common = dict(BASE, data_dir=setup["data"], init_from=setup["teacher"], teacher_init=setup["teacher"],
                  quantizer="8da2w", range_learning=True, max_iters=4, learning_rate=1e-3, kd_ratio=0.5)
    straight, resumed, ratio = str(tmp_path / "straight"), str(tmp_path / "resumed"), str(tmp_path / "ratio")
    run_in_one_process([("kd_train.py", dict(common, out_dir=straight, export_format="hf")),
                        ("kd_train.py", dict(common, out_dir=resumed, max_iters=2, lr_decay_iters=4)),
                        ("kd_train.py", dict(common, out_dir=resumed, init_from="resume")),
                        ("kd_train.py", dict(common, out_dir=ratio, max_iters=1, warmup_iters=0, weight_decay=0.0,
                                             range_lr_ratio=0.01, norm_lr_ratio=3.0)),
                        # a finetune from the QAD checkpoint starts from the scales it learned (here at rate 0: kept)
                        ("kd_train.py", dict(common, out_dir=str(tmp_path / "again"), init_from=os.path.join(straight, "ckpt.pt"),
                                             max_iters=1, learning_rate=0.0, min_lr=0.0))], tmp_path)
    learned, again = (torch.load(os.path.join(d, "ckpt.pt"), weights_only=True)["model"] for d in (straight, tmp_path / "again"))
    assert all(torch.equal(again[k], v) for k, v in learned.items() if k.endswith("learned_scale"))
    assert_resume_equals_straight_run(straight, resumed, "ckpt.pt")
    a, b = (read_log(d)[-1] for d in (straight, resumed))
    assert a["method"] == "qad" and a["quant_val_loss"] == pytest.approx(b["quant_val_loss"], rel=1e-6)
    ckpt = torch.load(os.path.join(straight, "ckpt.pt"), weights_only=True)["model"]
    assert "layers.0.attention.wq.weight_fake_quantizer.learned_scale" in ckpt
    assert not any(k.endswith("learned_scale") for k in weights(os.path.join(straight, "model.pt")))
    # the export holds the unquantized weights: rounded again on max-based scales, as a tool that quantizes
    # it would, they are another model, scored beside the converted one
    ptq = str(tmp_path / "ptq")
    run("qat_train.py", batch_size=4, block_size=32, data_dir=setup["data"], out_dir=ptq, init_from=os.path.join(straight, "export_hf"),
        convert_only=True, quantizer="8da2w", env=ENV)
    assert a["export_ptq_val_loss"] == pytest.approx(read_log(ptq)[-1]["quant_val_loss"], rel=1e-6)
    assert abs(a["export_ptq_val_loss"] - a["quant_val_loss"]) > 1e-4 and "export_ptq_val_loss" not in b

    # range_lr_ratio: AdamW's first step moves each scale by at most the learning rate times the ratio
    fake = Transformer(load_model(setup["teacher"]).args)
    quantize_(fake, QATConfig(base_config("8da2w", 32), step="prepare"), filter_fn=is_linear)
    learn_scales(fake)
    lr = train_lines(read_log(ratio))[0]["lr"]
    end = torch.load(os.path.join(ratio, "ckpt.pt"), weights_only=True)["model"]
    start = initial_scales(fake, weights(setup["teacher"]))
    moved = max((end[k] - v).abs().max().item() for k, v in start.items())
    assert moved == pytest.approx(0.01 * lr, rel=2e-2)  # float32 rounding of the scales
    # norm_lr_ratio: the RMSNorm gains move by three times the learning rate, the weights by it
    teacher = weights(setup["teacher"])
    assert max((end[k] - teacher[k]).abs().max().item() for k in teacher if k.endswith("norm.weight")) == pytest.approx(3 * lr, rel=1e-3)
    assert max((end[k] - teacher[k]).abs().max().item() for k in teacher if k.endswith("wq.weight")) == pytest.approx(lr, rel=1e-3)


def test_pure_bfloat16_refused_where_rounding_freezes_the_weights(setup, tmp_path):
    # as in qat_train: at lr 2e-5 a bfloat16 weight above ~0.008 has a spacing AdamW's steps cannot cross
    settings = dict(TRAIN, data_dir=setup["data"], init_from=setup["student"], teacher_init=setup["teacher"], dtype="bfloat16",
                    learning_rate=2e-5, min_lr=1e-6)
    r = run("kd_train.py", check=False, env=ENV, **dict(settings, out_dir=str(tmp_path / "pure")))
    assert r.returncode == 2 and re.search(r"below half of bfloat16's spacing for \d+% of the weight matrices", r.stderr), r.stderr[-2000:]
    r = run("kd_train.py", env=ENV, **dict(settings, out_dir=str(tmp_path / "mixed"), mixed_precision=True, max_iters=1))
    assert "spacing" not in r.stdout + r.stderr


def test_qad_weight_average_ends_the_run_and_resumes(setup, tmp_path):
    # ema_decay: the student ends as the running average of its weights since fake quant began
    # (step 1), trained as without it; the checkpoint keeps the average, so a run stopped resumes exactly
    common = dict(TRAIN, data_dir=setup["data"], init_from=setup["student"], teacher_init=setup["teacher"],
                  quantizer="8da4w", fake_quant_after_n_steps=1, lr_decay_iters=TRAIN["max_iters"])
    steps, decay = TRAIN["max_iters"], 0.5
    dirs = {k: str(tmp_path / str(k)) for k in (*range(1, steps + 1), "averaged", "stopped")}
    run_in_one_process([("kd_train.py", dict(common, out_dir=dirs[k], max_iters=k)) for k in range(1, steps + 1)]
                       + [("kd_train.py", dict(common, out_dir=dirs["averaged"], ema_decay=decay))], tmp_path)
    plain = [weights(os.path.join(dirs[k], "ckpt.pt")) for k in range(1, steps + 1)]
    straight = read_log(dirs["averaged"])
    assert_same_training(train_lines(straight), train_lines(read_log(dirs[steps])))
    averaged = weights(os.path.join(dirs["averaged"], "model.pt"))
    assert_same_weights(averaged, running_average(plain, decay), atol=1e-6)
    assert max((averaged[k] - plain[-1][k]).abs().max().item() for k in averaged) > 1e-3  # not the last step's
    assert [(r["iter"], r["event"]) for r in straight if "event" in r] == [(1, "fake_quant_enabled"), (steps, "weights_averaged")]
    settings = dict(common, out_dir=dirs["stopped"], ema_decay=decay)
    r = run_patched("kd_train.py", STOP_AFTER_CHECKPOINT, env=ENV, **dict(settings, ckpt_interval=2))
    assert r.returncode == 0 and torch.load(os.path.join(dirs["stopped"], "ckpt.pt"), weights_only=True)["iter_num"] == 2, r.stderr[-4000:]
    # a resume with no step left to take (max_iters at the checkpoint's step) ends the run there, with the average
    shutil.copytree(dirs["stopped"], tmp_path / "ended")
    r = run("kd_train.py", env=ENV, **dict(settings, out_dir=str(tmp_path / "ended"), init_from="resume", max_iters=2))
    assert "step 2: no step left to take (max_iters=2): weights replaced by their running average" in r.stdout
    assert_same_weights(weights(os.path.join(tmp_path / "ended", "model.pt")), running_average(plain[:2], decay), atol=1e-6)
    run("kd_train.py", env=ENV, **dict(settings, init_from="resume"))
    assert_same_training(train_lines(read_log(dirs["stopped"])), train_lines(straight))
    assert_same_weights(weights(os.path.join(dirs["stopped"], "model.pt")), averaged, atol=1e-6)
    assert read_log(dirs["stopped"])[-1]["quant_val_loss"] == pytest.approx(straight[-1]["quant_val_loss"], rel=1e-6)
    r = run("kd_train.py", check=False, env=ENV, **dict(settings, init_from="resume", ema_decay=0.9))
    assert r.returncode == 2 and f"was trained with ema_decay={decay}; resume with the same" in r.stderr, r.stderr[-2000:]


def test_qad_delayed_learned_scales_and_resume_settings(setup, tmp_path):
    # with fake quant from step 1 the learned scales start from step 1's weights: that step is the
    # dynamic-scale run's; a resume trains with its own weight decay, betas and scale learning
    # rate, not those of the optimizer state it loads
    common = dict(BASE, data_dir=setup["data"], init_from=setup["teacher"], teacher_init=setup["teacher"],
                  quantizer="8da2w", max_iters=2, learning_rate=1e-2, kd_ratio=0.5)
    learned, dynamic, resumed, early = (str(tmp_path / n) for n in ("learned", "dynamic", "resumed", "early"))
    # ... and a run stopped before its fake quant began (its scales have no optimizer state yet) resumes as the straight run
    chain = dict(common, out_dir=early, range_learning=True, fake_quant_after_n_steps=1, lr_decay_iters=2)
    run_in_one_process([("kd_train.py", dict(common, out_dir=learned, range_learning=True, fake_quant_after_n_steps=1)),
                        ("kd_train.py", dict(chain, max_iters=1)), ("kd_train.py", dict(chain, init_from="resume")),
                        ("kd_train.py", dict(common, out_dir=dynamic, fake_quant_after_n_steps=1)),
                        # quant_skip as a user may write it, compared as normalized ('layers.0')
                        ("kd_train.py", dict(common, out_dir=resumed, range_learning=True, max_iters=1, range_lr_ratio=0.01,
                                             quant_skip=("layers.0.",))),
                        ("kd_train.py", dict(common, out_dir=resumed, range_learning=True, init_from="resume", weight_decay=0.0,
                                             beta2=0.99, range_lr_ratio=1.0, quant_skip=("layers.0.",))),
                        # converted untrained from that QAD checkpoint: what it was trained as, with its learned scales
                        ("kd_train.py", dict(common, out_dir=str(tmp_path / "again"), range_learning=True, max_iters=0,
                                             init_from=os.path.join(learned, "ckpt.pt")))], tmp_path)
    ours, again = read_log(learned)[-1], read_log(tmp_path / "again")[-1]
    assert again["method"] == "qad" and again["quant_val_loss"] == pytest.approx(ours["quant_val_loss"], rel=1e-6)
    a, b = (train_lines(read_log(d))[1] for d in (learned, dynamic))
    assert a["fake_quant"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    ends = [torch.load(os.path.join(d, "ckpt.pt"), weights_only=True)["model"] for d in (learned, early)]
    assert ends[0].keys() == ends[1].keys() and any(k.endswith("learned_scale") for k in ends[0])
    assert max((ends[0][k] - ends[1][k]).abs().max().item() for k in ends[0]) < 1e-6
    groups = torch.load(os.path.join(resumed, "ckpt.pt"), weights_only=True)["optimizer"]["param_groups"]
    assert all(g["weight_decay"] == 0.0 and tuple(g["betas"]) == (0.9, 0.99) for g in groups)
    assert [g.get("lr_ratio") for g in groups][-1] == 1.0


ERRORS = {
    "kd_divergence": "kd_divergence='kl' is unknown",
    "kd_ratio": "kd_ratio=1.5 and jsd_beta=0.5 are weights: each must lie in [0, 1]",
    "kd_ratio_negative": "kd_ratio=-0.1 must be a number >= 0",
    "lora_with_quantizer": "lora_rank",
    "norm_lr_ratio_with_lora": "norm_lr_ratio sets the RMSNorm gains' learning rate, and lora_rank > 0 trains the adapters alone",
    "norm_lr_ratio_zero": "norm_lr_ratio=0.0 must be",
    "lora_alpha_zero": "lora_alpha=0.0 and lora_dropout=0.0: the adapters train only with lora_alpha > 0 and lora_dropout < 1",
    "lora_dropout_one": "lora_alpha=16.0 and lora_dropout=1.0: the adapters train only",
    "adapter_only_without_lora": "save_adapter_only=True needs LoRA",
    "student_vocab": "the student has 2000 vocabulary rows",
    "teacher_vocab": "the teacher has only 200",
    "lora_setting_without_lora": "lora_alpha only matter with LoRA",
    "jsd_beta_without_jsd": "jsd_beta only matters with kd_divergence='jsd'",
    "group_size_without_quantizer": "group_size only matter with a quantizer",
    "range_learning_without_quantizer": "range_learning only matter with a quantizer",
    "teacher_topk_online": "teacher_topk only matters with a top-k store",
    "hf_export_transformers_refuses": "export_format='hf': transformers refuses a model of dim 64 over 6 heads",
}


@pytest.mark.parametrize("name", ERRORS)
def test_user_errors_are_one_clear_line(misc_runs, name):
    settings, code, err = misc_runs[name]
    assert code == 2, err[-4000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and ERRORS[name] in lines[0], err
    assert not os.path.exists(os.path.join(settings["out_dir"], "log.jsonl"))  # failed before any work


def test_vocab_mismatch_error_from_a_real_process(misc_runs):
    # the same check as above, seen from outside: exit code and stderr of a fresh interpreter
    settings = misc_runs["student_vocab"][0]
    r = run("kd_train.py", check=False, env=ENV, **settings)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr and "teacher and student must share one" in r.stderr
    # the toy checkpoints record no tokenizer: only their vocabularies hold them to the data, and the run says so
    assert f"warning: init_from={settings['init_from']!r} records no tokenizer, so nothing checks" in r.stdout, r.stdout[-2000:]
