"""BERT with its pre-training heads (masked LM + next-sentence prediction) in Flax, for
shape-level studies: parameter shapes by `jax.eval_shape` and the order in which the
backward pass produces their gradients, without allocating the model.

Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for Language
Understanding" (NAACL 2019); the layout and names of the variables follow Google's and
NVIDIA's pre-training code (post-LayerNorm encoder, exact GELU, LayerNorm eps 1e-12,
masked-LM decoder tied to the word embedding with its own output bias, a tanh pooler
over the first token feeding the next-sentence classifier). `BERT_LARGE` is the model
of Herring (Thangakrishnan et al., SC 2020, section III) and Table II there: 24 layers,
hidden 1024, 16 heads, 398 trainable variables, fp16 gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from shoal.comms.order import gradient_order


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """BERT hyper-parameters; the defaults are BERT-large (uncased vocabulary, unpadded)."""

    vocab_size: int = 30522
    hidden_size: int = 1024
    num_layers: int = 24
    num_heads: int = 16
    intermediate_size: int = 4096
    max_positions: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    # Parameters (and thus gradients) and activations in fp16, as in the paper's runs.
    param_dtype: Any = jnp.float16
    dtype: Any = jnp.float16

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


BERT_LARGE = BertConfig()

_init = nn.initializers.truncated_normal(0.02)


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate (hidden, hidden) query, key and value
    kernels, as in the reference checkpoints (Herring's Table II lists them)."""

    config: BertConfig

    @nn.compact
    def __call__(self, x, mask):
        c = self.config
        dense = functools.partial(
            nn.Dense, c.hidden_size, dtype=c.dtype, param_dtype=c.param_dtype, kernel_init=_init
        )
        b, s, _ = x.shape
        q, k, v = (
            dense(name=n)(x).reshape(b, s, c.num_heads, c.head_dim)
            for n in ("query", "key", "value")
        )
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        logits = logits / math.sqrt(c.head_dim)
        logits = jnp.where(mask[:, None, None, :], logits, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(logits, axis=-1).astype(c.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, c.hidden_size)


class Layer(nn.Module):
    """One post-LayerNorm encoder layer: 16 variables."""

    config: BertConfig

    @nn.compact
    def __call__(self, x, mask):
        c = self.config
        dense = functools.partial(
            nn.Dense, dtype=c.dtype, param_dtype=c.param_dtype, kernel_init=_init
        )
        norm = functools.partial(
            nn.LayerNorm, epsilon=c.layer_norm_eps, dtype=c.dtype, param_dtype=c.param_dtype
        )
        a = SelfAttention(c, name="attention")(x, mask)
        x = norm(name="attention_layer_norm")(x + dense(c.hidden_size, name="attention_output")(a))
        h = nn.gelu(dense(c.intermediate_size, name="intermediate")(x), approximate=False)
        return norm(name="output_layer_norm")(x + dense(c.hidden_size, name="output")(h))


class BertForPreTraining(nn.Module):
    """BERT with the masked-LM and next-sentence heads. Returns ``(mlm_logits,
    nsp_logits)``: masked-LM logits ``[batch, predictions, vocab]`` at
    ``masked_positions`` only (as Google's and NVIDIA's pre-training code does) and
    next-sentence logits ``[batch, 2]``."""

    config: BertConfig

    @nn.compact
    def __call__(self, input_ids, token_type_ids, attention_mask, masked_positions):
        c = self.config
        embed = functools.partial(
            nn.Embed, features=c.hidden_size, dtype=c.dtype, param_dtype=c.param_dtype,
            embedding_init=_init,
        )  # fmt: skip
        dense = functools.partial(
            nn.Dense, dtype=c.dtype, param_dtype=c.param_dtype, kernel_init=_init
        )
        norm = functools.partial(
            nn.LayerNorm, epsilon=c.layer_norm_eps, dtype=c.dtype, param_dtype=c.param_dtype
        )
        words = embed(c.vocab_size, name="word_embeddings")
        positions = jnp.arange(input_ids.shape[1])[None, :]
        x = (
            words(input_ids)
            + embed(c.max_positions, name="position_embeddings")(positions)
            + embed(c.type_vocab_size, name="token_type_embeddings")(token_type_ids)
        )
        x = norm(name="embeddings_layer_norm")(x)
        mask = attention_mask.astype(bool)
        for i in range(c.num_layers):
            x = Layer(c, name=f"layer_{i}")(x, mask)

        pooled = jnp.tanh(dense(c.hidden_size, name="pooler")(x[:, 0]))
        nsp_logits = dense(2, name="nsp_classifier")(pooled)

        h = jnp.take_along_axis(x, masked_positions[..., None], axis=1)
        h = nn.gelu(dense(c.hidden_size, name="mlm_transform")(h), approximate=False)
        h = norm(name="mlm_layer_norm")(h)
        bias = self.param("mlm_output_bias", nn.initializers.zeros, (c.vocab_size,),
                          c.param_dtype)  # fmt: skip
        # The decoder is the word embedding, transposed (tied weights).
        mlm_logits = words.attend(h) + bias
        return mlm_logits, nsp_logits


def batch_shapes(
    config: BertConfig, batch_size: int = 1, seq_len: int = 128, max_predictions: int = 20
) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of one pre-training batch (phase-1 defaults: 128 tokens, 20 masked)."""
    if seq_len > config.max_positions:
        raise ValueError(f"seq_len={seq_len} exceeds max_positions={config.max_positions}")
    i32, f32 = jnp.int32, jnp.float32
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), i32)
    preds = jax.ShapeDtypeStruct((batch_size, max_predictions), i32)
    return {
        "input_ids": tokens,
        "token_type_ids": tokens,
        "attention_mask": tokens,
        "masked_lm_positions": preds,
        "masked_lm_ids": preds,
        "masked_lm_weights": jax.ShapeDtypeStruct((batch_size, max_predictions), f32),
        "next_sentence_labels": jax.ShapeDtypeStruct((batch_size,), i32),
    }


def _forward(model: BertForPreTraining, params, batch):
    # flax's LayerNorm promotes float16 with float32 implicitly: standard promotion here,
    # whatever the caller's mode (the tests run strict).
    with jax.numpy_dtype_promotion("standard"):
        return _apply(model, params, batch)


def _apply(model: BertForPreTraining, params, batch):
    return model.apply(
        {"params": params},
        batch["input_ids"],
        batch["token_type_ids"],
        batch["attention_mask"],
        batch["masked_lm_positions"],
    )


def param_shapes(config: BertConfig = BERT_LARGE) -> dict[str, Any]:
    """The parameter pytree as `jax.ShapeDtypeStruct` leaves, by `jax.eval_shape`
    (nothing is allocated)."""
    model = BertForPreTraining(config)
    batch = batch_shapes(config, seq_len=min(8, config.max_positions), max_predictions=2)
    init = lambda key, b: model.init(
        key, b["input_ids"], b["token_type_ids"], b["attention_mask"], b["masked_lm_positions"]
    )
    with jax.numpy_dtype_promotion("standard"):  # as in _forward
        return jax.eval_shape(init, jax.ShapeDtypeStruct((2,), jnp.uint32), batch)["params"]


def pretraining_loss(config: BertConfig):
    """``loss(params, batch)``: masked-LM cross-entropy (mean over the masked positions,
    weighted by ``masked_lm_weights``) plus next-sentence cross-entropy, in fp32."""
    model = BertForPreTraining(config)

    def loss(params, batch):
        mlm_logits, nsp_logits = _forward(model, params, batch)
        mlm = -jnp.take_along_axis(
            jax.nn.log_softmax(mlm_logits.astype(jnp.float32)),
            batch["masked_lm_ids"][..., None],
            axis=-1,
        )[..., 0]
        w = batch["masked_lm_weights"]
        mlm = jnp.sum(mlm * w) / jnp.maximum(jnp.sum(w), 1e-5)
        nsp = -jnp.take_along_axis(
            jax.nn.log_softmax(nsp_logits.astype(jnp.float32)),
            batch["next_sentence_labels"][:, None],
            axis=-1,
        )
        return mlm + jnp.mean(nsp)

    return loss


def production_order(config: BertConfig = BERT_LARGE, **batch_kwargs) -> tuple[int, ...]:
    """Leaf indices (``jax.tree.leaves`` of `param_shapes`) in the order the backward pass
    of `pretraining_loss` produces their gradients (`shoal.comms.gradient_order`
    on shapes only)."""
    return gradient_order(
        pretraining_loss(config), param_shapes(config), batch_shapes(config, **batch_kwargs)
    )


def leaf_names(tree: Any) -> tuple[str, ...]:
    """``"layer_0/attention/query/kernel"``-style names of the leaves, in leaf order."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return tuple("/".join(str(getattr(k, "key", k)) for k in path) for path, _ in paths)


def num_parameters(tree: Any) -> int:
    """Elements over all leaves."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
