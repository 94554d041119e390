"""The model of the TensorFlow recipes (recipes/horovod, recipes/tf_mirrored): a small Keras next-token model,
and its FLOPs and peak for MFU.

Token embedding -> causal 1-D convolution over the last two tokens -> MLP -> logits. Two tokens of context are
what the synthetic task needs (harness.numpy_token_batch: arithmetic sequences, next = last + stride), so the
loss falls well below ln(vocab) as it learns. Horovod's Keras integration needs Keras 2: the images set
TF_USE_LEGACY_KERAS=1, so ``tf.keras`` is tf-keras.

Importing this module does not load TensorFlow (the recipes' --preflight answers in a second); it sets what
must be set before TensorFlow loads, and the functions below import it.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import harness

if TYPE_CHECKING:
    import tensorflow as tf

# Before TensorFlow loads: Keras 2 (tf-keras), which Horovod's TensorFlow integration needs, and no INFO
# lines from TensorFlow's C++ side (CPU features) in the training log. (TensorFlow 2.21 still logs
# "oneDNN custom operations are on" where the CPU has AVX512_VNNI/BF16 or AMX, at any level.)
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


@dataclass(frozen=True)
class TokenModelConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    d_hidden: int = 256

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TokenModelConfig":
        return cls(args.vocab_size, args.seq_len, args.d_model, args.d_hidden)


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The model's options, shared by the TensorFlow recipes (their parsers add them after their own)."""
    g = p.add_argument_group("model (recipes/keras_model.py)")
    g.add_argument("--d-model", type=int, default=64)
    g.add_argument("--d-hidden", type=int, default=256)
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto = mixed bfloat16 on GPU, float32 on CPU")


def build_model(cfg: TokenModelConfig, seed: int) -> tf.keras.Model:
    """The same weights for the same seed, in any process: ranks and the single-process reference agree."""
    import tensorflow as tf

    init = lambda offset: tf.keras.initializers.GlorotUniform(seed=seed + offset)  # noqa: E731
    tokens = tf.keras.Input(shape=(cfg.seq_len,), dtype="int32", name="tokens")
    x = tf.keras.layers.Embedding(cfg.vocab_size, cfg.d_model,
                                  embeddings_initializer=tf.keras.initializers.RandomNormal(stddev=0.1, seed=seed))(tokens)
    x = tf.keras.layers.Conv1D(cfg.d_hidden, kernel_size=2, padding="causal", activation="gelu",
                               kernel_initializer=init(1))(x)
    x = tf.keras.layers.Dense(cfg.d_hidden, activation="gelu", kernel_initializer=init(2))(x)
    # float32 logits also under mixed precision: the softmax cross-entropy stays accurate.
    logits = tf.keras.layers.Dense(cfg.vocab_size, kernel_initializer=init(3), dtype="float32")(x)
    return tf.keras.Model(tokens, logits, name="token_model")


def optimizer(name: str, lr: float) -> tf.keras.optimizers.Optimizer:
    """--optimizer (harness.add_optimizer_option): adamw is Keras' Adam (no weight decay), sgd plain SGD."""
    import tensorflow as tf

    return tf.keras.optimizers.SGD(learning_rate=lr) if name == "sgd" else tf.keras.optimizers.Adam(learning_rate=lr)


def restore(checkpoint, model: tf.keras.Model, path: str, weights_only: bool = False) -> None:
    """Read a checkpoint the recipes wrote (tf.train.Checkpoint of model and optimizer) back, all of it.
    ``weights_only`` (a test's negative control, resume-fresh-optimizer): the model alone, a fresh optimizer."""
    import tensorflow as tf

    if weights_only:
        tf.train.Checkpoint(model=model).read(path).expect_partial()
    else:
        checkpoint.read(path).assert_consumed()


def flops_per_token(model: tf.keras.Model) -> float:
    """Training FLOPs per token: 6 x the weights of the matmul layers (the embedding is a lookup)."""
    import tensorflow as tf

    matmul_params = sum(int(tf.size(w)) for layer in model.layers if not isinstance(layer, tf.keras.layers.Embedding)
                        for w in layer.trainable_weights)
    return 6.0 * matmul_params


def loss_per_token(targets: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Cross-entropy of every position, shape (batch, seq_len)."""
    import tensorflow as tf

    return tf.keras.losses.sparse_categorical_crossentropy(targets, logits, from_logits=True)


def peak_flops(gpu_name: str | None, dtype_name: str, override_tflops: float | None) -> tuple[float, str]:
    """The per-device peak that MFU divides by: data sheet on a GPU, a matmul measured now on a CPU."""
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    if gpu_name:
        return harness.gpu_peak_flops(gpu_name, dtype_name)
    import tensorflow as tf

    size, seconds = 1024, 0.3
    a, b = tf.random.normal((size, size)), tf.random.normal((size, size))
    tf.linalg.matmul(a, b).numpy()  # warm-up
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        tf.linalg.matmul(a, b).numpy()
        count += 1
    threads = tf.config.threading.get_intra_op_parallelism_threads() or "default"
    return 2.0 * size**3 * count / elapsed, f"measured: {size}x{size} float32 tf.matmul, intra-op threads {threads}"

