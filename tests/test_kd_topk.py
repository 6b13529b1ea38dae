"""kd_train.py with a stored teacher: the top-k store written once (1 and 2 processes, killed and
resumed), KD from it against online KD and against k + 1-bucket formulas written here, resume,
and the stores a run must refuse."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import make_data, read_log, run, run_early_exits
from test_kd_train import BASE, ENV, V, load_model, run_in_one_process, save_model, train_lines

# gradient_accumulation_steps given: resume compares the setting as given with its derived value
COMMON = dict(BASE, kd_ratio=0.5, learning_rate=1e-2, gradient_accumulation_steps=1)


def writing(common):
    """The settings of a store write among a training run's: it refuses the student's and the loop's."""
    return {k: common[k] for k in ("data_dir", "teacher_init", "batch_size", "block_size") if k in common}


def read_store(d, rest=False):
    """meta, ids, log-probs (and with rest=True the rest's log-mass) of the store in d."""
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    shape = (meta["n_windows"] * meta["block_size"], meta["k"])
    ids = np.fromfile(os.path.join(d, "ids.bin"), dtype=meta["ids_dtype"]).reshape(shape)
    logp = np.fromfile(os.path.join(d, "logprobs.bin"), dtype=np.float16).reshape(shape)
    return (meta, ids, logp) + ((np.fromfile(os.path.join(d, "rest.bin"), dtype=np.float32),) if rest else ())


