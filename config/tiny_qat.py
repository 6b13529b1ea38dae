# QAT finetune of the tiny base model: int8 dynamic activations + int4 per-group weights (8da4w),
# fake quant switched on at step 20. Prints the starting model's full-precision and PTQ loss,
# then the finetuned model's full-precision and converted (QAT) loss. About 1.5 minutes on CPU.
# $ python qat_train.py config/tiny_qat.py
# A 2-bit variant, where PTQ hurts clearly: --quantizer=8da2w --out_dir=out/tiny_qat2
out_dir = "out/tiny_qat"
data_dir = "data/stdlib"
init_from = "out/tiny_base/ckpt.pt"
quantizer = "8da4w"
group_size = 32
fake_quant_after_n_steps = 20
batch_size = 16
block_size = 128
max_iters = 100
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 10
eval_interval = 50
log_interval = 10
ckpt_interval = 100
# ema_decay = 0.9 (the weights' average over the last steps) helps 4-bit QAT of bases trained to the end, and
# costs this base, still learning, 0.05 ppl (README, Quality)
