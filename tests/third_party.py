"""Real third-party Flax models from PyPI (transformers' Flax classes), tiny configs, random init.

Each entry gives the linen module exactly as its package builds it, a loss written the way
its users write one, and deterministic batches. Nothing is downloaded: configs are built in
code and the weights are random.

What each brings: GPT-2 ties its output layer to the embedding by reading
``self.variables`` and stores Conv1D kernels ``(out, in)``; Llama has grouped KV heads
(2 KV heads for 4 query heads) and an untied ``lm_head``; BERT is an encoder trained with a
masked-LM loss normalised by the batch's count of masked tokens, with a tied decoder; ViT
starts with a patch convolution; ResNet has convolutions and BatchNorm statistics.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import optax

SEQ = 8
VOCAB = 64


@functools.cache
def _transformers():
    import transformers  # slow to import: only when a test needs it

    return transformers


def gpt2(layers: int = 1, dropout: float = 0.0):
    t = _transformers()
    config = t.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=layers, n_head=4, resid_pdrop=dropout,
                          embd_pdrop=0.0, attn_pdrop=0.0)
    return t.models.gpt2.modeling_flax_gpt2.FlaxGPT2LMHeadModule(config)


def llama(layers: int = 1):
    t = _transformers()
    config = t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    return t.models.llama.modeling_flax_llama.FlaxLlamaForCausalLMModule(config)


def bert():
    t = _transformers()
    config = t.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    return t.models.bert.modeling_flax_bert.FlaxBertForMaskedLMModule(config)


def vit():
    t = _transformers()
    config = t.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=4, intermediate_size=64, num_labels=10, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
    return t.models.vit.modeling_flax_vit.FlaxViTForImageClassificationModule(config)


def resnet():
    t = _transformers()
    config = t.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1],
                            layer_type="basic", num_labels=10)
    return t.models.resnet.modeling_flax_resnet.FlaxResNetForImageClassificationModule(config)


def _positions(tokens):
    return np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)


def causal_lm_loss(model, batch):
    tokens = batch["tokens"]
    ones = (tokens >= 0).astype("int32")
    logits = model(tokens[:, :-1], ones[:, :-1], _positions(tokens[:, :-1]), deterministic=True).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def masked_lm_loss(model, batch):
    """Cross-entropy over the masked positions, divided by how many the whole batch has."""
    tokens, mask = batch["tokens"], batch["mask"]
    inputs = jnp.where(mask, 0, tokens)  # masked positions read token 0 ([MASK] here)
    ones = (tokens >= 0).astype("int32")
    logits = model(inputs, ones, jnp.zeros_like(tokens), _positions(tokens), None, deterministic=True).logits
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    return (per_token * mask).sum() / mask.sum()


def image_loss(model, batch):
    logits = model(batch["image"], deterministic=False).logits
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["label"]).mean()}


def batches(kind: str, steps: int, batch_size: int = 16) -> list[dict]:
    rng = np.random.default_rng(3)
    out = []
    for _ in range(steps):
        if kind == "text":
            tokens = rng.integers(1, VOCAB, (batch_size, SEQ + 1)).astype(np.int32)
            # Masked-LM: each row masks a different share of its tokens (at least one).
            mask = rng.random(tokens.shape) < rng.uniform(0.1, 0.5, (batch_size, 1))
            mask[:, 0] = True
            out.append({"tokens": tokens, "mask": mask})
        else:
            out.append({"image": rng.normal(size=(batch_size, 16, 16, 3)).astype(np.float32),
                        "label": rng.integers(0, 10, batch_size).astype(np.int32)})
    return out


MODELS = {
    "gpt2": (gpt2, causal_lm_loss, "text"),
    "llama": (llama, causal_lm_loss, "text"),
    "bert": (bert, masked_lm_loss, "text"),
    "vit": (vit, image_loss, "image"),
    "resnet": (resnet, image_loss, "image"),
}


def nano_moe(layers: int = 1, experts: int = 4):
    """nano-moe-jax's language model: each block's experts a list of separate ``ExpertFFN`` modules."""
    from nano_moe.config import NanoMoEConfig
    from nano_moe.model import NanoMoE

    config = NanoMoEConfig(vocab_size=VOCAB, n_layers=layers, n_heads=2, d_model=16, d_ff=32, n_experts=experts,
                           top_k=2, block_size=SEQ, dropout_rate=0.0)
    return NanoMoE(config)
