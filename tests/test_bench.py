"""bench.py end to end on a toy model: the speed and quality reports are produced from real runs
of the training scripts, and their figures agree with each other."""

import argparse
import json
import math
import re
import statistics
import subprocess
import sys

import pytest

from conftest import ROOT, make_data, read_log, script_env

SMALL = ["--preset", "toy", "--batch_size", "4", "--block_size", "32"]


def bench(*args):
    r = subprocess.run([sys.executable, str(ROOT / "bench.py"), *args], cwd=ROOT, env=script_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def report(out, name, ext="json"):
    """The one report NAME_TAG.EXT in out (TAG: a digest of the run's options)."""
    found = sorted(out.glob(f"{name}_????????.{ext}"))
    assert len(found) == 1, found
    return json.load(open(found[0])) if ext == "json" else found[0].read_text()


def test_speed_report(tmp_path):
    data = make_data(tmp_path / "data")
    out = tmp_path / "out"
    text = bench("speed", "--data_dir", data, "--out_dir", str(out), *SMALL, "--dtypes", "float32",
                 "--compile", "0", "--rounds", "1", "--steps", "2", "--warmup", "1", "--peak_flops", "1e11")
    res = report(out, "speed")["results"]
    assert [r["step"] for r in res] == ["plain", "qat", "kd", "qad"]
    plain = res[0]
    assert plain["ratio_to_plain"] == 1.0
    for r in res:
        assert r["ms_per_step"] > 0
        # the figures of a row agree: tokens/s from ms/step, the ratio from the plain row, MFU from tokens/s
        assert math.isclose(r["tokens_per_sec"], 4 * 32 / (r["ms_per_step"] / 1e3), rel_tol=1e-6)
        assert math.isclose(r["ratio_to_plain"], r["ms_per_step"] / plain["ms_per_step"], rel_tol=1e-6)
        # MFU is the script's own, against the given peak: FLOPs per token x tokens/s / 1e11
        assert 0 < r["mfu"] < 1
    assert "| float32 | eager | qat |" in text
    assert report(out, "speed", "md").count("\n|") == 6  # header, rule, four rows
    # the KD step's bound, measured: plain step + one teacher forward, beside the KD row's ratio
    note = re.search(r"- float32: one teacher forward.* ([0-9.]+) ms; plain step \+ it = ([0-9.]+)x plain, "
                     r"the eager KD step ([0-9.]+)x", text)
    # (no timing compared: on a busy machine the forward alone can take longer than a step)
    assert note and float(note[1]) > 0 and float(note[2]) == pytest.approx(1 + float(note[1]) / plain["ms_per_step"], abs=0.01)
    assert float(note[3]) == round(res[2]["ratio_to_plain"], 2)
    assert "MFU against the highest peak any run measured or was given, per device: float32 0.1 TFLOP/s" in text


def test_speed_runs_as_many_processes_as_it_says(tmp_path):
    # --nproc 2 times the scripts under torchrun, two ranks of a micro-batch each (not one process doing
    # both); every row's MFU counts against one peak per dtype, the highest of those the runs measured
    data = make_data(tmp_path / "data")
    out = tmp_path / "out"
    text = bench("speed", "--data_dir", data, "--out_dir", str(out), *SMALL, "--dtypes", "float32", "--compile", "0",
                 "--steps_of", "plain,qat", "--nproc", "2", "--rounds", "1", "--steps", "2", "--warmup", "1")
    runs = sorted((out / "speed").glob("float32_0_*"))
    assert [r.name for r in runs] == ["float32_0_plain", "float32_0_qat"]
    peaks = []
    for r in runs:
        assert re.search(r"2 process\(es\) on cpu, 256 tokens per step", (r / "output.txt").read_text())
        peaks += [x["peak_flops"] for x in read_log(r) if "loss" in x]
    peak = re.search(r"per device: float32 ([0-9.]+) TFLOP/s", text)
    assert peak and peak[1] == f"{max(peaks) / 1e12:.3g}"  # as the report rounds it
    res = report(out, "speed")["results"]
    for r, run in zip(res, runs):
        rates = [x["mfu"] * x["peak_flops"] for x in read_log(run) if "loss" in x][1:]  # after the warmup step
        assert r["mfu"] == pytest.approx(statistics.median(rates) / max(peaks), rel=1e-6)
        assert r["tokens_per_sec_per_device"] == pytest.approx(r["tokens_per_sec"] / 2)


def test_quality_report(tmp_path):
    data = make_data(tmp_path / "data")
    out = tmp_path / "out"
    bench("quality", "--data_dir", data, "--out_dir", str(out), *SMALL, "--student_preset", "toy",
          "--base_iters", "6", "--ft_iters", "2", "--kd_iters", "2", "--seeds", "1", "--schemes", "8da2w")
    res = report(out, "quality")
    first_report, = out.glob("quality_????????.json")
    s = res["schemes"]["8da2w"]
    run = s["runs"][0]
    fp, ptq, qat, qad = run["fp"], run["ptq"], run["qat"], run["qad"]
    assert all(math.isfinite(x) and x > 1 for x in (fp, ptq, qat, qad))
    assert math.isclose(s["qat_recovery"][0], (ptq - qat) / (ptq - fp), rel_tol=1e-9)
    assert math.isclose(s["qad_recovery"][0], (ptq - qad) / (ptq - fp), rel_tol=1e-9)
    kd = res["kd"]
    ce, kd_loss = kd["runs"][0]["ce"], kd["runs"][0]["kd"]
    assert math.isclose(kd["gap_closed"][0], (ce - kd_loss) / (ce - kd["teacher_val_loss"]), rel_tol=1e-9)
    assert "| 8da2w g32 |" in report(out, "quality", "md")
    # learned scales are a setting of their own: their runs land beside the others, which stay
    q = out / "quality"
    first = (q / "s0_qat_8da2w" / "log.jsonl").read_text()
    bench("quality", "--data_dir", data, "--out_dir", str(out), *SMALL, "--base_ckpt", str(q / "base" / "ckpt.pt"),
          "--ft_iters", "2", "--kd_iters", "0", "--seeds", "1", "--schemes", "8da2w", "--methods", "qat", "--range_learning", "1")
    assert read_log(q / "s0_qat_8da2w_range_learning=True")[-1]["method"] == "qat"
    # GPTQ of each plain finetune, the stronger PTQ, scored beside rounding to nearest
    bench("quality", "--data_dir", data, "--out_dir", str(tmp_path / "gptq"), *SMALL, "--base_ckpt", str(q / "base" / "ckpt.pt"),
          "--ft_iters", "2", "--kd_iters", "0", "--seeds", "1", "--schemes", "8da2w", "--methods", "none", "--gptq_tokens", "256")
    g = report(tmp_path / "gptq", "quality")["schemes"]["8da2w"]
    run = g["runs"][0]
    assert read_log(tmp_path / "gptq" / "quality" / "s0_gptq256_8da2w")[-1]["method"] == "gptq"
    assert math.isclose(g["gptq_recovery"][0], (run["ptq"] - run["gptq"]) / (run["ptq"] - run["fp"]), rel_tol=1e-9)
    assert "| ppl GPTQ | GPTQ recovers |" in report(tmp_path / "gptq", "quality", "md")
    # a setting of every finetune reaches the plain one too, and its runs are named apart
    bench("quality", "--data_dir", data, "--out_dir", str(out), *SMALL, "--base_ckpt", str(q / "base" / "ckpt.pt"),
          "--ft_iters", "2", "--kd_iters", "0", "--seeds", "1", "--schemes", "8da2w", "--methods", "qat", "--ft_set", "beta2=0.999")
    import torch
    for run_dir in ("s0_plain_beta2=0.999", "s0_qat_8da2w_beta2=0.999"):
        assert torch.load(q / run_dir / "ckpt.pt", weights_only=True)["config"]["beta2"] == 0.999
    assert (q / "s0_ptq_8da2w_beta2=0.999" / "log.jsonl").exists()
    assert torch.load(q / "s0_plain" / "ckpt.pt", weights_only=True)["config"]["beta2"] == 0.95
    # a quantization stage after the plain finetune: QAT, QAD and the same steps in full precision start
    # from its weights, on another seed's batches, and the methods are scored against both references
    stage = tmp_path / "stage"
    bench("quality", "--data_dir", data, "--out_dir", str(stage), *SMALL, "--base_ckpt", str(q / "base" / "ckpt.pt"),
          "--ft_iters", "2", "--kd_iters", "0", "--seeds", "1", "--schemes", "8da2w", "--start", "plain",
          "--qad_teacher", "plain")
    plain_ckpt = str(stage / "quality" / "s0_plain" / "ckpt.pt")
    for run_dir in ("s0_plain_after_plain", "s0_qat_8da2w_after_plain", "s0_qad_8da2w_teacher_init=plain_after_plain"):
        config = torch.load(stage / "quality" / run_dir / "ckpt.pt", weights_only=True)["config"]
        assert config["init_from"] == plain_ckpt and config["seed"] == 1000, run_dir
    g = report(stage, "quality_teacher_init=plain_after_plain")["schemes"]["8da2w"]
    run = g["runs"][0]
    assert math.isclose(g["qat_recovery"][0], (run["ptq"] - run["qat"]) / (run["ptq"] - run["fp"]), rel_tol=1e-9)
    for m in ("qat", "qad"):
        assert math.isclose(g[f"{m}_recovery_same_steps"][0],
                            (run["ptq_more"] - run[m]) / (run["ptq_more"] - run["fp_more"]), rel_tol=1e-9)
    assert "trained 2 more steps in full precision" in report(stage, "quality_teacher_init=plain_after_plain", "md")
    # QAD's full-precision reference: the same run without its quantizer (learned scales dropped with it),
    # rounded, and QAD scored against it
    bench("quality", "--data_dir", data, "--out_dir", str(out), *SMALL, "--base_ckpt", str(q / "base" / "ckpt.pt"),
          "--ft_iters", "2", "--kd_iters", "0", "--seeds", "1", "--schemes", "8da2w", "--methods", "qad,kd",
          "--range_learning", "1", "--qad_set", "range_lr_ratio=0.5", "--qad_set", "kd_temperature=3.0")
    config = torch.load(q / "s0_kdfp_kd_temperature=3.0" / "ckpt.pt", weights_only=True)["config"]
    assert (config["quantizer"], config["kd_temperature"], config["range_learning"]) == ("none", 3.0, False)
    assert read_log(q / "s0_ptq_8da2w_kdfp_kd_temperature=3.0")[-1]["method"] == "ptq"
    g = report(out, "quality_range_learning=True_range_learning=True_range_lr_ratio=0.5_kd_temperature=3.0")
    run = g["schemes"]["8da2w"]["runs"][0]
    assert math.isclose(g["schemes"]["8da2w"]["qad_recovery_vs_kd"][0],
                        (run["ptq_kd"] - run["qad"]) / (run["ptq_kd"] - run["fp_kd"]), rel_tol=1e-9)
    assert "the full-precision distillation at QAD's settings" in report(
        out, "quality_range_learning=True_range_learning=True_range_lr_ratio=0.5_kd_temperature=3.0", "md")
    # a setting that leaves fake quant off at the end makes PTQ of the run, which is no QAT figure;
    # a teacher named in --qad_set would not be the one bench gives
    for setting, says in (("--qat_set=fake_quant_after_n_steps=5", "converted as 'ptq', not 'qat'"),
                          ("--qad_set=teacher_init=x", "--qad_set teacher_init=... is not read"),
                          ("--ft_set=seed=3", "--ft_set seed=... is not read"),
                          ("--ft_set=dtype=bfloat16", "--ft_set dtype=... is not read"),
                          # nor may a method's own settings move it off PTQ's grid or seed
                          ("--qat_set=group_size=64", "--qat_set group_size=... is not read"),
                          ("--qad_set=quant_skip=('output',)", "--qad_set quant_skip=... is not read"),
                          ("--qat_set=seed=0", "--qat_set seed=... is not read"),
                          # the grid's settings are the grid's: a dtype there would leave the reference apart
                          ("--quant_set=dtype=bfloat16", "--quant_set dtype=... is no setting of the grid"),
                          # QAD's reference alone would be no comparison
                          ("--methods=qat,kd", "run it with qad")):
        r = subprocess.run([sys.executable, str(ROOT / "bench.py"), "quality", "--data_dir", data, "--out_dir", str(out),
                            *SMALL, "--base_ckpt", str(q / "base" / "ckpt.pt"), "--ft_iters", "2", "--kd_iters", "0",
                            "--seeds", "1", "--schemes", "8da2w", setting], cwd=ROOT, env=script_env(),
                           capture_output=True, text=True, timeout=600)
        assert r.returncode != 0 and says in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert (q / "s0_qat_8da2w" / "log.jsonl").read_text() == first
    # a reference finetune that ends worse than its base (here a learning rate that wrecks it) is named
    bench("quality", "--data_dir", data, "--out_dir", str(tmp_path / "hot"), *SMALL, "--base_ckpt", str(q / "base" / "ckpt.pt"),
          "--ft_iters", "2", "--ft_lr", "0.1", "--kd_iters", "0", "--seeds", "1", "--schemes", "8da2w", "--methods", "none")
    assert "the plain finetunes end worse than the base" in report(tmp_path / "hot", "quality", "md")
    # a base trained again with other settings: the runs made from the old one are not reused
    plain = (q / "s0_plain" / "log.jsonl").read_text()
    bench("quality", "--data_dir", data, "--out_dir", str(out), *SMALL, "--student_preset", "toy", "--base_iters", "8",
          "--ft_iters", "2", "--kd_iters", "0", "--seeds", "1", "--schemes", "8da2w", "--methods", "none")
    assert (q / "s0_plain" / "log.jsonl").read_text() != plain
    # and its report lands beside the first comparison's, which stays as it was
    reports = list(out.glob("quality_????????.json"))
    assert len(reports) == 2 and first_report in reports and json.load(open(first_report)) == res


def saved_bytes(args, dtype, quantizer="none", group_size=32, B=2, T=64):
    """(one block's bytes per token, the output layer and loss's bytes) autograd saves for backward,
    measured: every saved tensor's storage counted once, the weights and RoPE tables aside (they exist anyway)."""
    import logging
    import torch
    logging.getLogger("torchao").setLevel(logging.ERROR)
    from torchao.quantization import (Int4WeightOnlyConfig, Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig,
                                      PerGroup, quantize_)
    from torchao.quantization.qat import QATConfig
    from model import Transformer, chunked_cross_entropy, ce_chunk, fuse_fake_quant
    m = Transformer(args).to(dtype)
    m.init_weights(seed=0)
    if quantizer != "none":  # as the scripts prepare it (qat_train.base_config): torchao's fake quantizers, then the fused ones
        bits = getattr(torch, f"int{quantizer.split('w')[0][-1]}")
        cfg = (Int4WeightOnlyConfig(group_size=group_size) if quantizer == "4w-gpu"
               else Int8DynamicActivationIntxWeightConfig(weight_dtype=bits, weight_granularity=PerGroup(group_size))
               if quantizer.startswith("8da") else IntxWeightOnlyConfig(weight_dtype=bits, granularity=PerGroup(group_size)))
        quantize_(m, QATConfig(cfg, step="prepare"), filter_fn=lambda mod, path: isinstance(mod, torch.nn.Linear))
        fuse_fake_quant(m)
    known = {t.untyped_storage()._cdata for t in (*m.parameters(), m.rope_cos, m.rope_sin)}

    def measure(fn):
        seen = {}

        def pack(t):
            s = t.untyped_storage()
            if s._cdata not in known:
                seen[s._cdata] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(seen.values())

    x = torch.randn(B, T, args.dim, dtype=dtype, requires_grad=True)
    block = measure(lambda: m.layers[0](x, m.rope_cos[:T], m.rope_sin[:T])) / (B * T)
    h = torch.randn(B * T, args.dim, dtype=dtype, requires_grad=True)
    head = measure(lambda: chunked_cross_entropy(h, m.output, torch.randint(0, args.vocab_size, (B * T,)), B * T, ce_chunk))
    return block, head


def test_memory_plan_activations_match_what_autograd_saves():
    import torch
    from bench import activation_bytes, memory_plan
    from model import ModelArgs
    for shape in (dict(dim=128, n_heads=4, n_kv_heads=2, multiple_of=32), dict(dim=256, n_heads=8, n_kv_heads=2, multiple_of=128)):
        args = ModelArgs(**shape, n_layers=1, vocab_size=256, max_seq_len=128)
        for dtype, c, name in ((torch.float32, 4, "float32"), (torch.bfloat16, 2, "bfloat16")):
            per_token, per_block = activation_bytes(args, c)
            plain = saved_bytes(args, dtype)
            assert per_token == plain[0] and per_block == 0
            # int8 activations, weight-only, and torchao's own fake quantizer (4w-gpu), at two group sizes
            for quantizer, g in (("8da4w", 32), ("4w", 32), ("8da2w", 64), ("4w-gpu", 32), ("4w-gpu", 64)):
                if args.hidden_dim % g:
                    continue
                per_token, per_block = activation_bytes(args, c, quantizer, g)
                block, head = saved_bytes(args, dtype, quantizer, g)
                assert per_token + per_block / 128 == block, (quantizer, g, dtype)
                # the output layer's fake quant, on top of the loss's own (one chunk of all 128 tokens)
                plans = [memory_plan(args, 1, 2, 64, name, quantizer=qz, group_size=g)["loss"] for qz in ("none", quantizer)]
                assert plans[1] - plans[0] == head - plain[1], (quantizer, g, dtype)
    # the rest is arithmetic over the meta-device parameter count: sharded 8 ways
    args = ModelArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=64)
    one, eight = (memory_plan(args, n, 2, 128, "bfloat16", mixed_precision=True) for n in (1, 8))
    assert one["optimizer"] == 8 * eight["optimizer"] == 2 * one["parameters"]
    assert one["parameters"] == 4 * sum(p.numel() for p in __import__("model").Transformer(args).parameters())


