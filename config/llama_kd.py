# Distill Llama-3.1-8B into Llama-3.2-1B (both on the Llama 3 tokenizer) on 8 GPUs, training
# LoRA adapters on every projection of the student (its tied embeddings stay frozen and tied).
# $ python data_prep.py --input my_corpus/ --tokenizer checkpoints/Llama-3.2-1B --out_dir data/llama3
# $ torchrun --standalone --nproc_per_node 8 kd_train.py config/llama_kd.py
teacher_init = "checkpoints/Llama-3.1-8B"  # Hugging Face or Meta directory
init_from = "checkpoints/Llama-3.2-1B"  # the student
data_dir = "data/llama3"
out_dir = "out/llama3_kd"
device = "cuda"
dtype = "bfloat16"
compile = True
activation_checkpointing = 1
kd_divergence = "fkl"
kd_ratio = 0.9  # mostly the teacher: it closed more of the gap at small scale (README, "Quality")
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
# each process writes its own shards of the student (the teacher is never saved), not rank 0 alone
sharded_checkpoint = True
