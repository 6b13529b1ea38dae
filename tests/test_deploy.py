"""Deployment: a converted 8da4w model exported to an ExecuTorch program lowered to XNNPACK and run
by ExecuTorch's own runtime gives the converted PyTorch model's logits and greedy text; schemes
XNNPACK cannot run are refused before any export work."""

import json
import logging
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

logging.getLogger("torchao").setLevel(logging.ERROR)
from torchao.quantization import (Int4WeightOnlyConfig, Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig,
                                  PerGroup, quantize_)
from torchao.quantization.qat import QATConfig

import checkpoint  # noqa: E402
from checkpoint import ExecuTorchModel, export_executorch, load_checkpoint
from conftest import ROOT, corpus, make_data, run, run_early_exits, script_env
from model import ModelArgs, Transformer

ARGS = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=64, vocab_size=128)


@pytest.fixture(scope="module")
def trained():
    """A one-layer model trained for a few seconds on repeated patterns, so that greedy decoding
    has clear winners (a random model's near-uniform logits would flip on any rounding)."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**ARGS))
    model.init_weights(seed=0)
    data = torch.from_numpy(corpus(8192, vocab_size=128, n_patterns=8)).long()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        i = torch.randint(0, len(data) - 33, (16,), generator=g)
        batch = torch.stack([data[j:j + 33] for j in i.tolist()])
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), data


def converted(model, config):
    q = Transformer(model.args)
    q.load_state_dict(model.state_dict())
    quantize_(q, config)
    return q.eval()


def config_8da(bits):
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=getattr(torch, f"int{bits}"), weight_granularity=PerGroup(32))


@pytest.mark.parametrize("bits", [4, 2])
def test_pte_matches_converted_model(trained, tmp_path, bits):
    fp, data = trained
    q = converted(fp, config_8da(bits))
    path = str(tmp_path / "model.pte")
    export_executorch(q, path)
    assert b"XnnpackBackend" in open(path, "rb").read()  # the linears were delegated, not left to portable ops
    et = ExecuTorchModel(path)
    assert (et.max_seq_len, et.vocab_size) == (64, 128)
    x = data[:64][None]
    with torch.no_grad():
        ref, full = q(x), fp(x)
    out = et(x, torch.arange(64))
    # XNNPACK quantizes the activations to int8 itself: a rounding apart from torchao can move a
    # code by one step. That error must stay far below what quantization itself changes
    # XNNPACK quantizes activations to int8 with its own rounding: it may differ from torchao's
    # by about as much as torchao's int8 rounding differs from none (same weights, float activations)
    with torch.no_grad():
        wo = converted(fp, IntxWeightOnlyConfig(weight_dtype=getattr(torch, f"int{bits}"), granularity=PerGroup(32)))(x)
    assert (out - ref).norm() < 1.5 * (ref - wo).norm() < 0.5 * (ref - full).norm()
    ce = lambda logits: F.cross_entropy(logits[0, :-1], x[0, 1:]).item()
    assert abs(ce(out) - ce(ref)) < 0.01
    # the cache: a prompt prefilled and then fed one token at a time gives the same logits
    steps = [et(x[:, :40], torch.arange(40))] + [et(x[:, i:i + 1], torch.tensor([i])) for i in range(40, 48)]
    torch.testing.assert_close(torch.cat(steps, 1), out[:, :48], atol=1e-5, rtol=1e-5)
    prompt = data[100:108][None]
    assert et.generate(prompt, 40).tolist() == q.generate(prompt, 40, temperature=0).tolist()


def test_refusals(trained, tmp_path):
    fp, _ = trained
    path = str(tmp_path / "model.pte")
    with pytest.raises(ValueError, match="no quantized weights"):
        export_executorch(fp, path)
    with pytest.raises(ValueError, match="without int8 activations"):
        export_executorch(converted(fp, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))), path)
    with pytest.raises(ValueError, match="8-bit weights in groups of 32"):
        export_executorch(converted(fp, config_8da(8)), path)
    q = converted(fp, config_8da(4))
    quantize_(q, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
              filter_fn=lambda m, _: isinstance(m, nn.Embedding))
    with pytest.raises(ValueError, match="quantized embedding"):
        export_executorch(q, path)
    with pytest.raises(ValueError, match="max_seq_len=65"):
        export_executorch(converted(fp, config_8da(4)), path, max_seq_len=65)


def test_qat_train_writes_pte(tmp_path, monkeypatch):
    data = make_data(tmp_path / "data", vocab_size=128)
    out = tmp_path / "out"
    r = run("qat_train.py", preset="toy", n_layer=1, block_size=32, batch_size=4, max_iters=4, eval_iters=1,
            eval_interval=1000, quantizer="8da4w", export_format="pte", data_dir=data, out_dir=out)
    # toy: 1 layer, 2 kv heads of 32, 256 positions: float32 keys and values of 128 KiB
    assert f"exported: {out / 'model.pte'} (" in r.stdout and "; a KV cache of 256 positions, 0.1 MiB when it runs)" in r.stdout
    args, state = load_checkpoint(str(out / "quantized.pt"))
    with torch.device("meta"):
        q = Transformer(args)
    q.load_state_dict(state, assign=True)
    q.reset_buffers("cpu")
    et = ExecuTorchModel(str(out / "model.pte"))
    x = torch.from_numpy(np.fromfile(out / ".." / "data" / "val.bin", dtype=np.uint16)[:64].astype(np.int64))[None]
    with torch.no_grad():
        ref = q(x)
    out_logits = et(x, torch.arange(64))
    assert abs(F.cross_entropy(out_logits[0, :-1], x[0, 1:]) - F.cross_entropy(ref[0, :-1], x[0, 1:])) < 0.01
    assert et.generate(x[:, :8], 16).shape == (1, 24)
    # exported again from the file, as sample.py --export_pte and bench.py deploy do (loaded with
    # assign=True, whose integer weights keep requires_grad): the same program, its cache held to
    # PTE_CONTEXT positions by default (a real model's whole context would not fit a phone)
    monkeypatch.setattr(checkpoint, "PTE_CONTEXT", 64)
    assert export_executorch(q, str(tmp_path / "again.pte")) == 64
    again = ExecuTorchModel(str(tmp_path / "again.pte"))
    assert again.max_seq_len == 64
    torch.testing.assert_close(again(x, torch.arange(64)), out_logits)


def test_script_refusals(tmp_path):
    data = make_data(tmp_path / "data")
    base = dict(preset="toy", data_dir=data, out_dir=tmp_path / "out")
    cases = [("qat_train.py", dict(quantizer="4w-gpu"), "quantizer='4w-gpu'.*device='cuda'"),
             ("qat_train.py", dict(quantizer="4w", export_format="pte"), "export_format='pte'.*8daNw"),
             ("qat_train.py", dict(quantizer="none", export_format="pte"), "export_format='pte'.*8daNw"),
             ("qat_train.py", dict(quantizer="8da8w", export_format="pte"), "N <= 4"),
             ("qat_train.py", dict(quantizer="8da4w", quantize_embedding=True, export_format="pte"), "quantize_embedding=False"),
             ("kd_train.py", dict(quantizer="4w-gpu"), "quantizer='4w-gpu'.*device='cuda'"),
             ("kd_train.py", dict(quantizer="8da4w", dtype="bfloat16", export_format="pte"), "dtype='float32'")]
    for script in ("qat_train.py", "kd_train.py"):  # each script's cases in one interpreter: imports once
        mine = [(settings, message) for s, settings, message in cases if s == script]
        for (settings, message), r in zip(mine, run_early_exits(script, [({**base, **settings}, None) for settings, _ in mine])):
            assert r.returncode == 2 and re.search(message, r.stderr) and r.stderr.count("\n") == 1, (settings, r.stderr)


def test_int4_gpu_fake_quant_prepares_on_cpu():
    """'4w-gpu' trains with the fake quantization QATConfig derives from Int4WeightOnlyConfig; its
    conversion needs CUDA, but training under it runs anywhere: int4 levels, 16 per group of 32."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**ARGS)).to(torch.bfloat16)
    model.init_weights(seed=0)
    quantize_(model, QATConfig(Int4WeightOnlyConfig(group_size=32), step="prepare"),
              filter_fn=lambda m, _: isinstance(m, nn.Linear))
    wq = model.layers[0].attention.wq
    fq = wq.weight_fake_quantizer(wq.weight).detach()
    assert not torch.equal(fq, wq.weight.detach())
    assert max(g.unique().numel() for g in fq.float().reshape(-1, 32)) <= 16
    x = torch.randint(0, 128, (2, 16))
    loss = model(x, x)
    loss.backward()
    assert torch.isfinite(loss) and wq.weight.grad.abs().sum() > 0