def first_windows(data_dir, seed, block_size, n):
    tokens = np.fromfile(os.path.join(data_dir, "train.bin"), dtype=np.uint16).astype(np.int64)
    epoch_seed = int(np.random.SeedSequence([seed, 0]).generate_state(1)[0])  # (seed, epoch 0), as kd_train.py
    order = torch.randperm((len(tokens) - 1) // block_size, generator=torch.Generator().manual_seed(epoch_seed))
    windows = order[:n]
    x = torch.from_numpy(np.stack([tokens[w * block_size: w * block_size + block_size] for w in windows.tolist()]))
    return windows, x


@torch.no_grad()
def bucket_reference(kind, store_dir, settings, beta=0.5):
    """The first step's mean KD term from the store's rows, in float64 probabilities: the teacher's
    top k plus a rest bucket holding its mass outside them, computed here from the teacher itself (none
    when k is the vocabulary), the student's mass on the same."""
    meta, ids, logp = read_store(store_dir)
    T, bs = meta["temperature"], settings["block_size"]
    windows, x = first_windows(settings["data_dir"], settings["seed"], bs, settings["batch_size"])
    rows = (windows[:, None] * bs + torch.arange(bs)).flatten().numpy()
    ids, p = torch.from_numpy(ids[rows].astype(np.int64)), torch.from_numpy(logp[rows].astype(np.float64)).exp()
    q_full = F.softmax(load_model(settings["init_from"])(x)[..., :V].flatten(0, 1).double() / T, -1)
    q = q_full.gather(-1, ids)
    if meta["k"] < V:
        t_full = F.softmax(load_model(settings["teacher_init"])(x)[..., :V].flatten(0, 1).double() / T, -1)
        p = torch.cat((p, (1 - t_full.gather(-1, ids).sum(-1, keepdim=True)).clamp(min=torch.finfo(torch.float32).eps)), -1)
        q = torch.cat((q, (1 - q.sum(-1, keepdim=True)).clamp(min=torch.finfo(torch.float32).eps)), -1)
    p = p / p.sum(-1, keepdim=True)

    def kl(a, b):
        return (a * (a / b).log()).sum(-1)

    div = {"fkl": lambda: kl(p, q), "rkl": lambda: kl(q, p), "skl": lambda: (kl(p, q) + kl(q, p)) / 2,
           "jsd": lambda: (beta * kl(p, beta * p + (1 - beta) * q) + (1 - beta) * kl(q, beta * p + (1 - beta) * q))
           / (beta * (1 - beta))}[kind]()
    return (div.mean() * T ** 2).item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("topk")
    data, teacher, student = make_data(d / "data"), save_model(d / "teacher.pt", seed=1, out_scale=15.0), save_model(
        d / "student.pt", seed=3, out_scale=3.0)
    # a teacher sure of its top 8 (its median mass outside them 5e-7), where float16's rounding of their
    # log-probs outweighs the rest that 1 - their sum would give
    sure = save_model(d / "sure.pt", seed=1, out_scale=100.0)
    common = dict(COMMON, data_dir=data, teacher_init=teacher, init_from=student, max_iters=3)
    stores = {"full": dict(teacher_topk=V), "full_T2": dict(teacher_topk=V, kd_temperature=2.0), "k8": dict(teacher_topk=8),
              "k8_sure": dict(teacher_topk=8, teacher_init=sure)}
    cases = {  # name: (store or None for online, settings)
        **{f"{kind}_{src or 'online'}": (src, dict(kd_divergence=kind)) for kind in ("fkl", "rkl", "skl") for src in (None, "full")},
        "jsd_online": (None, dict(kd_divergence="jsd", jsd_beta=0.3)),
        "jsd_full": ("full", dict(kd_divergence="jsd", jsd_beta=0.3)),
        "fkl_T2_online": (None, dict(kd_divergence="fkl", kd_temperature=2.0)),
        "fkl_T2_full": ("full_T2", dict(kd_divergence="fkl", kd_temperature=2.0)),
        "fkl_k8": ("k8", dict(kd_divergence="fkl")), "jsd_k8": ("k8", dict(kd_divergence="jsd", jsd_beta=0.3)),
        "rkl_k8": ("k8", dict(kd_divergence="rkl")), "rkl_k8_sure": ("k8_sure", dict(kd_divergence="rkl", teacher_init=sure)),
    }
    out = {"data": data, "teacher": teacher, "sure": sure, "student": student, "common": common, "dir": d, "cases": cases}
    jobs = [("kd_train.py", dict(writing(common), out_dir=str(d / f"w_{s}"), topk_write=True, teacher_topk_dir=str(d / s), **kw))
            for s, kw in stores.items()]
    for name, (store, kw) in cases.items():
        jobs.append(("kd_train.py", dict(common, out_dir=str(d / name), **kw, **({"teacher_topk_dir": str(d / store)} if store else {}))))
    # resume from the store: 2 steps, then 2 more, against 4 straight
    res = dict(common, teacher_topk_dir=str(d / "k8"), max_iters=4, ckpt_interval=2)
    jobs += [("kd_train.py", dict(res, out_dir=str(d / "straight"))),
             ("kd_train.py", dict(res, out_dir=str(d / "resumed"), max_iters=2, lr_decay_iters=4)),
             ("kd_train.py", dict(res, out_dir=str(d / "resumed"), init_from="resume"))]
    run_in_one_process(jobs, d)
    return out


@pytest.mark.parametrize("kind", ["fkl", "rkl", "skl", "jsd", "fkl_T2"])
def test_full_store_equals_online_kd(runs, kind):
    """k = vocabulary stores the whole distribution: the same losses as online KD, step for step, to
    float16's rounding of the log-probs."""
    online, stored = (train_lines(read_log(runs["dir"] / f"{kind}_{s}")) for s in ("online", "full"))
    assert len(online) == len(stored) == 3
    for a, b in zip(online, stored):
        assert b["class_loss"] == pytest.approx(a["class_loss"], rel=2e-3)
        assert b["kd_loss"] == pytest.approx(a["kd_loss"], rel=2e-3, abs=1e-4)
    assert online[0]["class_loss"] == stored[0]["class_loss"]  # same windows, same student


@pytest.mark.parametrize("case", ["fkl_full", "rkl_full", "skl_full", "jsd_full", "fkl_T2_full", "fkl_k8", "rkl_k8", "jsd_k8",
                                  "rkl_k8_sure"])
def test_first_step_against_bucket_formula(runs, case):
    store, kw = runs["cases"][case]
    first = train_lines(read_log(runs["dir"] / case))[0]
    ref = bucket_reference(kw["kd_divergence"], runs["dir"] / store, dict(runs["common"], **kw), kw.get("jsd_beta", 0.5))
    assert first["kd_loss"] == pytest.approx(ref, rel=1e-5)


def test_top8_store(runs):
    meta, ids, logp = read_store(runs["dir"] / "k8")
    assert meta["complete"] and meta["windows_done"] == meta["n_windows"] == (8192 - 1) // 32
    assert ids.dtype == np.uint16 and logp.dtype == np.float16 and ids.shape == (meta["n_windows"] * 32, 8)
    assert (np.diff(logp.astype(np.float32), axis=1) <= 0).all()  # sorted, likeliest first
    assert np.exp(logp.astype(np.float64)).sum(1).max() < 1 + 2e-3
    # the rest, the teacher's mass outside its top 8, summed in float32 as it is written; where the teacher
    # is sure, 1 - sum(top 8) of the float16 values is mostly their rounding
    for store, teacher, off in (("k8", runs["teacher"], 0.01), ("k8_sure", runs["sure"], 1.0)):
        _, ids, logp, rest = read_store(runs["dir"] / store, rest=True)
        windows, x = first_windows(runs["data"], 0, 32, 4)
        rows = (windows[:, None] * 32 + torch.arange(32)).flatten().numpy()
        with torch.no_grad():
            t = F.log_softmax(load_model(teacher)(x)[..., :V].flatten(0, 1).double(), -1)
        true = t.scatter(-1, torch.from_numpy(ids[rows].astype(np.int64)), -np.inf).logsumexp(-1).numpy()
        np.testing.assert_allclose(rest[rows], true, rtol=1e-4)
        rebuilt = np.log(np.clip(1 - np.exp(logp[rows].astype(np.float64)).sum(1), 1e-300, None))
        assert (np.median(np.abs(rebuilt - true)) > off) == (store == "k8_sure"), store
    # the top-k of a distribution covers at most its mass: KD over k + 1 buckets is below the full one
    assert train_lines(read_log(runs["dir"] / "fkl_k8"))[0]["kd_loss"] < train_lines(read_log(runs["dir"] / "fkl_online"))[0]["kd_loss"]


def test_resume_from_store_equals_straight_run(runs):
    straight, resumed = (train_lines(read_log(runs["dir"] / k)) for k in ("straight", "resumed"))
    assert [r["loss"] for r in straight] == [r["loss"] for r in resumed]
    a, b = (torch.load(runs["dir"] / k / "ckpt.pt", weights_only=True)["model"] for k in ("straight", "resumed"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_killed_write_resumes_to_the_straight_write(runs, tmp_path):
    """The state a kill leaves (some groups done, the rest half-written, meta incomplete) is
    finished by rerunning the command, to the same bytes as a straight write."""
    src, dst = runs["dir"] / "k8", tmp_path / "k8"
    shutil.copytree(src, dst)
    meta, ids, _ = read_store(dst)
    done = np.fromfile(dst / "done.bin", dtype=np.uint8)
    done[1::2] = 0  # every other group unwritten, its rows garbage
    done.tofile(dst / "done.bin")
    rows = ids.shape[0]
    for name, itemsize in (("ids.bin", 2), ("logprobs.bin", 2)):
        garbage = np.random.default_rng(0).integers(0, 2 ** 16, rows * 8, dtype=np.uint16)
        garbage.tofile(dst / name)
    meta.update(complete=False, windows_done=0)
    (dst / "meta.json").write_text(json.dumps(meta))
    # a half-written store is refused for training
    r = run_early_exits("kd_train.py", [(dict(runs["common"], teacher_topk_dir=str(dst), out_dir=str(tmp_path / "o")), None)])[0]
    assert r.returncode == 2 and "incomplete" in r.stderr
    # the rows of done groups are trusted as they are: restore them, as a kill would have left them
    _, ids_src, logp_src = read_store(src)
    ids_g, logp_g = np.memmap(dst / "ids.bin", np.uint16, "r+", shape=ids.shape), np.memmap(dst / "logprobs.bin", np.float16, "r+", shape=ids.shape)
    per_group = meta["batch_size"] * meta["block_size"]
    for g in np.flatnonzero(done):
        ids_g[g * per_group: (g + 1) * per_group], logp_g[g * per_group: (g + 1) * per_group] = (
            ids_src[g * per_group: (g + 1) * per_group], logp_src[g * per_group: (g + 1) * per_group])
    ids_g.flush(), logp_g.flush()
    del ids_g, logp_g
    run_in_one_process([("kd_train.py", dict(writing(runs["common"]), out_dir=str(tmp_path / "w"), topk_write=True,
                                             teacher_topk=8, teacher_topk_dir=str(dst)))], tmp_path)
    a, b = read_store(src), read_store(dst)
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])
    assert (dst / "done.bin").read_bytes() == (src / "done.bin").read_bytes()


def test_student_from_scratch_takes_the_stores_stop_ids(runs, tmp_path):
    """The store records its teacher's stop ids (an Instruct model's end of turn, say); a student
    trained from scratch on it stops where its teacher does, as with a teacher online."""
    teacher = torch.load(runs["teacher"], weights_only=True)
    teacher["stop_ids"] = [7, 2]
    torch.save(teacher, tmp_path / "teacher.pt")
    store, common = tmp_path / "k2", dict(runs["common"], teacher_init=str(tmp_path / "teacher.pt"))
    scratch = dict(common, init_from="scratch", preset="toy", max_iters=1, teacher_topk_dir=str(store))
    run_in_one_process([("kd_train.py", dict(writing(common), out_dir=str(tmp_path / "w"), topk_write=True, teacher_topk=2,
                                             teacher_topk_dir=str(store))),
                        ("kd_train.py", dict(scratch, out_dir=str(tmp_path / "s")))], tmp_path)
    assert read_store(store)[0]["stop_ids"] == [7, 2]
    assert torch.load(tmp_path / "s" / "ckpt.pt", weights_only=True)["stop_ids"] == [7, 2]
    # and its windows' length as all the context it knows (sample.py says so past it); a student from a
    # checkpoint that records none, that checkpoint's max_seq_len
    assert torch.load(tmp_path / "s" / "ckpt.pt", weights_only=True)["trained_context"] == 32
    assert torch.load(runs["dir"] / "rkl_k8" / "ckpt.pt", weights_only=True)["trained_context"] == 256
    # a store from before they were recorded: the student stops at the data's EOS alone, and says how to fix it
    meta = json.loads((store / "meta.json").read_text())
    del meta["stop_ids"]
    (store / "meta.json").write_text(json.dumps(meta))
    r = run("kd_train.py", env=ENV, **dict(scratch, out_dir=str(tmp_path / "old")))
    assert f"warning: the store in {store} predates recorded stop ids" in r.stdout
    assert torch.load(tmp_path / "old" / "ckpt.pt", weights_only=True)["stop_ids"] == []
    # rerunning its write, which finds it complete, records them
    r = run("kd_train.py", env=ENV, **dict(writing(common), out_dir=str(tmp_path / "w2"), topk_write=True, teacher_topk=2,
                                           teacher_topk_dir=str(store)))
    assert "is complete; nothing to write" in r.stdout and read_store(store)[0] == dict(meta, stop_ids=[7, 2])


def test_write_into_a_store_in_use_is_refused(runs, tmp_path):
    # two writers of one store would each skip the groups the other marked done
    store = tmp_path / "s"
    store.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                               "fcntl.lockf(f, fcntl.LOCK_EX); f.truncate(0); f.write('4242'); f.flush(); "
                               "print('held', flush=True); time.sleep(600)", str(store / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = run("kd_train.py", check=False, env=ENV, **dict(writing(runs["common"]), out_dir=str(tmp_path / "w"), topk_write=True,
                                                           teacher_topk=8, teacher_topk_dir=str(store)))
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 2 and "in use by another run (process 4242)" in r.stderr, r.stderr[-2000:]
    assert sorted(os.listdir(store)) == [".lock"]


def test_two_process_write_equals_one(runs, tmp_path):
    run("kd_train.py", nproc=2, env=ENV, **dict(writing(runs["common"]), out_dir=str(tmp_path / "w"), topk_write=True,
                                                teacher_topk=8, teacher_topk_dir=str(tmp_path / "k8")))
    a, b = read_store(runs["dir"] / "k8"), read_store(tmp_path / "k8")
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])


