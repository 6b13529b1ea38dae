"""bench.py end to end on a toy model: the speed and quality reports are produced from real runs
of the training scripts, and their figures agree with each other."""

import json
import math
import subprocess
import sys

from conftest import ROOT, make_data, script_env

SMALL = ["--preset", "toy", "--batch_size", "4", "--block_size", "32"]


def bench(*args):
    r = subprocess.run([sys.executable, str(ROOT / "bench.py"), *args], cwd=ROOT, env=script_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_speed_report(tmp_path):
    data = make_data(tmp_path / "data")
    out = tmp_path / "out"
    text = bench("speed", "--data_dir", data, "--out_dir", str(out), *SMALL, "--dtypes", "float32",
                 "--compile", "0", "--rounds", "1", "--steps", "2", "--warmup", "1", "--peak_flops", "1e11")
    res = json.load(open(out / "speed.json"))["results"]
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
    assert (out / "speed.md").read_text().count("\n|") == 6  # header, rule, four rows


def test_quality_report(tmp_path):
    data = make_data(tmp_path / "data")
    out = tmp_path / "out"
    bench("quality", "--data_dir", data, "--out_dir", str(out), *SMALL, "--student_preset", "toy",
          "--base_iters", "6", "--ft_iters", "2", "--kd_iters", "2", "--seeds", "1", "--schemes", "8da2w")
    res = json.load(open(out / "quality.json"))
    s = res["schemes"]["8da2w"]
    run = s["runs"][0]
    fp, ptq, qat, qad = run["fp"], run["ptq"], run["qat"], run["qad"]
    assert all(math.isfinite(x) and x > 1 for x in (fp, ptq, qat, qad))
    assert math.isclose(s["qat_recovery"][0], (ptq - qat) / (ptq - fp), rel_tol=1e-9)
    assert math.isclose(s["qad_recovery"][0], (ptq - qad) / (ptq - fp), rel_tol=1e-9)
    kd = res["kd"]
    ce, kd_loss = kd["runs"][0]["ce"], kd["runs"][0]["kd"]
    assert math.isclose(kd["gap_closed"][0], (ce - kd_loss) / (ce - kd["teacher_val_loss"]), rel_tol=1e-9)
    assert "| 8da2w g32 |" in (out / "quality.md").read_text()
