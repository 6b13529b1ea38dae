"""qat_train.py end to end on a toy model and a tiny synthetic corpus: one process against two
(FSDP2 on gloo), accumulation, the fake-quant switch, resume (also after a kill), conversion,
PTQ, the loss mask, precision and memory options, and every user error."""

import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

logging.getLogger("torchao").setLevel(logging.ERROR)
from torchao.quantization import (  # noqa: E402
    Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, PerGroup, quantize_,
)
from torchao.quantization.qat import QATConfig  # noqa: E402

from configurator import TRAINING_ONLY  # noqa: E402
from conftest import DETACHED_WEIGHTS, STOP_AFTER_CHECKPOINT, ZEROED_GRADIENTS, command, make_data, read_log, run, run_early_exits, run_patched, script_env  # noqa: E402
from model import IGNORE_INDEX, ModelArgs, Transformer, initial_scales, learn_scales  # noqa: E402

SCRIPT = "qat_train.py"
# 6 steps of a 2-layer dim-64 model: each run is mostly interpreter and import start-up
BASE = dict(preset="toy", block_size=32, batch_size=4, gradient_accumulation_steps=2, max_iters=6,
            warmup_iters=2, learning_rate=1e-2, min_lr=1e-3, eval_interval=1000, eval_iters=2,
            log_interval=1, ckpt_interval=1000, quantizer="none", seed=1337)
N = 2  # fake_quant_after_n_steps of the QAT runs: steps 0 and 1 in full precision
QAT = dict(quantizer="8da4w", group_size=32, fake_quant_after_n_steps=N)
FINETUNE = {k: v for k, v in BASE.items() if k != "preset"}  # a checkpoint carries its own shape
CONVERT = {k: v for k, v in FINETUNE.items() if k not in TRAINING_ONLY}  # convert_only refuses training settings


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def train(tmp_path_factory, data):
    """train(nproc=1, **settings) -> out_dir of a finished run of BASE + settings; runs with the
    same settings are shared by the tests of this module (treat their out_dirs as read-only)."""
    done = {}

    def _train(nproc=1, **settings):
        key = (nproc, tuple(sorted(settings.items())))
        if key not in done:
            out = tmp_path_factory.mktemp("run")
            run(SCRIPT, nproc=nproc, **{**BASE, "data_dir": data, "out_dir": out, **settings})
            done[key] = out
        return done[key]

    return _train


def losses(log):
    return {r["iter"]: r["loss"] for r in log if "loss" in r}


def records(log):
    return {r["iter"]: r for r in log if "loss" in r}


def summary(log):
    return [r for r in log if "fp_val_loss" in r][-1]


def weights(out_dir):
    return torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)["model"]


def assert_same_losses(a, b, rel):
    assert a.keys() == b.keys()
    for it in a:
        assert a[it] == pytest.approx(b[it], rel=rel), f"iter {it}: {a[it]} vs {b[it]}"


def max_weight_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def base_config(quantizer, group_size):
    """The torchao config qat_train.py quantizes Linear layers with ('8daNw' or 'Nw')."""
    act, bits = re.fullmatch(r"(8da)?([2-8])w", quantizer).groups()
    w_dtype = getattr(torch, f"int{bits}")
    if act is None:
        return IntxWeightOnlyConfig(weight_dtype=w_dtype, granularity=PerGroup(group_size))
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=w_dtype, weight_granularity=PerGroup(group_size))


def is_linear(module, fqn):
    return isinstance(module, nn.Linear)


@torch.no_grad()
def full_val_loss(model, data_dir, block_size):
    """Mean cross-entropy over every non-overlapping window of the val split, as the script's
    final evaluation defines it."""
    val = torch.from_numpy(np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16).astype(np.int64))
    x, y = val[:-1], val[1:]
    pad = -len(x) % block_size  # the last window is partial: its missing targets are ignored
    x = torch.cat((x, torch.zeros(pad, dtype=torch.long))).view(-1, block_size)
    y = torch.cat((y, torch.full((pad,), IGNORE_INDEX))).view(-1, block_size)
    return model(x, y).item()


# -----------------------------------------------------------------------------
# distributed and accumulation invariance