def test_refusals(runs, tmp_path):
    d, common = runs["dir"], dict(runs["common"], out_dir=str(tmp_path / "o"))
    store = str(d / "k8")
    other_data = make_data(tmp_path / "other", seed=5)
    other_tok = make_data(tmp_path / "other_tok", tokenizer_id="synthetic-1")  # the same tokens, another tokenizer
    # data made by hand, without file fingerprints, and a store of it: told apart from other data by their windows
    bare_store, short = tmp_path / "bare_store", make_data(tmp_path / "short", train_tokens=4096)
    shutil.copytree(store, bare_store)
    for meta_file in (bare_store / "meta.json", tmp_path / "short" / "meta.json"):
        meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "data": None}))
    rewritten = shutil.copytree(d / "resumed", tmp_path / "rewritten")  # (a refusal writes nothing: a copy all the same)
    no_rest = shutil.copytree(store, tmp_path / "no_rest")
    os.remove(no_rest / "rest.bin")
    cases = [
        (dict(common, teacher_topk_dir=str(no_rest)), "has rest.bin missing or of another size than its meta.json says"),
        (dict(common, teacher_topk_dir=str(bare_store), data_dir=short), "holds 255 windows, the train split of"),
        (dict(common, teacher_topk_dir=store, data_dir=other_data), "other data"),
        (dict(common, teacher_topk_dir=store, data_dir=other_tok), "another tokenizer"),
        (dict(common, teacher_topk_dir=store, block_size=16), "block_size=32"),
        (dict(common, teacher_topk_dir=store, kd_temperature=2.0), "temperature"),
        (dict(common, teacher_topk_dir=str(tmp_path / "none")), "no store"),
        (dict(writing(common), teacher_topk_dir=store, topk_write=True, teacher_topk=16), "other k"),
        (dict(writing(common), topk_write=True, teacher_topk=V + 1, teacher_topk_dir=str(tmp_path / "s")), "exceeds"),
        (dict(writing(common), teacher_topk_dir=store, topk_write=True, teacher_topk=8, dtype="bfloat16"), "other dtype"),
        # training from a store, the store is the teacher: settings naming another are refused
        (dict(common, teacher_topk_dir=store, teacher_topk=4), "holds the top 8"),
        (dict(common, teacher_topk_dir=store, teacher_topk=256), "holds the top 8"),  # the default, given explicitly
        (dict(common, teacher_topk_dir=store, teacher_init=str(runs["student"])), "was written from"),
        # a store write runs the teacher alone: the student's and the loop's settings would be ignored
        (dict(writing(common), topk_write=True, teacher_topk_dir=str(tmp_path / "s"), init_from=str(runs["student"]),
              max_iters=3), "so init_from, max_iters would be ignored"),
        (dict(writing(common), topk_write=True, teacher_topk_dir=str(tmp_path / "s"), kd_ratio=0.5), "so kd_ratio would be"),
        # no distillation term: its settings would only change the logged kd_loss
        (dict(common, kd_ratio=0.0, kd_temperature=2.0), "kd_ratio=0 trains on the labels alone, so kd_temperature"),
        (dict(common, kd_ratio=0.0, kd_divergence="fkl"), "so kd_divergence would only change"),
        # a resume from a store of its teacher with another k (one written again in place, say), or online
        (dict(common, out_dir=str(rewritten), init_from="resume", teacher_topk_dir=str(d / "full")),
         "was trained from a store of the teacher's top 8, and the store in"),
        (dict(common, out_dir=str(d / "resumed"), init_from="resume"), "was trained from a top-k store; resume it from its store"),
    ]
    # a store whose tokenizer lists one more file (data prepared again beside a chat_template.jinja) is the same tokenizer
    listed = tmp_path / "listed"
    shutil.copytree(store, listed)
    meta = json.loads((listed / "meta.json").read_text())
    meta["tokenizer"] = {**meta["tokenizer"], "files": meta["tokenizer"]["files"] + ["chat_template.jinja"]}
    (listed / "meta.json").write_text(json.dumps(meta))
    run("kd_train.py", **dict(common, teacher_topk_dir=str(listed), max_iters=1, out_dir=str(tmp_path / "listed_run")))
    # a store written before its rest was: read with 1 - sum(top k), and said to be
    old = tmp_path / "old"
    shutil.copytree(store, old)
    os.remove(old / "rest.bin")
    (old / "meta.json").write_text(json.dumps({k: v for k, v in json.loads((old / "meta.json").read_text()).items() if k != "rest"}))
    r = run("kd_train.py", **dict(common, teacher_topk_dir=str(old), max_iters=1, out_dir=str(tmp_path / "old_run")))
    assert "was written before its rest (the teacher's mass outside its top 8) was stored" in r.stdout
    results = run_early_exits("kd_train.py", [(settings, None) for settings, _ in cases])
    for (settings, words), r in zip(cases, results):
        assert r.returncode == 2, (settings, r.stderr)
        assert words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    # a complete store is not rewritten
    r = run_early_exits("kd_train.py", [(dict(writing(common), teacher_topk_dir=store, topk_write=True, teacher_topk=8), None)])[0]
    assert r.returncode == 0 and "complete" in r.stdout
    # nor extended by a teacher retrained in place: the store knows its teacher's bytes, not only its path
    moved = tmp_path / "moved"
    shutil.copytree(store, moved)
    with open(moved / "meta.json") as f:
        meta = json.load(f)
    with open(moved / "meta.json", "w") as f:
        json.dump({**meta, "teacher_init": str(tmp_path / "t.pt")}, f)
    write = dict(writing(common), teacher_topk_dir=str(moved), topk_write=True, teacher_topk=8, teacher_init=str(tmp_path / "t.pt"))
    for source, code in ((runs["teacher"], 0), (runs["student"], 2)):  # the same teacher's bytes, then another's
        shutil.copy(source, tmp_path / "t.pt")
        r = run_early_exits("kd_train.py", [(write, None)])[0]
        assert r.returncode == code, r.stderr
    assert "teacher_digest" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
