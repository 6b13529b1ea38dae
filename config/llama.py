# QAT finetune of Llama-3.1-8B (or Llama-3-8B: point init_from at it) on one node of 8 GPUs:
# int8 dynamic activations + int4 per-group weights (8da4w), bf16, activation checkpointing,
# fake quant switched on after a short warm start. A Hugging Face directory as downloaded
# (config.json, model-*.safetensors, tokenizer.json); the data is prepared with its tokenizer:
# $ python data_prep.py --input my_corpus/ --tokenizer checkpoints/Llama-3.1-8B --out_dir data/llama3
# $ torchrun --standalone --nproc_per_node 8 qat_train.py config/llama.py
# Several nodes: torchrun --nnodes N --nproc_per_node 8 ... --replicate_degree=N (HSDP: shard in a node)
init_from = "checkpoints/Llama-3.1-8B"  # a Hugging Face (config.json) or Meta (params.json) directory
data_dir = "data/llama3"  # prepared with the model's own tokenizer (checked against it at start)
out_dir = "out/llama3_qat"
device = "cuda"
dtype = "bfloat16"
# fp32 master weights under bf16 compute: at lr 2e-5 a bf16 weight above ~0.008 in magnitude (most of an 8B
# model's) has a spacing AdamW's steps cannot cross, so pure bf16 (torchtune's recipe) would leave it as it was
mixed_precision = True
compile = True
activation_checkpointing = 1  # every block: 8B activations at 2 x 2048 tokens would not fit otherwise
quantizer = "8da4w"
group_size = 32  # divides 4096 and 14336
fake_quant_after_n_steps = 100  # let the finetune settle on the new data before weights are rounded
batch_size = 2  # per GPU
block_size = 2048
gradient_accumulation_steps = 32  # over all 8 GPUs: 4 micro-batches each, 131k tokens a step
max_iters = 1000
learning_rate = 2e-5
min_lr = 2e-6
warmup_iters = 50
weight_decay = 0.0
grad_clip = 1.0
eval_interval = 100
eval_iters = 20
log_interval = 10
ckpt_interval = 200
export_format = "hf"  # the trained full-precision weights too, for transformers / vLLM / ExecuTorch
# each process writes its own shards: an 8B model with AdamW state is 48-96 GB in one file
sharded_checkpoint = True
