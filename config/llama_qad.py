# Quantization-aware self-distillation (QAD) of Llama-3.1-8B on 8 GPUs: the 8da4w fake-quantized
# student learns from the full-precision model's own distribution instead of (only) the labels.
# $ torchrun --standalone --nproc_per_node 8 kd_train.py config/llama_qad.py
teacher_init = "checkpoints/Llama-3.1-8B"
init_from = "checkpoints/Llama-3.1-8B"  # the same weights: the teacher is the student before rounding
data_dir = "data/llama3"
out_dir = "out/llama3_qad"
device = "cuda"
dtype = "bfloat16"
# fp32 master weights under bf16 compute: at lr 2e-5 a bf16 weight above ~0.008 in magnitude (most of an 8B
# model's) has a spacing AdamW's steps cannot cross, so pure bf16 (torchtune's recipe) would leave it as it was
mixed_precision = True
compile = True
activation_checkpointing = 1
quantizer = "8da4w"
group_size = 32
fake_quant_after_n_steps = 0  # the teacher already is the warm start
kd_divergence = "fkl"
kd_ratio = 0.5  # teacher and labels: at small scale this beat both pure self-distillation and plain QAT
kd_temperature = 2.0  # softer distributions won back more at every size and width measured (README, "Quality")
batch_size = 2
block_size = 2048
gradient_accumulation_steps = 32
max_iters = 1000
learning_rate = 2e-5
min_lr = 2e-6
warmup_iters = 50
weight_decay = 0.0
eval_interval = 100
eval_iters = 20
log_interval = 10
ckpt_interval = 200
# each process writes its own shards: an 8B model with AdamW state is 48-96 GB in one file
sharded_checkpoint = True
