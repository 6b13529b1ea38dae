# A ~5M-parameter Llama trained from scratch on the default corpus (the Python standard library,
# prepared by `python data_prep.py`): the base model the tiny QAT, KD and QAD configs start from.
# About 5 minutes on a 2-core CPU.
# $ python qat_train.py config/tiny_base.py
out_dir = "out/tiny_base"
data_dir = "data/stdlib"
init_from = "scratch"
preset = "tiny"  # dim 256, 4 layers, 4 heads (2 kv heads), vocab from the data
quantizer = "none"  # a plain training run: the full-precision base
batch_size = 16
block_size = 128
max_iters = 600
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 30
eval_interval = 200
log_interval = 20
ckpt_interval = 200