# fake quant turns the float noise of a different reduction order into rounding flips, which
# Adam then amplifies (1e-3 apart after 6 steps): after 2 steps a flip or two moves the loss by
# a few 1e-5, far below what a wrong normalization or a missed rank would (>= 1e-2)
@pytest.mark.parametrize("settings", [{}, dict(QAT, fake_quant_after_n_steps=0, max_iters=2)], ids=["none", "qat"])
def test_two_processes_match_one(train, settings):
    # the same global batch of 8 windows: one process accumulates 2 micro-batches of 4, two
    # processes take one each and FSDP2 averages their gradients
    one, two = read_log(train(**settings)), read_log(train(nproc=2, **settings))
    assert sorted(losses(one)) == list(range(1, settings.get("max_iters", 6) + 1))
    assert all(r["fake_quant"] == bool(settings) for r in records(one).values())
    assert_same_losses(losses(two), losses(one), rel=2e-4 if settings else 1e-5)
    assert losses(two)[1] == pytest.approx(losses(one)[1], rel=1e-6)  # the same weights: no flip yet
    # the global gradient norm (clipping at 1.0 is active here) is over both ranks' shards
    for it, r in records(one).items():
        assert records(two)[it]["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4 if it == 1 or not settings else 2e-3)
        assert records(two)[it]["fake_quant"] == r["fake_quant"]
    w1, w2 = weights(train(**settings)), weights(train(nproc=2, **settings))
    if settings:
        # step 1's weights agree to 1e-8; one 4-bit rounding flip in step 2's forward then shifts
        # every gradient a little, which can turn the sign of Adam's step for small gradients:
        # the weights then differ by up to one step's size, the learning rate, not by float noise
        assert max_weight_diff(w2, w1) < BASE["learning_rate"]
    else:
        assert max_weight_diff(w2, w1) < 1e-5
    # the final evaluation splits the val windows over the ranks, padding the last round
    assert summary(two)["fp_val_loss"] == pytest.approx(summary(one)["fp_val_loss"], rel=2e-4 if settings else 1e-5)
    if settings:
        assert summary(two)["method"] == summary(one)["method"] == "qat"
        # weights 1e-7 apart can round to different 4-bit levels: a handful of flips at most
        assert summary(two)["quant_val_loss"] == pytest.approx(summary(one)["quant_val_loss"], rel=1e-3)


def test_accumulation_invariance(train):
    # 2 micro-batches of 4 windows == 1 micro-batch of 8: the loss is normalized per step
    acc, big = train(), train(batch_size=8, gradient_accumulation_steps=1)
    assert_same_losses(losses(read_log(acc)), losses(read_log(big)), rel=1e-5)
    # Adam and clipping forgive a gradient scaled by the number of micro-batches; the norm does not
    for it, r in records(read_log(acc)).items():
        assert r["grad_norm"] == pytest.approx(records(read_log(big))[it]["grad_norm"], rel=1e-4)
    assert max_weight_diff(weights(acc), weights(big)) < 1e-5


# -----------------------------------------------------------------------------
# the fake-quant switch, and resume on either side of it

def test_fake_quant_switches_on_at_step_n(train):
    plain, qat = read_log(train()), read_log(train(**QAT))
    assert [r["fake_quant"] for r in records(qat).values()] == [it > N for it in range(1, 7)]
    assert [r["fake_quant"] for r in records(plain).values()] == [False] * 6
    # iter i logs step i - 1: steps before N are the plain run's exactly, then fake quant shows
    for it, loss in losses(qat).items():
        if it <= N:
            assert loss == pytest.approx(losses(plain)[it], rel=1e-6), it
        else:
            assert abs(loss - losses(plain)[it]) > 1e-4, it
    assert [r["iter"] for r in qat if r.get("event") == "fake_quant_enabled"] == [N]
    # the evaluation at the end says whose loss it is: the fake-quantized model's
    assert [(r["iter"], r["fake_quant"]) for log in (qat, plain) for r in log if "val_loss" in r] == [(6, True), (6, False)]
    assert summary(qat)["method"] == "qat"
    assert weights(train(**QAT)).keys() == weights(train()).keys()  # fake quant adds no state


@pytest.mark.parametrize("nproc", [1, 2], ids=["one_process", "two_processes"])
def test_learned_scales_start_from_the_weights_where_fake_quant_starts(train, nproc):
    # with fake quant from step N the learned scales are set from step N's weights, not step 0's:
    # that first fake-quantized step is plain QAT's step, which computes its scales then (on two
    # processes each rank sets the scales of its own rows)
    qat = dict(QAT, quantizer="8da2w", max_iters=N + 1)
    learned, dynamic = losses(read_log(train(nproc, **qat, range_learning=True))), losses(read_log(train(nproc, **qat)))
    assert learned[N + 1] == pytest.approx(dynamic[N + 1], rel=1e-5)


def test_resume_across_fake_quant_switch(train, data, tmp_path):
    # stop a 6-step run (lr_decay_iters keeps its schedule) at 1 (before N), at N and at 4 (after
    # N); each resume must continue exactly as the straight run
    straight = train(**QAT)
    out = tmp_path / "chain"
    settings = {**BASE, **QAT, "data_dir": data, "out_dir": out, "lr_decay_iters": 6}
    trained_with_fake_quant = {}
    for stop in (1, 2, 4, 6):
        run(SCRIPT, **{**settings, "max_iters": stop, "init_from": "scratch" if stop == 1 else "resume"})
        ckpt = torch.load(out / "ckpt.pt", weights_only=True)
        assert ckpt["iter_num"] == stop
        trained_with_fake_quant[stop] = ckpt["fake_quant"]
        # a run that stops before any fake-quantized step is a PTQ run
        assert summary(read_log(out))["method"] == ("qat" if stop > N else "ptq")
    # the checkpoint records whether its weights were trained with fake quant (convert_only's 'method')
    assert trained_with_fake_quant == {1: False, 2: False, 4: True, 6: True}
    log = read_log(out)
    assert [r["iter"] for r in log if "loss" in r] == list(range(1, 7))  # each step logged once
    assert [r["fake_quant"] for r in records(log).values()] == [it > N for it in range(1, 7)]
    assert_same_losses(losses(log), losses(read_log(straight)), rel=1e-6)
    assert max_weight_diff(weights(out), weights(straight)) < 1e-6
    assert summary(log)["quant_val_loss"] == pytest.approx(summary(read_log(straight))["quant_val_loss"], rel=1e-6)


@pytest.mark.parametrize("kind", ["one_optimizer", "optimizer_in_bwd", "sharded"])
def test_learned_scales_resume_from_before_fake_quant(train, data, tmp_path, kind):
    # learned scales get no gradient until fake quant starts, so AdamW would have no state for them
    # yet: a checkpoint written before then must resume as the straight run does, and writing one
    # must not change the training (torch's state-dict helpers would step a stateless optimizer once)
    rl = dict(QAT, quantizer="8da2w", range_learning=True)
    rl.update({"one_optimizer": {}, "sharded": dict(sharded_checkpoint=True),
               "optimizer_in_bwd": dict(optimizer_in_bwd=True, gradient_accumulation_steps=1, grad_clip=float("inf"))}[kind])
    log = read_log(train(**rl))
    straight = summary(log), losses(log)
    assert_same_losses(losses(read_log(train(**rl, ckpt_interval=1))), straight[1], rel=1e-6)
    out = tmp_path / "resumed"
    settings = {**BASE, **rl, "data_dir": data, "out_dir": out, "lr_decay_iters": BASE["max_iters"]}
    run(SCRIPT, **{**settings, "max_iters": 1})
    if kind == "one_optimizer":
        # nanotune before 97aaf67 wrote no state for the scales there: resuming it is refused in
        # one line (torch's is a traceback), converting it needs none
        old = Path(shutil.copytree(out, tmp_path / "old"))
        ckpt = torch.load(old / "ckpt.pt", weights_only=True)
        held = ckpt["optimizer"]["state"]
        ckpt["optimizer"]["state"] = {k: v for k, v in held.items() if not k.endswith("learned_scale")}
        assert len(ckpt["optimizer"]["state"]) < len(held)
        torch.save(ckpt, old / "ckpt.pt")
        r = run(SCRIPT, check=False, **{**settings, "out_dir": old, "init_from": "resume"})
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: ") and \
            "holds no optimizer state for its" in r.stderr and "init_from=" in r.stderr, r.stderr[-2000:]
        run(SCRIPT, **{**CONVERT, "preset": BASE["preset"], "data_dir": data, "out_dir": old, "init_from": "resume",
                       "convert_only": True, "quantizer": "8da2w", "range_learning": True})
        assert (old / "quantized.pt").exists() and summary(read_log(old))["method"] == "ptq"
    run(SCRIPT, **{**settings, "init_from": "resume"})
    assert_same_losses(losses(read_log(out)), straight[1], rel=1e-6)
    resumed = summary(read_log(out))
    assert resumed["method"] == straight[0]["method"] == "qat"
    assert resumed["quant_val_loss"] == pytest.approx(straight[0]["quant_val_loss"], rel=1e-6)


def test_kill_and_resume_reproduces_straight_run(train, data, tmp_path):
    # killed right after its first checkpoint (any checkpoint must reproduce, so the timing of
    # the kill does not matter), then resumed: the steps after it must be the straight run's
    steps = 30
    straight = train(**QAT, max_iters=steps)
    out = tmp_path / "killed"
    settings = {**BASE, **QAT, "data_dir": data, "out_dir": out, "max_iters": steps, "ckpt_interval": 2}
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(command(SCRIPT, **settings), cwd=ROOT, env=script_env(),
                                stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 120
            while not (out / "ckpt.pt").exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert (out / "ckpt.pt").exists(), (tmp_path / "stderr.txt").read_text()[-4000:]
    killed_at = torch.load(out / "ckpt.pt", weights_only=True)["iter_num"]
    assert 0 < killed_at < steps  # else there is nothing left to resume
    killed_log = read_log(out)
    assert_same_losses({i: l for i, l in losses(killed_log).items() if i <= killed_at},
                       {i: l for i, l in losses(read_log(straight)).items() if i <= killed_at}, rel=1e-6)
    # a kill inside torch.save leaves a partial temp file beside the last good checkpoint
    (out / "ckpt.pt.tmp").write_bytes(b"half a checkpoint")
    run(SCRIPT, **{**settings, "init_from": "resume"})
    log = read_log(out)
    # the log keeps the steps up to the checkpoint, drops those the kill made to be redone: once each
    assert [r["iter"] for r in log if "loss" in r] == list(range(1, steps + 1))
    assert_same_losses(losses(log), losses(read_log(straight)), rel=1e-6)
    assert [r["fake_quant"] for r in records(log).values()] == [it > N for it in range(1, steps + 1)]
    assert max_weight_diff(weights(out), weights(straight)) < 1e-6
    assert summary(log)["fp_val_loss"] == pytest.approx(summary(read_log(straight))["fp_val_loss"], rel=1e-6)
    assert not (out / "ckpt.pt.tmp").exists() and not (out / "quantized.pt.tmp").exists()


def running_average(trajectory, decay):
    """The weights' running average over trajectory (state dicts, the first the average's start)."""
    average = trajectory[0]
    for w in trajectory[1:]:
        average = {k: v.lerp(w[k], 1 - decay) for k, v in average.items()}
    return average


@pytest.mark.parametrize("sharded", [False, True], ids=["one_file", "sharded"])
def test_weight_average_ends_the_run_and_resumes(train, data, tmp_path, sharded):
    # ema_decay: the run ends with the running average of its weights since fake quant began (step N),
    # trained as without it; a checkpoint keeps the average, so a run stopped after it resumes exactly
    decay, steps = 0.5, N + 2
    plain = {k: weights(train(**QAT, max_iters=k, lr_decay_iters=steps)) for k in range(N, steps + 1)}
    straight = train(**QAT, max_iters=steps, lr_decay_iters=steps, ema_decay=decay)
    log = read_log(straight)
    assert_same_losses(losses(log), losses(read_log(train(**QAT, max_iters=steps, lr_decay_iters=steps))), rel=1e-6)
    assert max_weight_diff(weights(straight), running_average([plain[k] for k in range(N, steps + 1)], decay)) < 1e-6
    assert max_weight_diff(weights(straight), plain[steps]) > 1e-3  # not the last step's weights
    assert [(r["iter"], r["event"]) for r in log if "event" in r] == [(N, "fake_quant_enabled"), (steps, "weights_averaged")]
    assert torch.load(os.path.join(straight, "ckpt.pt"), weights_only=True)["weights_averaged"]
    out = tmp_path / "stopped"
    settings = {**BASE, **QAT, "data_dir": data, "out_dir": out, "max_iters": steps, "lr_decay_iters": steps,
                "ema_decay": decay, "sharded_checkpoint": sharded}
    r = run_patched(SCRIPT, STOP_AFTER_CHECKPOINT, **{**settings, "ckpt_interval": N + 1})
    assert r.returncode == 0 and not (out / "quantized.pt").exists(), r.stderr[-4000:]
    run(SCRIPT, **{**settings, "init_from": "resume"})
    resumed = read_log(out)
    assert_same_losses(losses(resumed), losses(log), rel=1e-6)
    for key in ("fp_val_loss", "quant_val_loss"):
        assert summary(resumed)[key] == pytest.approx(summary(log)[key], rel=1e-6)
    assert [(r["iter"], r["event"]) for r in resumed if "event" in r] == [(N, "fake_quant_enabled"), (steps, "weights_averaged")]
    if not sharded:
        # a resume with no step left to take (max_iters at the checkpoint's step) ends the run there, with the average
        shutil.rmtree(out)
        r = run_patched(SCRIPT, STOP_AFTER_CHECKPOINT, **{**settings, "ckpt_interval": N + 1})
        r = run(SCRIPT, **{**settings, "init_from": "resume", "max_iters": N + 1})
        assert f"step {N + 1}: no step left to take (max_iters={N + 1}): weights replaced by their running average" in r.stdout
        ended = summary(read_log(train(**QAT, max_iters=N + 1, lr_decay_iters=steps, ema_decay=decay)))
        for key in ("fp_val_loss", "quant_val_loss"):
            assert summary(read_log(out))[key] == pytest.approx(ended[key], rel=1e-6)
        assert [(r["iter"], r["event"]) for r in read_log(out) if "event" in r][-1] == (N + 1, "weights_averaged")
        run(SCRIPT, **{**settings, "init_from": "resume"})
        assert max_weight_diff(weights(out), weights(straight)) < 1e-6
        # the average it holds is that decay's: another is refused
        r = run(SCRIPT, check=False, **{**settings, "init_from": "resume", "ema_decay": 0.9})
        assert r.returncode == 2 and f"was trained with ema_decay={decay}; resume with the same" in r.stderr, r.stderr[-2000:]


def test_weight_average_two_processes_match_one(train):
    # each process averages its own shards of the weights
    one, two = (weights(train(nproc, max_iters=4, ema_decay=0.5)) for nproc in (1, 2))
    assert max_weight_diff(two, one) < 1e-5
    assert max_weight_diff(one, weights(train(max_iters=4))) > 1e-3


@pytest.mark.parametrize("script, store", [(SCRIPT, False), ("kd_train.py", False), ("kd_train.py", True)])
def test_data_changed_under_a_run_stops_it(script, store, tmp_path):
    # data_prep.py run again into data_dir while a run reads it (or a teacher's top-k store written again):
    # the run stops at its next batch rather than train on other data, and a run started on bins unlike
    # their meta.json does not start
    data = make_data(tmp_path / "data")
    out = tmp_path / "out"
    settings = {**BASE, "data_dir": data, "out_dir": out, "max_iters": 100_000}
    if script == "kd_train.py":  # a student from scratch, and a teacher of the same shape trained one step
        run(SCRIPT, **{**BASE, "data_dir": data, "out_dir": tmp_path / "teacher", "max_iters": 1})
        settings["teacher_init"] = str(tmp_path / "teacher" / "ckpt.pt")
    write = dict(data_dir=data, teacher_init=settings.get("teacher_init"), batch_size=BASE["batch_size"],
                 block_size=BASE["block_size"], topk_write=True, teacher_topk=8, teacher_topk_dir=tmp_path / "store",
                 out_dir=tmp_path / "w")
    if store:
        run(script, **write)
        settings.update(teacher_topk_dir=str(tmp_path / "store"))
    changed = os.path.join(tmp_path / "store", "ids.bin") if store else os.path.join(data, "train.bin")
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(command(script, **settings), cwd=ROOT, env=script_env(), stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 120
            while not (out / "log.jsonl").exists() or not any("loss" in r for r in read_log(out)):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()[-4000:]
                time.sleep(0.01)
            if store:  # written again, as the store's writer does it: its files truncated and refilled in place
                os.remove(tmp_path / "store" / "meta.json")
                run(script, **write)
            else:  # as data_prep.py moves its files in: another file of the same size in the same place
                new = np.fromfile(changed, dtype=np.uint16)[::-1].copy()
                new.tofile(changed + ".new")
                os.replace(changed + ".new", changed)
            proc.wait(timeout=120)
        finally:
            proc.kill()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 2 and (f"{changed} changed during the run ("
                                     f"{'a store written again into' if store else 'data prepared again into'}") in stderr, stderr[-4000:]
    with open(os.path.join(data, "train.bin"), "ab") as f:
        f.write(bytes(64))
    r = run(script, check=False, **{**settings, "out_dir": tmp_path / "out2"})
    assert r.returncode == 2 and "train.bin is 16,448 bytes where" in r.stderr and "meta.json says 16,384 bytes" in r.stderr


def test_default_accumulation_and_hsdp_under_torchrun(train, data):
    # no gradient_accumulation_steps: one micro-batch per process, at any process count
    settings = dict(gradient_accumulation_steps=0)  # the default
    plain = read_log(train(nproc=2, **settings))
    assert [r["iter"] for r in plain if "loss" in r] == list(range(1, 7))
    # HSDP: 2 replicas of a 1-process shard compute what plain FSDP over 2 processes does
    hsdp = read_log(train(nproc=2, replicate_degree=2, **settings))
    assert_same_losses(losses(hsdp), losses(plain), rel=1e-5)


def test_resume_rewrites_the_log_whole(train, data, tmp_path):
    # resuming a finished run (after a kill that tore the log's last line in half) redoes the final
    # evaluation: the log keeps each step once, one summary, and no torn line
    out = tmp_path / "done"
    shutil.copytree(train(), out)
    with open(out / "log.jsonl", "a") as f:
        f.write('{"iter": 6, "lo')
    run(SCRIPT, **{**BASE, "data_dir": data, "out_dir": out, "init_from": "resume"})
    log = read_log(out)
    assert sorted(losses(log)) == list(range(1, 7)) and len([r for r in log if "loss" in r]) == 6
    assert len([r for r in log if "fp_val_loss" in r]) == 1 and not (out / "log.jsonl.tmp").exists()


def test_out_dir_in_use_is_refused(train, data, tmp_path):
    # another process holds out_dir (a second run, or workers a killed torchrun left behind): the
    # run stops before it touches anything there, and goes ahead once the holder is gone
    out = tmp_path / "run"
    shutil.copytree(train(), out)
    before = (out / "log.jsonl").read_text()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                               "fcntl.lockf(f, fcntl.LOCK_EX); f.truncate(0); f.write('4242'); f.flush(); print('held', flush=True); "
                               "time.sleep(600)", str(out / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = run(SCRIPT, check=False, **{**BASE, "data_dir": data, "out_dir": out, "init_from": "resume", "max_iters": 8})
        assert r.returncode == 2 and "in use by another run (process 4242)" in r.stderr, r.stderr[-2000:]
        assert (out / "log.jsonl").read_text() == before and not (out / "log.jsonl.prev").exists()
    finally:
        holder.kill()
        holder.wait()
    run(SCRIPT, **{**BASE, "data_dir": data, "out_dir": out, "init_from": "resume", "max_iters": 8})
    assert max(losses(read_log(out))) == 8


def test_export_with_learned_scales_is_scored_as_another_tool_rounds_it(train, data, tmp_path):
    # an export holds the unquantized weights: a tool that quantizes it rounds on max-based scales, so
    # with learned ones that is another model, whose loss the run reports beside the converted one's
    out = train(**{**QAT, "quantizer": "8da2w"}, range_learning=True, export_format="meta")
    s = summary(read_log(out))
    ptq = tmp_path / "ptq"
    run(SCRIPT, **{**CONVERT, "data_dir": data, "out_dir": ptq, "init_from": out / "export_meta", "convert_only": True,
                   "quantizer": "8da2w", "group_size": 32})
    assert s["method"] == "qat" and s["export_ptq_val_loss"] == pytest.approx(summary(read_log(ptq))["quant_val_loss"], rel=1e-6)
    assert abs(s["export_ptq_val_loss"] - s["quant_val_loss"]) > 1e-4  # the learned scales made another model
    # and scoring it leaves the converted model as a run without an export converts it
    plain = summary(read_log(train(**{**QAT, "quantizer": "8da2w"}, range_learning=True)))
    assert s["quant_val_loss"] == pytest.approx(plain["quant_val_loss"], rel=1e-6)
    # without learned scales the export rounds back to the converted model itself: nothing to add
    assert "export_ptq_val_loss" not in summary(read_log(train(**QAT, export_format="meta")))


def test_earlier_runs_outputs_are_removed_not_left_beside_new_weights(train, data, tmp_path):
    # a QAT run's quantized.pt and export, then a plain finetune from that export in the same out_dir:
    # the quantized model is not this run's and goes; the export is this run's input and stays
    out = tmp_path / "run"
    shutil.copytree(train(**QAT, export_format="meta"), out)
    assert (out / "quantized.pt").exists() and (out / "export_meta" / "params.json").exists()
    # what a killed run leaves half-written: a checkpoint's temp file, an export's hidden temp folders
    killed = ["ckpt.pt.tmp", ".export_hf.tmpk2x9", ".export_hf.tmpk2x9.old", "ckpt.tmp"]
    for name in killed:
        (out / name).mkdir() if "export" in name or name == "ckpt.tmp" else (out / name).write_bytes(b"half")
    (out / ".export_hf.tmpk2x9" / "model.safetensors").write_bytes(b"half")
    (out / "notes.tmp").write_text("the user's")
    # and an earlier run's tokenizer, which sample.py and the exports would read as this data's (it has none)
    stale = ["tokenizer.json", "tokenizer_config.json"]
    for name in stale:
        (out / name).write_text("{}")
    r = run(SCRIPT, **{**FINETUNE, "data_dir": data, "out_dir": out, "init_from": str(out / "export_meta"), "max_iters": 1})
    for name in stale:
        assert f"removed {out / name}: an earlier run's tokenizer file" in r.stdout and not (out / name).exists()
    assert f"removed {out / 'quantized.pt'}: an earlier run's output" in r.stdout
    assert not (out / "quantized.pt").exists() and (out / "export_meta" / "params.json").exists()
    for name in killed:
        assert f"removed {out / name}: an unfinished write of a run that was killed" in r.stdout
        assert not (out / name).exists()
    assert (out / "notes.tmp").exists()
    assert r.stdout.count("removed") == 1 + len(killed) + len(stale)


def test_non_finite_loss_stops_the_run_before_its_checkpoint(data, tmp_path):
    # a learning rate so large that step 1's update overflows step 2's loss or gradient (which of
    # the two first is a matter of float rounding)
    out, huge = tmp_path / "run", dict(BASE, data_dir=data, learning_rate=1e30)
    r = run(SCRIPT, check=False, **{**huge, "out_dir": out, "log_interval": 5, "ckpt_interval": 1})
    assert r.returncode == 2 and re.search(rf"step 2: the (loss|gradient) is not finite; stopped, and {re.escape(str(out))} "
                                           r"keeps the checkpoint of step 1; lower learning_rate or grad_clip\n", r.stderr), r.stderr[-2000:]
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 1  # not overwritten with step 2's
    # found at a log line too, by every rank, in a resumed run
    r = run(SCRIPT, check=False, nproc=2, **{**huge, "out_dir": out, "init_from": "resume", "log_interval": 1, "ckpt_interval": 100})
    assert r.returncode != 0 and re.search(r"step 2: the (loss|gradient) is not finite; stopped, and .* keeps the checkpoint "
                                           r"of step 1", r.stderr), r.stderr[-2000:]
    assert r.stderr.count("error:") == 1, r.stderr[-2000:]  # rank 0's line alone
    # and with the optimizer stepped inside backward, in bfloat16
    r = run(SCRIPT, check=False, **{**huge, "out_dir": tmp_path / "in_bwd", "optimizer_in_bwd": True, "dtype": "bfloat16",
                                    "grad_clip": float("inf"), "gradient_accumulation_steps": 1})
    assert r.returncode == 2 and re.search(r"step 2: the (loss|gradient) is not finite; stopped, and no checkpoint was written; "
                                           r"lower learning_rate or grad_clip, or train in float32", r.stderr), r.stderr[-2000:]


def test_weights_no_gradient_reaches_stop_the_run(data, tmp_path):
    # AdamW passes over a weight without a gradient: the first step finds them and stops, in one line
    qat = dict(BASE, **QAT, data_dir=data) | {"fake_quant_after_n_steps": 0}
    r = run_patched(SCRIPT, DETACHED_WEIGHTS, **qat, out_dir=tmp_path / "one")
    assert r.returncode == 2 and re.search(r"error: step 1: no gradient reached layers\.0\.attention\.wq\.weight, "
                                           r"layers\.0\.attention\.wk\.weight, layers\.0\.attention\.wv\.weight and others: "
                                           r"the loss does not depend on them as trained\n", r.stderr), r.stderr[-2000:]
    assert not (tmp_path / "one" / "ckpt.pt").exists()
    # gradients that reach every weight as zeros: AdamW would move them by weight decay alone
    r = run_patched(SCRIPT, ZEROED_GRADIENTS, **qat, out_dir=tmp_path / "zero")
    assert r.returncode == 2 and re.search(r"error: step 1: the gradient was zero everywhere for tok_embeddings\.weight, "
                                           r"layers\.0\.attention\.wq\.weight, layers\.0\.attention\.wk\.weight and others: "
                                           r"the loss does not depend on them as trained\n", r.stderr), r.stderr[-2000:]
    # while fake quant is off the same fault is no fault (the weights pass unquantized), nor are learned scales without gradients
    r = run_patched(SCRIPT, DETACHED_WEIGHTS, **dict(qat, fake_quant_after_n_steps=N, range_learning=True, max_iters=N),
                    out_dir=tmp_path / "off")
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_fresh_run_killed_before_its_first_checkpoint_leaves_none_to_resume(train, data, tmp_path):
    # an earlier run's checkpoint in out_dir is set aside: a resume would continue it under this run's
    # settings and log, sample.py would take it for this run's
    out = tmp_path / "run"
    shutil.copytree(train(), out)
    # a run refused before it starts moves nothing
    r = run(SCRIPT, check=False, **{**BASE, "data_dir": data, "out_dir": out, "batch_size": 1000})
    assert r.returncode == 2 and "fewer than one step's" in r.stderr and (out / "ckpt.pt").exists(), r.stderr[-2000:]
    r = run(SCRIPT, check=False, **{**BASE, "data_dir": data, "out_dir": out, "learning_rate": 1e30, "ckpt_interval": 100})
    assert r.returncode == 2 and "no checkpoint was written" in r.stderr, r.stderr[-2000:]
    assert f"{out / 'ckpt.pt'} held an earlier run's checkpoint: moved to ckpt.pt.prev" in r.stdout
    assert not (out / "ckpt.pt").exists() and (out / "ckpt.pt.prev").exists()
    r = run(SCRIPT, check=False, **{**BASE, "data_dir": data, "out_dir": out, "init_from": "resume"})
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stderr[-2000:]
    # a set-aside checkpoint as a run's input: that run's first save would remove it
    r = run(SCRIPT, check=False, **{**FINETUNE, "data_dir": data, "out_dir": out, "init_from": str(out / "ckpt.pt.prev")})
    assert r.returncode == 2 and "an earlier run's checkpoint set aside, which its first checkpoint removes" in r.stderr
    # kept until this run's first save replaces it
    run(SCRIPT, **{**BASE, "data_dir": data, "out_dir": out, "max_iters": 1})
    assert (out / "ckpt.pt").exists() and not (out / "ckpt.pt.prev").exists()


def test_resume_refuses_other_data(train, data, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(train(), out)
    other = make_data(tmp_path / "other", seed=1)
    r = run(SCRIPT, check=False, **{**BASE, "data_dir": other, "out_dir": out, "init_from": "resume", "max_iters": 8})
    assert r.returncode == 2 and "not the data" in r.stderr, r.stderr[-2000:]
    # data made by hand (no file fingerprints in its meta.json) is held to its files' sizes: a resume
    # on other hand-made data is refused too, and a checkpoint that records no data at all (one trained
    # on such data before the sizes were kept) resumes on nothing
    by_hand = {}
    for name, tokens in (("hand", 8192), ("hand_other", 8192 + 512)):
        by_hand[name] = make_data(tmp_path / name, train_tokens=tokens)
        meta = json.loads((tmp_path / name / "meta.json").read_text())
        (tmp_path / name / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "data"}))
    run(SCRIPT, **{**BASE, "data_dir": by_hand["hand"], "out_dir": tmp_path / "hand_run", "max_iters": 2})
    r = run(SCRIPT, check=False, **{**BASE, "data_dir": by_hand["hand_other"], "out_dir": tmp_path / "hand_run",
                                    "init_from": "resume", "max_iters": 4})
    assert r.returncode == 2 and "not the data" in r.stderr, r.stderr[-2000:]
    ckpt = torch.load(tmp_path / "hand_run" / "ckpt.pt", weights_only=False)
    torch.save({**ckpt, "data": None}, tmp_path / "hand_run" / "ckpt.pt")
    r = run(SCRIPT, check=False, **{**BASE, "data_dir": by_hand["hand"], "out_dir": tmp_path / "hand_run",
                                    "init_from": "resume", "max_iters": 4})
    assert r.returncode == 2 and "records nothing of the data it was trained on" in r.stderr, r.stderr[-2000:]
    # and a checkpoint trained on data of another tokenizer does not finetune on this one
    other_tok = make_data(tmp_path / "other_tok", tokenizer_id="synthetic-1")
    r = run(SCRIPT, check=False, **{**FINETUNE, "data_dir": other_tok, "out_dir": tmp_path / "ft",
                                    "init_from": str(out / "ckpt.pt")})
    assert r.returncode == 2 and "another tokenizer" in r.stderr, r.stderr[-2000:]
    # a model that records no tokenizer is held to the data by its vocabulary alone: a warning, and
    # more rows than padding explains is another tokenizer's model
    big = make_data(tmp_path / "big", vocab_size=2000)
    meta = json.loads((tmp_path / "big" / "meta.json").read_text())
    (tmp_path / "big" / "meta.json").write_text(json.dumps({**meta, "tokenizer": None}))
    run(SCRIPT, **{**BASE, "data_dir": big, "out_dir": tmp_path / "big_run", "max_iters": 1})
    r = run(SCRIPT, check=False, **{**FINETUNE, "data_dir": data, "out_dir": tmp_path / "ft2",
                                    "init_from": str(tmp_path / "big_run" / "ckpt.pt")})
    assert "records no tokenizer, so nothing checks" in r.stdout, r.stdout[-2000:]
    assert r.returncode == 2 and "2000 vocabulary rows but the data's tokenizer only 256: more than padding" in r.stderr, r.stderr[-2000:]


# -----------------------------------------------------------------------------
# conversion and PTQ

def test_quant_skip_names_whole_modules(train, data, tmp_path):
    # 'layers.1' is that block and what is inside it, nothing that merely starts with the string
    out = tmp_path / "skip"
    run(SCRIPT, **{**CONVERT, "data_dir": data, "out_dir": out, "init_from": str(train() / "ckpt.pt"),
                   "convert_only": True, "quantizer": "8da4w", "group_size": 32, "quant_skip": ("layers.1.",)})
    q = torch.load(out / "quantized.pt", weights_only=False)["model"]
    assert type(q["layers.0.attention.wq.weight"]) is not torch.Tensor  # converted
    assert type(q["layers.1.attention.wq.weight"]) is torch.Tensor  # left in full precision
    assert type(q["output.weight"]) is not torch.Tensor


def test_lora_checkpoint_is_merged_and_labels_follow_what_ran(train, data, tmp_path):
    # a LoRA model (kd_train.py's kind) is QAT-converted as what it computes, W + scale * B @ A
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=256,
                     lora_rank=4, lora_targets=("wq", "wv"))
    lora = Transformer(args)
    lora.init_weights(seed=3)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.05)  # adapters that change the output
    torch.save({"model": lora.state_dict(), "model_args": vars(args)}, tmp_path / "lora.pt")
    out = tmp_path / "lora_out"
    r = run(SCRIPT, **{**CONVERT, "data_dir": data, "out_dir": out, "init_from": str(tmp_path / "lora.pt"),
                       "convert_only": True, "quantizer": "8da4w"})
    assert "merged" in r.stdout
    s = summary(read_log(out))
    assert s["fp_val_loss"] == pytest.approx(full_val_loss(lora.eval(), data, BASE["block_size"]), rel=1e-5)
    assert s["method"] == "ptq"  # never trained under fake quant
    # a QAT checkpoint converted to another scheme is PTQ of those weights, not QAT; a directory
    # holding a QAT checkpoint is QAT
    qat = train(**QAT)
    for quantizer, init, method in (("8da2w", qat / "ckpt.pt", "ptq"), ("8da4w", qat, "qat")):
        o = tmp_path / f"conv_{quantizer}"
        run(SCRIPT, **{**CONVERT, "data_dir": data, "out_dir": o, "init_from": str(init), "convert_only": True,
                       "quantizer": quantizer, "group_size": 32})
        assert summary(read_log(o))["method"] == method, (quantizer, init)


def test_converted_model_matches_fake_quantized_model(train, data):
    out = train(**QAT)
    q = torch.load(out / "quantized.pt", weights_only=False)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert (q["quantizer"], q["group_size"]) == ("8da4w", 32)
    args = ModelArgs.from_dict(q["model_args"])
    cfg = base_config(q["quantizer"], q["group_size"])
    assert type(q["model"]["layers.0.attention.wq.weight"]) is not torch.Tensor  # a torchao tensor
    assert type(q["model"]["tok_embeddings.weight"]) is torch.Tensor  # quantize_embedding=False

    converted = Transformer(args)
    quantize_(converted, cfg, filter_fn=is_linear)
    converted.load_state_dict(q["model"], assign=True)
    plain = Transformer(args)
    plain.load_state_dict(ckpt["model"])
    fake = Transformer(args)
    fake.load_state_dict(ckpt["model"])
    quantize_(fake, QATConfig(cfg, step="prepare"), filter_fn=is_linear)
    assert all(m.weight_fake_quantizer.enabled for m in fake.modules() if hasattr(m, "weight_fake_quantizer"))

    tokens = torch.from_numpy(np.fromfile(os.path.join(data, "val.bin"), dtype=np.uint16)[:128].astype(np.int64))
    with torch.no_grad():
        lq, lf, lp = (m.eval()(tokens.view(2, 64)) for m in (converted, fake, plain))
    assert (lf - lp).abs().max() > 1e-2  # quantization is visible in the logits...
    torch.testing.assert_close(lq, lf, rtol=0, atol=1e-4)  # ...and conversion keeps them
    s = summary(read_log(out))
    fp, fq = full_val_loss(plain, data, BASE["block_size"]), full_val_loss(fake, data, BASE["block_size"])
    assert fp == pytest.approx(s["fp_val_loss"], rel=1e-6)
    assert fq == pytest.approx(s["quant_val_loss"], rel=1e-6)
    assert abs(s["quant_val_loss"] - s["fp_val_loss"]) > 10 * 1e-6 * s["fp_val_loss"]  # 4-bit weights cost a little


def test_range_learning_scales_survive_resume_and_conversion(train, data, tmp_path):
    # learned scales move from torchao's starting ones, are saved, restored on resume and used by
    # the conversion: the converted model computes what the fake-quantized one did
    rl = dict(QAT, quantizer="8da2w", fake_quant_after_n_steps=0, range_learning=True)
    straight = train(**rl)
    out = tmp_path / "resumed"
    settings = {**BASE, **rl, "data_dir": data, "out_dir": out, "lr_decay_iters": BASE["max_iters"]}
    run(SCRIPT, **{**settings, "max_iters": 3})
    run(SCRIPT, **{**settings, "init_from": "resume"})
    assert_same_losses(losses(read_log(out)), losses(read_log(straight)), rel=1e-6)
    ckpt = torch.load(straight / "ckpt.pt", weights_only=True)
    assert max_weight_diff(torch.load(out / "ckpt.pt", weights_only=True)["model"], ckpt["model"]) < 1e-6

    args = ModelArgs.from_dict(ckpt["model_args"])
    fake = Transformer(args)
    quantize_(fake, QATConfig(base_config("8da2w", 32), step="prepare"), filter_fn=is_linear)
    learn_scales(fake)
    fake.load_state_dict(ckpt["model"])  # strict: a scale for every linear layer, nothing else
    start = initial_scales(fake, ckpt["model"])
    assert max((ckpt["model"][k] - v).abs().max().item() for k, v in start.items()) > 1e-3  # they learned
    s = summary(read_log(straight))
    assert s["method"] == "qat"
    assert full_val_loss(fake, data, BASE["block_size"]) == pytest.approx(s["quant_val_loss"], rel=1e-5)
    with torch.no_grad():  # the starting scales give another model: the learned ones are what ran
        for name, scale in start.items():
            fake.get_parameter(name).copy_(scale)
    assert full_val_loss(fake, data, BASE["block_size"]) != pytest.approx(s["quant_val_loss"], rel=1e-4)

    # converting the checkpoint again (init_from, not resume) takes its scales too
    again = tmp_path / "convert"
    run(SCRIPT, **{**CONVERT, **{k: v for k, v in rl.items() if k != "fake_quant_after_n_steps"}, "data_dir": data, "out_dir": again, "init_from": str(straight / "ckpt.pt"),
                   "convert_only": True})
    assert summary(read_log(again))["method"] == "qat"
    assert summary(read_log(again))["quant_val_loss"] == pytest.approx(s["quant_val_loss"], rel=1e-6)
    # a run stopped before its fake quant began holds scales it never trained (its first weights'):
    # a finetune from it starts from the scales of the weights it has, as from a checkpoint without any
    early = tmp_path / "early"
    run(SCRIPT, **{**BASE, **rl, "fake_quant_after_n_steps": 4, "max_iters": 3, "data_dir": data, "out_dir": early})
    ckpt = torch.load(early / "ckpt.pt", weights_only=True)
    ckpt["model"] = {k: v for k, v in ckpt["model"].items() if not k.endswith("learned_scale")}
    torch.save(ckpt, tmp_path / "no_scales.pt")
    for init in (early / "ckpt.pt", tmp_path / "no_scales.pt"):
        run(SCRIPT, **{**FINETUNE, **rl, "data_dir": data, "out_dir": tmp_path / f"ft_{init.stem}", "init_from": str(init),
                       "max_iters": 1})
    assert losses(read_log(tmp_path / "ft_ckpt")) == losses(read_log(tmp_path / "ft_no_scales"))


def test_scales_restart_whether_or_not_an_eval_ran_before(train, data):
    # an evaluation (forward only) leaves FSDP's root (norm, output) gathered: scales restarted into
    # that copy when fake quant starts would be dropped at the next reshard, and the output layer
    # would train and convert on the scales of its first weights
    rl = dict(QAT, quantizer="8da2w", range_learning=True)
    quiet, evaluated = train(**rl), train(**rl, eval_interval=N)
    assert any("val_loss" in r and r["iter"] == N for r in read_log(evaluated))
    assert_same_losses(losses(read_log(evaluated)), losses(read_log(quiet)), rel=1e-6)
    assert max_weight_diff(weights(evaluated), weights(quiet)) < 1e-6


def test_resume_changes_the_schedule_only_when_told(data, tmp_path):
    out = tmp_path / "sched"
    settings = {**BASE, "data_dir": data, "out_dir": out}
    run(SCRIPT, **{**settings, "max_iters": 2})
    # a setting left off the command line: its default is not the checkpoint's value
    r = run(SCRIPT, check=False, **{k: v for k, v in settings.items() if k != "min_lr"}, init_from="resume")
    assert r.returncode == 2 and "was trained with min_lr=0.001, and this run has the default (min_lr=3e-05); give it" in r.stderr
    # given, another value changes the schedule from the checkpoint's step, and the run says so
    r = run(SCRIPT, **{**settings, "init_from": "resume", "max_iters": 3})
    assert "note: the training settings change from the checkpoint's step: max_iters 2 -> 3" in r.stdout
    # the optimizer's settings too: a resume that leaves one out would train on with the default
    run(SCRIPT, **{**settings, "out_dir": tmp_path / "opt", "max_iters": 2, "beta2": 0.99, "norm_lr_ratio": 5.0})
    r = run(SCRIPT, check=False, **{**settings, "out_dir": tmp_path / "opt", "init_from": "resume", "max_iters": 3, "beta2": 0.99})
    assert r.returncode == 2 and "was trained with norm_lr_ratio=5.0, and this run has the default (norm_lr_ratio=1.0)" in r.stderr


def test_resume_applies_this_runs_optimizer_settings(data, tmp_path):
    # the optimizer state a resume loads carries the first run's weight decay, betas and the scales'
    # and norms' learning-rate ratios; the resumed run trains with its own, as its printed config says
    out = tmp_path / "res"
    settings = {**BASE, **QAT, "quantizer": "8da2w", "fake_quant_after_n_steps": 0, "range_learning": True,
                "data_dir": data, "out_dir": out}
    run(SCRIPT, **{**settings, "max_iters": 2, "weight_decay": 0.1, "beta2": 0.95, "range_lr_ratio": 0.01, "norm_lr_ratio": 3.0})
    run(SCRIPT, **{**settings, "max_iters": 3, "init_from": "resume", "weight_decay": 0.0, "beta2": 0.99, "range_lr_ratio": 1.0,
                   "norm_lr_ratio": 1.0})
    groups = torch.load(out / "ckpt.pt", weights_only=True)["optimizer"]["param_groups"]
    assert len(groups) == 3
    assert all(g["weight_decay"] == 0.0 and tuple(g["betas"]) == (0.9, 0.99) for g in groups)
    assert [g.get("lr_ratio") for g in groups] == [None, 1.0, 1.0]


def test_compiled_steps_equal_eager(train):
    # compile=True (each block, and the loss chunk with the output layer) computes what eager does:
    # exactly in full precision; in the first fake-quantized step to within the codes that fused
    # float rounding flips, far closer than to the same step without fake quant
    qat = dict(QAT, quantizer="8da2w")
    compiled, eager, plain = (losses(read_log(train(**qat, compile=True))), losses(read_log(train(**qat))), losses(read_log(train())))
    for it in range(1, N + 1):
        assert compiled[it] == pytest.approx(eager[it], rel=1e-5)
    first = N + 1
    assert abs(compiled[first] - eager[first]) < 0.25 * abs(eager[first] - plain[first])


def test_range_and_norm_lr_ratios_scale_their_parameters_first_step(train, data, tmp_path):
    # AdamW's first step moves each parameter by the learning rate (sign of its gradient): the scales'
    # largest move is the weights' learning rate times range_lr_ratio, the RMSNorm gains' that rate
    # times norm_lr_ratio, while the weights move by the full rate
    base = train()
    start = torch.load(base / "ckpt.pt", weights_only=True)["model"]
    out = tmp_path / "ratio"
    run(SCRIPT, **{**FINETUNE, "quantizer": "8da2w", "range_learning": True, "range_lr_ratio": 0.01, "norm_lr_ratio": 3.0,
                   "weight_decay": 0.0,
                   "data_dir": data, "out_dir": out, "init_from": str(base / "ckpt.pt"), "max_iters": 1, "warmup_iters": 0})
    lr = records(read_log(out))[1]["lr"]
    end = torch.load(out / "ckpt.pt", weights_only=True)["model"]
    fake = Transformer(ModelArgs.from_dict(torch.load(out / "ckpt.pt", weights_only=True)["model_args"]))
    quantize_(fake, QATConfig(base_config("8da2w", 32), step="prepare"), filter_fn=is_linear)
    learn_scales(fake)
    moved = max((end[k] - v).abs().max().item() for k, v in initial_scales(fake, start).items())
    assert moved == pytest.approx(0.01 * lr, rel=2e-2)  # float32 rounding of the scales
    assert max((end[k] - start[k]).abs().max().item() for k in start if k.endswith("wq.weight")) == pytest.approx(lr, rel=1e-3)
    assert max((end[k] - start[k]).abs().max().item() for k in start if k.endswith("norm.weight")) == pytest.approx(3 * lr, rel=1e-3)


def test_ptq_of_plain_checkpoint(train, data, tmp_path):
    base = train()
    out = tmp_path / "ptq"
    run(SCRIPT, **{**CONVERT, "data_dir": data, "out_dir": out, "init_from": str(base / "ckpt.pt"),
                   "convert_only": True, "quantizer": "8da2w"})
    log = read_log(out)
    assert not losses(log)  # no training
    s = summary(log)
    assert s["method"] == "ptq" and s["quantizer"] == "8da2w"
    # the same weights evaluate the same, and 2-bit rounding costs loss
    assert s["fp_val_loss"] == pytest.approx(summary(read_log(base))["fp_val_loss"], rel=1e-6)
    assert s["quant_val_loss"] > s["fp_val_loss"]
    q = torch.load(out / "quantized.pt", weights_only=False)
    assert q["quantizer"] == "8da2w" and q["model"].keys() == weights(base).keys()
    # a fresh run in the same out_dir starts a log of its own; the earlier one is set aside whole
    r = run(SCRIPT, **{**CONVERT, "data_dir": data, "out_dir": out, "init_from": str(base / "ckpt.pt"),
                       "convert_only": True, "quantizer": "8da4w"})
    assert "moved to log.jsonl.prev" in r.stdout
    assert "loaded weights, PTQ 8da4w g32" in r.stdout and "step 0" not in r.stdout  # no step was taken
    assert [x["quantizer"] for x in read_log(out) if "method" in x] == ["8da4w"]
    assert read_log(out, "log.jsonl.prev") == log
    # a conversion into a training run's out_dir sets that run's checkpoint aside with its log: else its
    # ckpt.pt would sit beside this quantized.pt as the weights it came from (sample.py, bench.py deploy, a resume)
    for name, init in (("other", base / "ckpt.pt"), ("own", None)):
        trained = Path(shutil.copytree(base, tmp_path / name))
        r = run(SCRIPT, **{**CONVERT, "data_dir": data, "out_dir": trained, "init_from": init or trained / "ckpt.pt",
                           "convert_only": True, "quantizer": "8da4w"})
        assert (trained / "quantized.pt").exists()
        # the run's own checkpoint, converted where it lies, stays
        assert (trained / "ckpt.pt").exists() == (init is None) and (trained / "ckpt.pt.prev").exists() == (init is not None)


def test_convert_only_resumes_a_run_trained_with_other_loop_settings(train, data, tmp_path):
    # the QAT run had fake_quant_after_n_steps=2 and 2 micro-batches a step; a conversion of it
    # (init_from='resume') neither needs those settings nor may be given them
    out = tmp_path / "run"
    shutil.copytree(train(**QAT), out)
    run(SCRIPT, **{**CONVERT, "preset": BASE["preset"], "data_dir": data, "out_dir": out, "init_from": "resume", "convert_only": True,
                   "quantizer": QAT["quantizer"], "group_size": QAT["group_size"]})
    assert summary(read_log(out))["method"] == "qat"


def test_ptq_baseline_before_qat_finetune(train, data, tmp_path):
    # finetuning a checkpoint with a quantizer first reports PTQ of the starting weights: it must
    # equal a convert_only PTQ of that checkpoint, and the starting fp loss its own fp loss
    base = train()
    ptq = tmp_path / "ptq"
    run(SCRIPT, **{**CONVERT, "data_dir": data, "out_dir": ptq, "init_from": str(base / "ckpt.pt"),
                   "convert_only": True, "quantizer": "8da2w"})
    out = tmp_path / "qat"
    run(SCRIPT, **{**FINETUNE, **QAT, "quantizer": "8da2w", "data_dir": data, "out_dir": out,
                   "init_from": str(base / "ckpt.pt"), "max_iters": 2})
    s, p = summary(read_log(out)), summary(read_log(ptq))
    assert s["init_fp_val_loss"] == pytest.approx(p["fp_val_loss"], rel=1e-6)
    assert s["init_ptq_val_loss"] == pytest.approx(p["quant_val_loss"], rel=1e-6)
    assert s["init_ptq_val_loss"] > s["init_fp_val_loss"]
    # a resume (here the run converted again) reports its start's baseline from the log, not evaluated again
    r = run(SCRIPT, **{**CONVERT, "data_dir": data, "out_dir": out, "init_from": "resume", "convert_only": True,
                       "quantizer": "8da2w", "group_size": QAT["group_size"]})
    again = summary(read_log(out))
    assert {k: again[k] for k in ("init_fp_val_loss", "init_ptq_val_loss")} == {k: s[k] for k in ("init_fp_val_loss", "init_ptq_val_loss")}
    assert "start, PTQ 8da2w" in r.stdout and "start: val loss" not in r.stdout
    # and --ptq_baseline=False skips it
    out2 = tmp_path / "qat2"
    run(SCRIPT, **{**FINETUNE, **QAT, "quantizer": "8da2w", "data_dir": data, "out_dir": out2,
                   "init_from": str(base / "ckpt.pt"), "max_iters": 2, "ptq_baseline": False})
    assert "init_ptq_val_loss" not in summary(read_log(out2))


def gptq_settings(train, data):
    return dict(FINETUNE, quantizer="8da2w", group_size=32, range_learning=True, gptq_tokens=512, data_dir=data,
                init_from=str(train() / "ckpt.pt"))


def test_gptq_start(train, data, tmp_path):
    # a finetune may start from GPTQ's model: it rounds better than to nearest, and the conversion
    # of the start (no step taken) is GPTQ's model itself
    gptq = gptq_settings(train, data)
    run(SCRIPT, **{**gptq, "out_dir": tmp_path / "start", "max_iters": 0})
    s = summary(read_log(tmp_path / "start"))
    assert s["method"] == "gptq" and s["init_gptq_val_loss"] < s["init_ptq_val_loss"] - 0.003  # 0.0097 on this toy
    assert s["quant_val_loss"] == pytest.approx(s["init_gptq_val_loss"], rel=1e-6)
    # every quantized layer rounds otherwise than to nearest, the output layer too (the FSDP root's
    # parameters, which forward leaves gathered: rounded there, GPTQ's were lost without a word)
    run(SCRIPT, **{**CONVERT, "data_dir": data, "out_dir": tmp_path / "nearest_ptq", "init_from": gptq["init_from"],
                   "convert_only": True, "quantizer": "8da2w"})
    ours, nearest = ((torch.load(tmp_path / d / "quantized.pt", weights_only=False)["model"]) for d in ("start", "nearest_ptq"))
    quantized = [k for k, v in ours.items() if type(v) is not torch.Tensor]
    assert "output.weight" in quantized and len(quantized) == 1 + 7 * 2
    assert all(not torch.equal(ours[k].dequantize(), nearest[k].dequantize()) for k in quantized)
    # the output layer's Hessian holds every calibration row however the loss is chunked: a chunked
    # loss multiplies by the output weight without calling the layer (its hook once saw the last,
    # short batch alone: 32 of 544 rows here, or none at all, a crash)
    for chunk in (0, 64):
        run(SCRIPT, **{**gptq, "gptq_tokens": 544, "loss_chunk": chunk, "out_dir": tmp_path / f"chunk{chunk}", "max_iters": 0})
    a, b = (torch.load(tmp_path / f"chunk{c}" / "quantized.pt", weights_only=False)["model"]["output.weight"] for c in (0, 64))
    assert torch.equal(a.qdata, b.qdata) and torch.equal(a.dequantize(), b.dequantize())
    # the finetune from it trains the rounded model GPTQ left: its first step's loss (a train batch)
    # is far below a finetune's from the rounded-to-nearest start, and what it converts is QAT
    runs = {}
    for name, extra in (("gptq", {}), ("nearest", {"gptq_tokens": 0})):
        runs[name] = tmp_path / name
        run(SCRIPT, **{**gptq, **extra, "out_dir": runs[name], "max_iters": 2, "learning_rate": 1e-6, "min_lr": 1e-7})
    first = {name: losses(read_log(out))[1] for name, out in runs.items()}
    assert first["gptq"] < first["nearest"] - 0.01
    assert summary(read_log(runs["gptq"]))["method"] == "qat"
    # the weights' running average starts at GPTQ's weights and scales, not at the checkpoint's: at so
    # small a rate and a decay near 1, it ends about where the run without it does, not near the start
    run(SCRIPT, **{**gptq, "out_dir": tmp_path / "averaged", "max_iters": 2, "learning_rate": 1e-6, "min_lr": 1e-7,
                   "ema_decay": 0.99})
    assert max_weight_diff(weights(tmp_path / "averaged"), weights(runs["gptq"])) < 1e-4
    assert max_weight_diff(weights(runs["nearest"]), weights(runs["gptq"])) > 1e-2
    # and its resume neither runs GPTQ again nor refuses the setting it started with
    started = summary(read_log(runs["gptq"]))["init_gptq_val_loss"]
    r = run(SCRIPT, **{**gptq, "out_dir": runs["gptq"], "init_from": "resume", "max_iters": 3, "learning_rate": 1e-6,
                       "min_lr": 1e-7})
    assert "GPTQ:" not in r.stdout and "after GPTQ" not in r.stdout
    assert summary(read_log(runs["gptq"]))["init_gptq_val_loss"] == started  # its start's, from the log
    # while a run that started otherwise cannot take GPTQ up at its resume: its weights are trained on
    r = run(SCRIPT, check=False, **{**gptq, "out_dir": runs["nearest"], "init_from": "resume", "max_iters": 3,
                                    "learning_rate": 1e-6, "min_lr": 1e-7})
    assert r.returncode == 2 and "did not start from GPTQ over 512 tokens (gptq_tokens=0)" in r.stderr


def test_gptq_two_processes_match_one(train, data, tmp_path):
    # each process calibrates on half the windows and rounds half of each weight's rows. The Hessians
    # are summed in another order, so a rounding may flip, and GPTQ feeds each rounding's error into
    # the next columns and blocks: a flip spreads (here 0-0.3% of the first block's integers, up to 13%
    # in the last block's and the output's, 0.2% of the loss on one CPU). So the first block, whose
    # inputs no rounding touched, must agree almost everywhere (Hessians not summed over the processes:
    # 73-90%), and no layer may come out rounded to nearest (rows rounded where FSDP discards them)
    # 17 windows: the same ones on either count of processes (one of the second's padded, counting for nothing)
    gptq = {**gptq_settings(train, data), "gptq_tokens": 544}
    got = []
    for nproc in (1, 2):
        r = run(SCRIPT, nproc=nproc, **{**gptq, "out_dir": tmp_path / str(nproc), "max_iters": 0})
        assert "GPTQ: 544 calibration tokens" in r.stdout
        got.append(summary(read_log(tmp_path / str(nproc)))["init_gptq_val_loss"])
    assert got[1] == pytest.approx(got[0], rel=1e-2)
    s = summary(read_log(tmp_path / "2"))
    assert s["init_gptq_val_loss"] < s["init_ptq_val_loss"] - 0.003  # GPTQ's gain, as in test_gptq_start
    run(SCRIPT, **{**CONVERT, "data_dir": data, "out_dir": tmp_path / "nearest", "init_from": gptq["init_from"],
                   "convert_only": True, "quantizer": "8da2w", "group_size": 32})
    one, two, nearest = (torch.load(tmp_path / d / "quantized.pt", weights_only=False)["model"] for d in ("1", "2", "nearest"))
    ints = [k for k, v in one.items() if hasattr(v, "qdata")]
    assert len(ints) == 15  # two blocks of seven linears, and the output
    for k in ints:
        if k.startswith("layers.0."):
            assert (one[k].qdata == two[k].qdata).float().mean() > 0.98, k
        rows = len(two[k].qdata) // 2  # each process's rows (FSDP shards a weight by rows)
        for part in (slice(0, rows), slice(rows, None)):
            assert (two[k].qdata[part] != nearest[k].qdata[part]).float().mean() > 0.02, k


# -----------------------------------------------------------------------------
# loss mask

def test_loss_mask(tmp_path):
    # every window is the same 33 tokens (the data repeats with period block_size), so the first
    # step's batch is known whatever the order, and its loss can be recomputed here
    V, T = 256, 32
    rng = np.random.default_rng(1)
    pattern, mask = rng.integers(0, V, T), rng.integers(0, 2, T)
    data = make_data(tmp_path / "data", V, train=np.tile(pattern, 20)[: 19 * T + 1], val=np.tile(pattern, 4)[: 3 * T + 1],
                     train_mask=np.tile(mask, 20)[: 19 * T + 1], val_mask=np.tile(mask, 4)[: 3 * T + 1])
    out = tmp_path / "out"
    run(SCRIPT, **{**BASE, "data_dir": data, "out_dir": out, "max_iters": 2})
    log = read_log(out)
    assert all(math.isfinite(l) for l in losses(log).values()) and math.isfinite(summary(log)["fp_val_loss"])

    model = Transformer(ModelArgs.from_dict(torch.load(out / "ckpt.pt", weights_only=True)["model_args"]))
    model.init_weights(seed=BASE["seed"])  # a scratch run starts from init_weights(seed)
    x = torch.from_numpy(pattern)[None]
    y = torch.from_numpy(np.roll(pattern, -1))[None]  # token t + 1 of the window is the target of t
    y_masked = y.masked_fill(torch.from_numpy(np.roll(mask, -1) == 0)[None], IGNORE_INDEX)
    with torch.no_grad():
        masked, unmasked = model(x, y_masked).item(), model(x, y).item()
    assert losses(log)[1] == pytest.approx(masked, rel=1e-5)
    assert abs(masked - unmasked) > 100 * 1e-5 * masked  # the check above can tell them apart


# -----------------------------------------------------------------------------
# precision and memory options

def test_bfloat16_mixed_precision(train):
    fp32, bf16 = train(**QAT), train(**QAT, dtype="bfloat16", mixed_precision=True)
    log = read_log(bf16)
    assert sorted(losses(log)) == list(range(1, 7))
    assert all(math.isfinite(l) for l in losses(log).values())
    # the same first step computed in bf16: close to the fp32 run, but not bit-equal
    assert losses(log)[1] == pytest.approx(losses(read_log(fp32))[1], rel=2e-2)
    assert losses(log)[1] != losses(read_log(fp32))[1]
    assert all(v.dtype == torch.float32 for v in weights(bf16).values())  # fp32 master weights
    assert math.isfinite(summary(log)["quant_val_loss"])


def test_pure_bfloat16_refused_where_rounding_freezes_the_weights(data, tmp_path):
    # a bfloat16 weight changes only by a step of at least half its spacing there: at lr 2e-5 most
    # weights of an initialized model (std 0.02) never move, and the norms' gains (1.0) at any usual rate
    settings = {**BASE, **QAT, "data_dir": data, "max_iters": 1, "dtype": "bfloat16", "warmup_iters": 0, "min_lr": 1e-6}
    r = run(SCRIPT, check=False, **{**settings, "out_dir": tmp_path / "pure", "learning_rate": 2e-5})
    assert r.returncode == 2 and re.search(r"below half of bfloat16's spacing for \d\d% of the weight matrices, 100% of "
                                           r"the norms, which rounding then leaves as they are", r.stderr), r.stderr[-2000:]
    r = run(SCRIPT, **{**settings, "out_dir": tmp_path / "norms", "learning_rate": 3e-4})
    assert "warning: dtype=bfloat16 without mixed_precision: a step of learning_rate=0.0003" in r.stdout
    assert "spacing for 100% of the norms, which" in r.stdout
    r = run(SCRIPT, **{**settings, "out_dir": tmp_path / "mixed", "learning_rate": 2e-5, "mixed_precision": True})
    assert "spacing" not in r.stdout + r.stderr


def test_activation_checkpointing_same_losses(train):
    plain, ac = train(), train(activation_checkpointing=1)
    assert_same_losses(losses(read_log(ac)), losses(read_log(plain)), rel=1e-6)
    assert max_weight_diff(weights(ac), weights(plain)) < 1e-6


def test_optimizer_in_backward_matches_optimizer_step(train):
    # one AdamW per parameter, stepped in backward == one AdamW stepped after backward
    settings = dict(batch_size=8, gradient_accumulation_steps=1, grad_clip=float("inf"))
    step, in_bwd = train(**settings), train(**settings, optimizer_in_bwd=True)
    log = read_log(in_bwd)
    assert all(r["grad_norm"] is None for r in records(log).values())
    assert_same_losses(losses(log), losses(read_log(step)), rel=1e-5)
    assert max_weight_diff(weights(in_bwd), weights(step)) < 1e-5
    assert losses(log)[6] < losses(log)[1]


# -----------------------------------------------------------------------------
# user errors: exit code 2, one line on stderr, before any work (out_dir not even created)

def test_errors(train, data, tmp_path):
    no_val = tmp_path / "no_val"
    shutil.copytree(data, no_val)
    os.remove(no_val / "val.bin")
    small = Transformer(ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=64, multiple_of=32))  # data: 256
    torch.save({"model": small.state_dict(), "model_args": vars(small.args)}, tmp_path / "small_vocab.pt")
    odd = Transformer(ModelArgs(dim=64, n_layers=1, n_heads=6, n_kv_heads=2, head_dim=16, vocab_size=256, multiple_of=32))
    torch.save({"model": odd.state_dict(), "model_args": vars(odd.args)}, tmp_path / "odd_heads.pt")  # as a params.json can say
    other_quantizer = tmp_path / "other_quantizer"
    other_quantizer.mkdir()
    shutil.copy(train() / "ckpt.pt", other_quantizer / "ckpt.pt")  # trained with quantizer='none'
    other_script = tmp_path / "other_script"
    other_script.mkdir()
    torch.save({**torch.load(train() / "ckpt.pt", weights_only=True), "script": "kd_train.py"}, other_script / "ckpt.pt")
    cases = {  # name: (settings, extra env, words the message must contain)
        "unknown quantizer": (dict(quantizer="8da9w"), {}, ["quantizer='8da9w'"]),
        "group_size": (dict(quantizer="8da4w", group_size=48), {}, ["group_size=48"]),  # 48 does not divide 64
        "missing val.bin": (dict(data_dir=str(no_val)), {}, ["val.bin"]),
        "vocab": (dict(init_from=str(tmp_path / "small_vocab.pt")), {}, ["256", "64"]),
        "accumulation": (dict(gradient_accumulation_steps=3), dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0"),
                         ["gradient_accumulation_steps=3"]),
        "no such init_from": (dict(init_from=str(tmp_path / "nowhere.pt")), {}, ["init_from"]),
        "init_from not a checkpoint": (dict(init_from=str(Path(data) / "meta.json")), {}, ["init_from", "checkpoint"]),
        "float16": (dict(dtype="float16"), {}, ["dtype='float16'"]),
        "mixed precision in fp32": (dict(mixed_precision=True), {}, ["mixed_precision"]),
        "resume without checkpoint": (dict(init_from="resume"), {}, ["init_from='resume'", "ckpt.pt"]),
        "resume another script's run": (dict(init_from="resume", out_dir=str(other_script)), {}, ["written by kd_train.py"]),
        "resume with another quantizer": (dict(init_from="resume", quantizer="8da4w", out_dir=str(other_quantizer)),
                                          {}, ["quantizer='none'"]),
        "optimizer_in_bwd with accumulation": (dict(optimizer_in_bwd=True, grad_clip=float("inf")), {},
                                               ["optimizer_in_bwd", "gradient_accumulation_steps"]),
        "optimizer_in_bwd with clipping": (dict(optimizer_in_bwd=True, gradient_accumulation_steps=1), {},
                                           ["optimizer_in_bwd", "grad_clip"]),
        "convert_only without quantizer": (dict(convert_only=True), {}, ["convert_only"]),
        "shape with a checkpoint": (dict(init_from=str(train() / "ckpt.pt"), n_layer=3), {}, ["n_layer", "init_from"]),
        "quant_skip prefix": (dict(quantizer="8da4w", quant_skip=("layers.1", "lm_head")), {}, ["['lm_head']"]),
        "quant_skip of the embedding asked to quantize": (dict(quantizer="8da4w", quantize_embedding=True, quant_skip=("tok_embeddings",)),
                                                          {}, ["quant_skip names 'tok_embeddings'", "quantize_embedding=True"]),
        "quant_skip of numbers": (dict(quantizer="8da4w", quant_skip=(0,)), {}, ["quant_skip expects a tuple of str"]),
        "zero batch": (dict(batch_size=0), {}, ["batch_size=0", "positive"]),
        "zero profile_active": (dict(profile=True, profile_active=0), {}, ["profile_active=0", "positive"]),
        "beta1 past 1": (dict(beta1=1.5), {}, ["beta1=1.5", "[0, 1)"]),
        "zero grad_clip": (dict(grad_clip=0.0), {}, ["grad_clip=0.0", "positive"]),  # would zero every gradient
        "zero group_size": (dict(quantizer="8da4w", group_size=0), {}, ["group_size=0", "positive"]),
        "zero replicate_degree": (dict(replicate_degree=0), {}, ["replicate_degree=0", "positive"]),
        "impossible shape": (dict(n_head=3), {}, ["n_heads=3"]),
        "a shape transformers refuses, exported for it": (dict(init_from=str(tmp_path / "odd_heads.pt"), export_format="hf"), {},
                                                          ["export_format='hf'", "dim 64 over 6 heads"]),
        "converted model": (dict(init_from=str(train(**QAT) / "quantized.pt")), {}, ["converted", "ckpt.pt"]),
        "quant setting without quantizer": (dict(fake_quant_after_n_steps=5), {}, ["fake_quant_after_n_steps", "quantizer='none'"]),
        # settings that only matter with another one, or in another mode
        "wandb name without wandb": (dict(wandb_run_name="x"), {}, ["wandb_run_name", "wandb_log=True"]),
        "profile schedule without profile": (dict(profile_active=1), {}, ["profile_active", "profile=True"]),
        "accumulate_unsharded, one micro-batch": (dict(accumulate_unsharded=True, gradient_accumulation_steps=1), {},
                                                  ["accumulate_unsharded=True", "one micro-batch"]),
        "cosine ends inside warmup": (dict(lr_decay_iters=2), {}, ["lr_decay_iters=2", "warmup_iters=2"]),
        "ptq_baseline from scratch": (dict(ptq_baseline=False), {}, ["ptq_baseline", "drop it"]),
        "convert_only with training settings": (dict(init_from=str(train() / "ckpt.pt"), quantizer="8da4w", convert_only=True),
                                                {}, ["convert_only=True trains nothing", "max_iters, learning_rate"]),
        # GPTQ's grid is kept only by learned scales, and only a checkpoint has weights to round
        "gptq without learned scales": (dict(init_from=str(train() / "ckpt.pt"), quantizer="8da4w", gptq_tokens=256), {},
                                        ["gptq_tokens=256", "range_learning=True"]),
        "gptq from scratch": (dict(quantizer="8da4w", range_learning=True, gptq_tokens=256), {},
                              ["gptq_tokens=256", "a checkpoint"]),
        "gptq with a late fake quant": (dict(init_from=str(train() / "ckpt.pt"), quantizer="8da4w", range_learning=True,
                                             gptq_tokens=256, fake_quant_after_n_steps=1), {}, ["fake_quant_after_n_steps=0"]),
        "gptq past the train split": (dict(init_from=str(train() / "ckpt.pt"), quantizer="8da4w", range_learning=True,
                                           gptq_tokens=10 ** 7), {}, ["gptq_tokens=10000000", "more than the train split's"]),
    }

    runs = [({**(BASE if settings.get("init_from", "resume") == "resume" else FINETUNE), "data_dir": data,
              "out_dir": str(tmp_path / re.sub(r"\W", "_", name)), **settings}, env)
            for name, (settings, env, _) in cases.items()]
    results = run_early_exits(SCRIPT, runs)  # all in one interpreter: imports once
    # and one in a process of its own: the exit code and stderr a user sees
    float16 = runs[list(cases).index("float16")]
    results.append(run(SCRIPT, check=False, env=float16[1], **float16[0]))
    for name, (settings, _), r in zip([*cases, "float16"], [*runs, float16], results):
        # torch's own log lines ("W1130 10:56:20.645 ...") are library noise, not our message
        lines = [l for l in r.stderr.splitlines() if l.strip() and not re.match(r"[IWE]\d{4} \d\d:\d\d", l)]
        assert r.returncode == 2, f"{name}: exit {r.returncode}\n{r.stderr[-3000:]}"
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{name}:\n{r.stderr[-3000:]}"
        assert all(w in lines[0] for w in cases[name][2]), f"{name}: {lines[0]}"
        assert not (Path(settings["out_dir"]) / "log.jsonl").exists(), name  # failed before any work
