# Quantization-aware self-distillation of the tiny base model: the 8da4w fake-quantized student
# learns the full-precision model's own next-token distribution, beside the labels. Same steps as config/tiny_qat.py,
# so the two converted models compare directly. About 2.5 minutes on a 2-core CPU.
# $ python kd_train.py config/tiny_qad.py
out_dir = "out/tiny_qad"
data_dir = "data/stdlib"
teacher_init = "out/tiny_base/ckpt.pt"
init_from = "out/tiny_base/ckpt.pt"  # the teacher's own weights
quantizer = "8da4w"
group_size = 32
fake_quant_after_n_steps = 20
kd_divergence = "fkl"
kd_ratio = 0.5  # labels and teacher: recovered 77% of 8da2w PTQ's loss vs 58% with 1.0 (bench.py quality)
kd_temperature = 2.0  # softer distributions: 77 -> 85% at 8da2w, both seeds (README, "Quality")
batch_size = 16
block_size = 128
max_iters = 100
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 10
eval_interval = 50
log_interval = 10
ckpt_interval = 100
