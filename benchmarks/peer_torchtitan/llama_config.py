"""A torchtitan 0.3.0 config of the Llama a portable_fsdp run trains (`--module llama_config --config llama_peer`),
for benchmarks/peers.py. Sizes and hyper-parameters come from PEER_* variables the benchmark sets.

Attention is ScaledDotProductAttention (causal) instead of flex or varlen: flex has no backward on CPU and varlen
runs on CUDA only. What stays torchtitan's own: its initialisation (truncated normal, depth-scaled outputs), its
RoPE layout (complex pairs), its fused qkv projection, weight decay on every parameter, its data loader (documents
in order, the end-of-document token never an input). Its seed is pinned (PEER_SEED, ours' seed), so that its
loss curve is the same from run to run."""
import os

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer
from torchtitan.components.validate import Validator
from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init,
                                      Llama3Model, Llama3StateDictAdapter, parallelize_llama, pipeline_llm)
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer


def _env(name: str, kind=int):
    return kind(os.environ[name])


def llama_peer() -> Trainer.Config:
    dim, heads, seq = _env("PEER_HIDDEN"), _env("PEER_HEADS"), _env("PEER_SEQ")
    vocab, batch = _env("PEER_VOCAB"), _env("PEER_BATCH")
    blocks = _build_llama3_layers(
        fuse_qkv=True, n_layers=_env("PEER_LAYERS"), dim=dim, n_heads=heads, n_kv_heads=_env("PEER_KV_HEADS"),
        hidden_dim=_env("PEER_INTER"),
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=max(seq, 1024), theta=_env("PEER_ROPE_THETA", float),
                                scaling="none"),
        attn_backend="flex")
    for block in blocks:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    model = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=blocks)
    spec = ModelSpec(name="llama3", flavor="peer", model=model, parallelize_fn=parallelize_llama,
                     pipelining_fn=pipeline_llm, post_optimizer_build_fn=None,
                     state_dict_adapter=Llama3StateDictAdapter)
    optimizer = default_adamw(lr=_env("PEER_LR", float))  # betas (0.9, 0.95), eps 1e-8, weight decay 0.1 as ours
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        hf_assets_path="./tests/assets/tokenizer",
        model_spec=spec,
        optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=_env("PEER_WARMUP"), decay_type="cosine",
                                                  min_lr_factor=_env("PEER_MIN_LR_RATIO", float)),
        training=TrainingConfig(global_batch_size=batch, local_batch_size=batch // _env("WORLD_SIZE"), seq_len=seq,
                                steps=_env("PEER_STEPS"), max_norm=_env("PEER_MAX_NORM", float),
                                mixed_precision_param="float32"),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test"),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        validator=Validator.Config(enable=False),
        debug=DebugConfig(seed=_env("PEER_SEED")),  # unset, each run would draw other initial weights
    )
