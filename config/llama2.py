# QAT finetune of Llama-2-7B on one node of 8 GPUs: int8 dynamic activations + int4 weights
# (8da4w), bf16, activation checkpointing, fake quant switched on after a short warm start.
# $ python data_prep.py --input my_corpus/ --tokenizer checkpoints/Llama-2-7b/tokenizer.model --out_dir data/llama2
# $ torchrun --standalone --nproc_per_node 8 qat_train.py config/llama2.py
# a Meta (params.json) or Hugging Face (config.json) directory; a Meta one of Llama 2 needs a nanotune.json
# beside params.json saying its context, {"max_seq_len": 4096}, which Meta's files leave out (README, "Real models")
init_from = "checkpoints/Llama-2-7b"
data_dir = "data/llama2"  # prepared with the model's own tokenizer.model
out_dir = "out/llama_qat"
device = "cuda"
dtype = "bfloat16"
# fp32 master weights under bf16 compute: at lr 2e-5 a bf16 weight above ~0.008 in magnitude (most of an 8B
# model's) has a spacing AdamW's steps cannot cross, so pure bf16 (torchtune's recipe) would leave it as it was
mixed_precision = True
compile = True
activation_checkpointing = 1  # every block: 7B activations at 2 x 2048 tokens would not fit otherwise
quantizer = "8da4w"
group_size = 32  # divides 4096 and 11008
fake_quant_after_n_steps = 100  # let the finetune settle on the new data before weights are rounded
batch_size = 2  # per GPU
block_size = 2048
gradient_accumulation_steps = 32  # over all 8 GPUs: 4 micro-batches each, 131k tokens a step
export_format = "hf"  # the trained full-precision weights too, for transformers / vLLM / ExecuTorch
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
# each process writes its own shards: a 7B model with AdamW state is 42-84 GB in one file
sharded_checkpoint = True
