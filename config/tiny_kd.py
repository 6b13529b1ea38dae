# Distill the tiny base model (teacher) into a 2-layer, 128-wide student trained from scratch.
# About 2 minutes on a 2-core CPU; compare with --kd_ratio=0.0 (labels only, same steps).
# $ python kd_train.py config/tiny_kd.py
out_dir = "out/tiny_kd"
data_dir = "data/stdlib"
teacher_init = "out/tiny_base/ckpt.pt"
init_from = "scratch"
preset = "tiny-student"
kd_divergence = "fkl"
kd_ratio = 0.9  # closed 52% of the student-teacher gap against 35% at 0.5, both seeds (README, "Quality")
kd_temperature = 1.0
batch_size = 16
block_size = 128
max_iters = 300
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 30
eval_interval = 100
log_interval = 20
ckpt_interval = 300