def test_run_once_reruns_on_data_prepared_again(tmp_path, monkeypatch, capsys):
    # the reuse key holds the data's fingerprints, not only its path: data prepared again in place
    # would otherwise pair an old plain finetune's loss with a new QAT run's
    sys.path.insert(0, str(ROOT))
    import bench as bench_module

    calls = []

    def fake_run(script, args, out_dir, nproc=1, quiet=True):
        calls.append(out_dir)
        records = [{"iter": 1, "fp_val_loss": float(len(calls))}]
        (tmp_path / "out").mkdir(exist_ok=True)
        (tmp_path / "out" / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return records

    monkeypatch.setattr(bench_module, "run", fake_run)
    monkeypatch.setattr(bench_module, "REUSED_FROM_OTHER", [])
    data = make_data(tmp_path / "data")
    args = {"data_dir": str(data), "max_iters": 1}
    first = bench_module.run_once("qat_train.py", args, str(tmp_path / "out"))
    assert bench_module.run_once("qat_train.py", args, str(tmp_path / "out")) == first and len(calls) == 1  # reused
    assert "run by other code" not in capsys.readouterr().out
    # a run made by other scripts is reused, and said to be
    monkeypatch.setattr(bench_module, "code_digest", lambda: "other")
    assert bench_module.run_once("qat_train.py", args, str(tmp_path / "out")) == first and len(calls) == 1
    assert "reused, though run by other code" in capsys.readouterr().out
    # and by other torch / torchao versions
    monkeypatch.setattr(bench_module, "library_versions", lambda: {"torch": "0", "torchao": "0"})
    assert bench_module.run_once("qat_train.py", args, str(tmp_path / "out")) == first and len(calls) == 1
    assert "code than this checkout's and other versions ({'torch'" in capsys.readouterr().out
    make_data(tmp_path / "data", val_tokens=1024, seed=5)  # the same path, other tokens
    assert bench_module.run_once("qat_train.py", args, str(tmp_path / "out"))[0]["fp_val_loss"] == 2.0 and len(calls) == 2
    # the code a run starts with is what it is credited to: edited while it ran, it is not this checkout's
    code = {"digest": "v1"}
    monkeypatch.setattr(bench_module, "code_digest", lambda: code["digest"])
    monkeypatch.setattr(bench_module, "run", lambda *a, **k: (code.update(digest="v2"), fake_run(*a, **k))[1])
    bench_module.run_once("qat_train.py", {**args, "max_iters": 2}, str(tmp_path / "out"))
    assert len(calls) == 3 and "changed while" in capsys.readouterr().out
    bench_module.REUSED_FROM_OTHER.clear()
    bench_module.run_once("qat_train.py", {**args, "max_iters": 2}, str(tmp_path / "out"))
    assert len(calls) == 3 and "reused, though run by other code" in capsys.readouterr().out
    # and every report written after says which runs came from other code
    bench_module.write(argparse.Namespace(out_dir=str(tmp_path / "reports")), "quality", "a table\n", {"results": 1})
    (md,), (js,) = (list((tmp_path / "reports").glob(f"quality_*.{e}")) for e in ("md", "json"))
    assert f"- {tmp_path / 'out'}: other code than this checkout's" in md.read_text().split("Reused, though not run by")[1]
    assert json.loads(js.read_text())["reused_from_other_code"] == bench_module.REUSED_FROM_OTHER != []


def test_speed_compiled_on_a_vocabulary_of_random_tokens(tmp_path):
    # the real scripts compiled: their QAT step is one graph per block, compiled once for training
    # (the final evaluation's no_grad forward once more); the data random tokens of the vocabulary asked for
    out = tmp_path / "out"
    bench("speed", "--out_dir", str(out), *SMALL, "--dtypes", "float32", "--compile", "1", "--steps_of", "plain,qat",
          "--vocab_size", "300", "--rounds", "1", "--steps", "1", "--warmup", "1", "--peak_flops", "1e11")
    res = report(out, "speed")["results"]
    assert [(r["step"], r["graph_breaks"], r["recompiles"]) for r in res] == [("plain", 0, 0), ("qat", 0, 0)]
    assert all(r["recompiles_grad_mode"] >= 1 for r in res)
    # every weight matrix trained; one that a step left as it started would be named
    assert all(r["untrained"] == [] for r in res)
    sys.path.insert(0, str(ROOT))
    import bench as bench_module
    teacher = out / "speed" / "teacher.pt"
    names = bench_module.unchanged_weights(bench_module.load_checkpoint(teacher), teacher)
    assert "layers.0.attention.wq.weight" in names and "output.weight" in names and not any("norm" in n for n in names)
    meta = json.load(open(out / "speed" / "data_300" / "meta.json"))
    assert meta["vocab_size"] == 300 and meta["dtype"] == "uint16"
    assert "0 / 0 (+" in report(out, "speed", "md")


def test_dynamo_events_are_read_from_torchs_own_log(tmp_path):
    # the log lines of the installed torch: a graph break, a recompilation for a new shape, one for no_grad
    code = ("import torch\n@torch.compile(dynamic=False)\ndef f(x):\n    x = x * 2\n    torch._dynamo.graph_break()\n"
            "    return x + 1\nx = torch.randn(3, requires_grad=True)\nf(x)\nf(torch.randn(4, 4, requires_grad=True))\n"
            "with torch.no_grad():\n    f(x)\n")
    r = subprocess.run([sys.executable, "-c", code], env=script_env() | {"TORCH_LOGS": "graph_breaks,recompiles"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (tmp_path / "output.txt").write_text(r.stdout + r.stderr)
    sys.path.insert(0, str(ROOT))
    import bench as b
    got = b.dynamo_events(tmp_path / "output.txt")
    assert got["graph_breaks"] >= 1 and "<string>:5" in got["graph_breaks_first"], got
    assert got["recompiles"] >= 1 and "Recompiling function f" in got["recompiles_first"], got
    assert got["recompiles_grad_mode"] >= 1, got


@pytest.mark.parametrize("args, says", [(["speed", "--schemes", "4w"], "speed does not read --schemes"),
                                        (["quality", "--quantizer", "4w"], "quality does not read --quantizer"),
                                        (["memory", "--dtype", "bfloat16", "--gptq_tokens", "8"],
                                         "memory does not read --dtype, --gptq_tokens"),
                                        (["kd", "--range_learning", "1"], "kd does not read --range_learning"),
                                        (["speed", "--steps_of", "qat,kd"], "--steps_of 'qat,kd': name each of plain"),
                                        (["speed", "--vocab_size", "1"], "--vocab_size 1: a vocabulary needs 2 tokens"),
                                        (["quality", "--vocab_size", "300"], "quality does not read --vocab_size"),
                                        (["speed", "--preset", "torchtune", "--batch_size", "8"],
                                         "--preset torchtune sets the shape torchtune was measured with; drop --batch_size"),
                                        (["memory", "--nproc", "8", "--replicate_degree", "3"],
                                         "--replicate_degree 3 must divide --nproc 8")])
def test_options_a_mode_would_ignore_are_refused(args, says):
    # each mode names what it reads: a setting meant for another (quality's schemes, speed's quantizer) is one line
    r = subprocess.run([sys.executable, str(ROOT / "bench.py"), *args], cwd=ROOT, env=script_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and says in r.stderr, r.stderr[-3000:]


def test_options_a_mode_reads_are_taken(tmp_path):
    # the other side of the list above: memory reads its own options (and needs no data when a tiny
    # preset's vocabulary, which the scripts take from the data, is given)
    bench("memory", "--out_dir", str(tmp_path), "--nproc", "2", "--replicate_degree", "2", "--quantizer", "8da2w",
          "--preset", "toy", "--batch_size", "2", "--block_size", "64", "--vocab_size", "4096")
    assert "vocabulary 4096" in report(tmp_path, "memory_toy_2", "md") and "8da2w g32" in report(tmp_path, "memory_toy_2", "md")
    for args, says in ((["--data_dir", str(tmp_path / "none")], "--preset toy takes its vocabulary from the data"),
                       (["--vocab_size", "4096", "--quantizer", "8da4"], "--quantizer '8da4' is unknown")):
        r = subprocess.run([sys.executable, str(ROOT / "bench.py"), "memory", "--preset", "toy", "--out_dir", str(tmp_path),
                            *args], cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and says in r.stderr, r.stderr[-3000:]