def test_bench_deploy(tmp_path):
    data = make_data(tmp_path / "data", vocab_size=128)
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "bench.py", "deploy", "--data_dir", data, "--out_dir", str(out), "--preset", "toy",
                        "--n_layer", "1", "--base_iters", "4", "--batch_size", "4", "--block_size", "32", "--rounds", "1",
                        "--new_tokens", "8", "--eval_windows", "2"], cwd=ROOT, env=script_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    res = {row["format"]: row for row in json.load(open(next(out.glob("deploy_*.json"))))["results"]}
    assert list(res) == ["full precision", "converted", "executorch"]
    assert res["executorch"]["file_mb"] < res["full precision"]["file_mb"]
    assert abs(res["executorch"]["val_loss"] - res["converted"]["val_loss"]) < 0.01
    # a first call's one-time costs are not timed: they once made the rate's denominator vanish (1e10 tokens/s)
    assert all(0 < row["decode_tokens_per_sec"] < 1e7 for row in res.values()), res
    # it measures on this CPU, in one process: options it would ignore are refused
    r = subprocess.run([sys.executable, "bench.py", "deploy", "--device", "cuda", "--nproc", "2"], cwd=ROOT, env=script_env(),
                       capture_output=True, text=True)
    assert r.returncode == 2 and "deploy does not read --device, --nproc" in r.stderr, r.stderr[-3000:]
