# Distill Llama-2-7B into TinyLlama-1.1B (both on the Llama 2 tokenizer) on 8 GPUs, training
# LoRA adapters on every projection of the student.
# $ torchrun --standalone --nproc_per_node 8 kd_train.py config/llama_kd.py
teacher_init = "checkpoints/Llama-2-7b"  # Meta or Hugging Face directory
init_from = "checkpoints/TinyLlama-1.1B"  # the student, e.g. TinyLlama/TinyLlama_v1.1 in HF layout
data_dir = "data/llama2"
out_dir = "out/llama_kd"
device = "cuda"
dtype = "bfloat16"
compile = True
activation_checkpointing = 1
kd_divergence = "fkl"
kd_ratio = 0.5
kd_temperature = 1.0
lora_rank = 64
lora_alpha = 128.0
lora_targets = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
export_format = "hf"  # the merged student, ready for transformers
batch_size = 4  # per GPU
block_size = 2048
gradient_accumulation_steps = 8
max_iters = 1000
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 50
weight_decay = 0.0
eval_interval = 100
eval_iters = 20
log_interval = 10
ckpt_interval = 200
# each process writes its own shards: an 8B model with AdamW state is 48-96 GB in one file
sharded_checkpoint = True
