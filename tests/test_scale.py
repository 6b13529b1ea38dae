"""What large models need, on toy ones: sharded checkpoints (torch.distributed.checkpoint) that
resume bit-exactly, also on another number of processes and after a crash between the renames of
a save; the single-file conversion of one; and the memory plan's activation formula against the
bytes autograd really saves."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checkpoint import load_checkpoint  # noqa: E402
from conftest import command, make_data, read_log, run, script_env  # noqa: E402
from model import PRESETS, ModelArgs, Transformer  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1"}
# the lr schedule is fixed by lr_decay_iters, so a run stopped at step 3 is the first half of one of 6
BASE = dict(preset="toy", block_size=32, batch_size=4, gradient_accumulation_steps=2, max_iters=6,
            lr_decay_iters=6, warmup_iters=2, learning_rate=1e-2, min_lr=1e-3, eval_interval=1000,
            eval_iters=2, log_interval=1, ckpt_interval=1000, quantizer="8da4w", group_size=32,
            fake_quant_after_n_steps=2, sharded_checkpoint=True, seed=1337)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data"))


def losses(log):
    return {r["iter"]: r["loss"] for r in log if "loss" in r}


def to_single_file(ckpt_dir):
    # the one-liner the scripts print when a reader needs ckpt.pt
    cmd = (f"from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
           f"dcp_to_torch_save({str(ckpt_dir)!r}, {str(ckpt_dir) + '.pt'!r})")
    subprocess.run([sys.executable, "-c", cmd], check=True, capture_output=True)
    return Path(str(ckpt_dir) + ".pt")


def test_sharded_resume_is_bit_exact(data, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run("qat_train.py", env=ENV, **{**BASE, "data_dir": data, "out_dir": straight})
    run("qat_train.py", env=ENV, **{**BASE, "data_dir": data, "out_dir": stopped, "max_iters": 3})
    assert sorted(os.listdir(stopped / "ckpt")) == [".metadata", "__0_0.distcp", "state.pt"]
    assert not (stopped / "ckpt.pt").exists()
    with pytest.raises(ValueError, match=r"is a sharded training checkpoint; convert it with .*dcp_to_torch_save"):
        load_checkpoint(str(stopped))  # what sample.py and every reader of one file says: the command to run
    # a crash between the two renames of a save: the previous checkpoint stepped aside, a half new one
    os.replace(stopped / "ckpt", stopped / "ckpt.old")
    (stopped / "ckpt.tmp").mkdir()
    (stopped / "ckpt.tmp" / "__0_0.distcp").write_bytes(b"half a shard")
    run("qat_train.py", env=ENV, **{**BASE, "data_dir": data, "out_dir": stopped, "init_from": "resume"})
    assert sorted(os.listdir(stopped)) == sorted(os.listdir(straight))  # ckpt.old and ckpt.tmp gone
    assert losses(read_log(stopped)) == losses(read_log(straight))  # bit-exact
    a, b = (torch.load(to_single_file(d / "ckpt"), weights_only=True) for d in (straight, stopped))
    assert a["iter_num"] == b["iter_num"] == 6
    for part in ("model", "optimizer"):
        flat_a, flat_b = torch.utils._pytree.tree_leaves(a[part]), torch.utils._pytree.tree_leaves(b[part])
        assert len(flat_a) == len(flat_b) > 0
        assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(flat_a, flat_b))
    # the converted file is a whole ckpt.pt: load_checkpoint reads it and a finetune starts from it
    args, sd = load_checkpoint(str(straight / "ckpt.pt"))
    assert args == ModelArgs.from_dict(a["model_args"]) and torch.equal(sd["output.weight"], a["model"]["output.weight"])
    ft = {k: v for k, v in BASE.items() if k != "preset"}
    for init in (straight / "ckpt.pt", straight):  # the single file, and the sharded directory in out_dir
        r = run("qat_train.py", env=ENV, **{**ft, "data_dir": data, "out_dir": tmp_path / f"ft_{init.name}",
                                            "init_from": str(init), "max_iters": 1, "ptq_baseline": False})
        assert "error" not in r.stderr
    first = [losses(read_log(tmp_path / f"ft_{n}"))[1] for n in ("ckpt.pt", "straight")]
    assert first[0] == first[1]


def test_single_file_save_clears_a_stale_ckpt_old(data, tmp_path):
    # resumed from the ckpt.old a crash left, a run that saves single files must not leave it: the
    # next resume (or init_from=out_dir) would take it over the newer ckpt.pt
    out = tmp_path / "out"
    run("qat_train.py", env=ENV, **{**BASE, "data_dir": data, "out_dir": out, "max_iters": 2})
    os.replace(out / "ckpt", out / "ckpt.old")
    run("qat_train.py", env=ENV, **{**BASE, "data_dir": data, "out_dir": out, "max_iters": 3, "init_from": "resume",
                                    "sharded_checkpoint": False})
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("ckpt")) == ["ckpt.pt"]
    r = run("qat_train.py", env=ENV, **{**BASE, "data_dir": data, "out_dir": out, "max_iters": 4, "init_from": "resume",
                                        "sharded_checkpoint": False})
    assert "at step 3" in r.stdout


def test_two_processes_save_one_resumes(data, tmp_path):
    # without fake quant, whose rounding would turn the float noise of another summation order
    # into flips that Adam then amplifies
    settings = {**{k: v for k, v in BASE.items() if k not in ("group_size", "fake_quant_after_n_steps")},
                "quantizer": "none", "max_iters": 4, "lr_decay_iters": 4, "data_dir": data}
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    run("qat_train.py", nproc=2, env=ENV, **{**settings, "out_dir": straight})
    run("qat_train.py", nproc=2, env=ENV, **{**settings, "out_dir": moved, "max_iters": 2})
    assert {f for f in os.listdir(moved / "ckpt") if f.endswith(".distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    run("qat_train.py", env=ENV, **{**settings, "out_dir": moved, "init_from": "resume"})
    a, b = losses(read_log(straight)), losses(read_log(moved))
    assert a.keys() == b.keys() == set(range(1, 5))
    assert all(a[i] == b[i] for i in (1, 2))  # written by the same two processes
    # one process sums the two micro-batches in another order: float noise; a lost shard or
    # optimizer state would be >= 1e-2 off
    assert all(b[i] == pytest.approx(a[i], rel=1e-5) for i in (3, 4))
    wa, wb = (torch.load(to_single_file(d / "ckpt"), weights_only=True)["model"] for d in (straight, moved))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4


def toy_checkpoint(path, seed):
    args = ModelArgs(**PRESETS["toy"], vocab_size=256)
    m = Transformer(args)
    m.init_weights(seed)
    torch.save({"model": m.state_dict(), "model_args": vars(args)}, path)
    return str(path)


def test_kd_sharded_resume_on_another_process_count(data, tmp_path):
    # QAD: the student is fake-quantized, so the end converts it on rank 0 alone
    settings = dict(data_dir=data, teacher_init=toy_checkpoint(tmp_path / "t.pt", 1), init_from=toy_checkpoint(tmp_path / "s.pt", 2),
                    batch_size=4, block_size=32, gradient_accumulation_steps=2, max_iters=4, lr_decay_iters=4,
                    warmup_iters=1, learning_rate=1e-2, log_interval=1, eval_interval=1000, eval_iters=1,
                    ckpt_interval=1000, quantizer="8da4w", sharded_checkpoint=True, peak_flops_per_device=1e12)
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    run("kd_train.py", env=ENV, **settings, out_dir=straight)
    run("kd_train.py", nproc=2, env=ENV, **{**settings, "max_iters": 2}, out_dir=moved)
    run("kd_train.py", env=ENV, **{**settings, "init_from": "resume"}, out_dir=moved)
    a, b = read_log(straight), read_log(moved)
    assert [r for r in b if "teacher_val_loss" in r and "fp_val_loss" not in r] == \
        [r for r in a if "teacher_val_loss" in r and "fp_val_loss" not in r]  # evaluated once, by the first run
    la, lb = losses(a), losses(b)
    assert la.keys() == lb.keys() == set(range(1, 5))
    # two processes, then one: another summation order, float noise that fake quant may flip a
    # rounding or two with; a lost shard or optimizer state would be >= 1e-2 off
    assert all(lb[i] == pytest.approx(la[i], rel=1e-4) for i in la)
    qa, qb = (r[-1]["quant_val_loss"] for r in (a, b))
    assert qb == pytest.approx(qa, rel=1e-3) and qa != a[-1]["fp_val_loss"]
    # a teacher is read from one file: a sharded one is refused with the line that converts it
    r = run("kd_train.py", check=False, env=ENV, **{**settings, "teacher_init": str(straight)}, out_dir=tmp_path / "x")
    assert r.returncode == 2 and "dcp_to_torch_save" in r.stderr, r.stderr[-2000:]


def two_nodes(nodes, timeout=300, env=None, args=()):
    """Runs a job as two one-process nodes of torchrun on this machine: nodes holds (script, settings)
    for each, so each can read its own files. Returns their CompletedProcesses."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for node, (script, settings) in enumerate(nodes):
            launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                        "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", "--max_restarts=0"]
            procs.append(subprocess.Popen([*launcher, *command(script, *args, **settings)[1:]], cwd=ROOT, env=script_env({**ENV, **(env or {})}),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return results
    finally:  # nothing left running, whatever failed
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()


def errors(r):
    return [line for line in r.stderr.splitlines() if line.startswith("error")]


def test_nodes_that_were_given_other_jobs_are_refused(data, tmp_path):
    # each node reads its own config, data and code: one that differs would train on beside the others
    settings = {**BASE, "data_dir": data, "max_iters": 2, "sharded_checkpoint": False}
    other_data = make_data(tmp_path / "other", seed=1)
    node0, node1 = two_nodes([("qat_train.py", {**settings, "out_dir": tmp_path / "a"}),
                              ("qat_train.py", {**settings, "out_dir": tmp_path / "a", "data_dir": other_data,
                                                "learning_rate": 5e-3})])
    assert node0.returncode and node1.returncode
    assert errors(node0) == ["error: the processes were not given one job: rank 1 differs from rank 0 in learning_rate (0.01 on "
                             "rank 0, 0.005 on rank 1); data (train.bin, val.bin). Each node reads its own code, config, data "
                             "and checkpoints: make them the same on every node"]
    assert errors(node1) == []  # said once
    assert not (tmp_path / "a").exists()  # refused before anything was written
    # paths may differ between nodes, what they hold may not: here the code on node 1
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in ROOT.glob("*.py"):
        shutil.copy(f, copy)
    with open(copy / "model.py", "a") as f:
        f.write("# edited on one node\n")
    node0, node1 = two_nodes([("qat_train.py", {**settings, "out_dir": tmp_path / "a"}),
                              (copy / "qat_train.py", {**settings, "out_dir": tmp_path / "b",
                                                       "data_dir": shutil.copytree(data, tmp_path / "same")})])
    assert node0.returncode and node1.returncode
    assert errors(node0) == ["error: the processes were not given one job: rank 1 differs from rank 0 in code (model.py). "
                             "Each node reads its own code, config, data and checkpoints: make them the same on every node"]
    # the same job from other paths trains (each node its own out_dir: only rank 0 writes a single-file checkpoint)
    node0, node1 = two_nodes([("qat_train.py", {**settings, "out_dir": tmp_path / "a"}),
                              ("qat_train.py", {**settings, "out_dir": tmp_path / "b", "data_dir": tmp_path / "same",
                                                "peak_flops_per_device": 1e12})])  # rank 0's MFU alone reads it
    assert node0.returncode == node1.returncode == 0, node0.stderr[-2000:] + node1.stderr[-2000:]
    assert [r["iter"] for r in read_log(tmp_path / "a") if "loss" in r] == [1, 2]


def test_a_node_that_fails_alone_says_why(data, tmp_path):
    # its files are its own: before the processes compare their jobs, the first process of every node
    # speaks, and the others stop at once with its error (they waited for its job until torchrun's timeout)
    settings = {**BASE, "out_dir": tmp_path / "out", "max_iters": 2}
    missing = (f"{tmp_path / 'absent' / 'train.bin'} is missing; run data_prep.py --out_dir {tmp_path / 'absent'} first")
    for script, extra in (("qat_train.py", {}), ("kd_train.py", {"teacher_init": toy_checkpoint(tmp_path / "t.pt", 1)})):
        node0, node1 = two_nodes([(script, {**settings, **extra, "data_dir": data}),
                                  (script, {**settings, **extra, "data_dir": tmp_path / "absent"})], timeout=120)
        assert node0.returncode and node1.returncode
        assert errors(node1) == [f"error (rank 1): {missing}"]
        assert errors(node0) == [f"error: rank 1 stopped: {missing}"]
        # and the other way round: rank 0 failed, and node 1 says why
        node0, node1 = two_nodes([(script, {**settings, **extra, "data_dir": tmp_path / "absent"}),
                                  (script, {**settings, **extra, "data_dir": data})], timeout=120)
        assert errors(node0) == [f"error: {missing}"]
        assert errors(node1) == [f"error (rank 1): rank 0 stopped: {missing}"]
        assert not (tmp_path / "out").exists()


def test_kd_nodes_with_other_teachers_are_refused(data, tmp_path):
    settings = dict(data_dir=data, init_from=toy_checkpoint(tmp_path / "s.pt", 2), out_dir=tmp_path / "out", batch_size=4,
                    block_size=32, max_iters=2, eval_iters=1)
    node0, node1 = two_nodes([("kd_train.py", {**settings, "teacher_init": toy_checkpoint(tmp_path / "t.pt", 1)}),
                              ("kd_train.py", {**settings, "teacher_init": toy_checkpoint(tmp_path / "t1.pt", 3)})])
    assert node0.returncode and node1.returncode
    assert errors(node0) == ["error: the processes were not given one job: rank 1 differs from rank 0 in checkpoints "
                             "(teacher_init). Each node reads its own code, config, data and checkpoints: make them the "
                             "same on every node"]


def test_nodes_with_a_complete_store_stop_together(data, tmp_path):
    # a store complete on one node and not on the other (stores local to each node): that node stopped
    # alone, content, while the other waited for it until torchrun's timeout
    settings = dict(data_dir=data, teacher_init=toy_checkpoint(tmp_path / "t.pt", 1), topk_write=True, teacher_topk=8,
                    batch_size=4, block_size=32, out_dir=tmp_path / "kd")
    run("kd_train.py", **settings, teacher_topk_dir=tmp_path / "s0", env=ENV)
    node0, node1 = two_nodes([("kd_train.py", {**settings, "teacher_topk_dir": tmp_path / "s0"}),
                              ("kd_train.py", {**settings, "teacher_topk_dir": tmp_path / "s1"})], timeout=120)
    assert node0.returncode and node1.returncode
    assert errors(node0)[0].startswith("error: the processes were not given one job: rank 1 differs from rank 0 in store (")
    # the same complete store on both: nothing to write, on either
    node0, node1 = two_nodes([("kd_train.py", {**settings, "teacher_topk_dir": tmp_path / "s0"})] * 2, timeout=120)
    assert node0.returncode == node1.returncode == 0, node0.stderr[-2000:] + node1.stderr[-2000:]
    assert "is complete; nothing to write" in node0.stdout


def test_nodes_must_share_the_directory_they_all_write(data, tmp_path):
    # sharded checkpoints and a store's rows: in a directory local to each node, split between them
    settings = {**BASE, "data_dir": data, "max_iters": 2}
    (tmp_path / "b").mkdir()  # node 1's own out_dir
    wait = {"NANOTUNE_SHARED_WAIT": "2"}  # for the mark to show (NFS caches a miss up to a minute)
    node0, node1 = two_nodes([("qat_train.py", {**settings, "out_dir": tmp_path / "a"}),
                              ("qat_train.py", {**settings, "out_dir": tmp_path / "b"})], env=wait)
    assert node0.returncode and node1.returncode
    assert errors(node0) == [f"error: sharded_checkpoint=True has every process write its shards into {tmp_path / 'a'}, which "
                             f"rank(s) 1 cannot see as rank 0 does (a directory local to each node?); give an out_dir that "
                             f"every node shares"]
    assert os.listdir(tmp_path / "a") == [".lock"] and os.listdir(tmp_path / "b") == []  # the mark is gone
    # a conversion writes from rank 0 alone (a config file for the job may still ask for sharded checkpoints)
    (tmp_path / "job.py").write_text("sharded_checkpoint = True\n")
    convert = dict(data_dir=data, init_from=toy_checkpoint(tmp_path / "m.pt", 1), convert_only=True, quantizer="8da4w",
                   group_size=32, block_size=32, batch_size=4)
    node0, node1 = two_nodes([("qat_train.py", {**convert, "out_dir": tmp_path / "c0"}),
                              ("qat_train.py", {**convert, "out_dir": tmp_path / "c1"})], env=wait, args=[tmp_path / "job.py"])
    assert node0.returncode == node1.returncode == 0, node0.stderr[-2000:]
    assert (tmp_path / "c0" / "quantized.pt").exists()
    settings = dict(data_dir=data, teacher_init=toy_checkpoint(tmp_path / "t.pt", 1), topk_write=True, teacher_topk=8,
                    batch_size=4, block_size=32, out_dir=tmp_path / "kd")
    node0, node1 = two_nodes([("kd_train.py", {**settings, "teacher_topk_dir": tmp_path / "s0"}),
                              ("kd_train.py", {**settings, "teacher_topk_dir": tmp_path / "s1"})], env=wait)
    assert node0.returncode and node1.returncode
    assert errors(node0) == [f"error: every process writes its rows of the store into {tmp_path / 's0'}, which rank(s) 1 "
                             f"cannot see as rank 0 does (a directory local to each node?); give a directory that every "
                             f"node shares"]
