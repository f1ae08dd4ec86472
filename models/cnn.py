"""Convolutional networks for spatially partitioned training: a ResNet-style classifier and a 3-D U-Net.

Both are Flax linen modules built from `nn.Conv`, `nn.ConvTranspose`,
`nn.GroupNorm` and pooling. Activations carry logical axis names (`batch`,
`depth`, `height`, `width`, `channels`) mapped to mesh axes by a rules
table (models/sharding.py): `DATA_PARALLEL` splits the batch, `SPATIAL`
splits the images themselves (their height, or depth for volumes) over the
whole mesh, for inputs too large for one device. The partitioner then
exchanges halos between neighbouring devices for every convolution and
pooling window instead of gathering the split dim.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from .logical import Rules, constrain

# Logical axis -> mesh axes. The mesh is {"data": ..., "model": ...}.
DATA_PARALLEL: Rules = (("batch", ("data", "model")), ("depth", None), ("height", None), ("width", None),
                        ("channels", None))
SPATIAL: Rules = (("batch", None), ("depth", ("data", "model")), ("height", ("data", "model")), ("width", None),
                  ("channels", None))


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    widths: tuple[int, ...] = (16, 32)  # channels of each stage; stages after the first halve the resolution
    blocks: int = 1  # residual blocks (ResNet) or convolutions (U-Net) per stage
    classes: int = 10  # output classes (per image, or per voxel for the U-Net)
    groups: int = 4  # GroupNorm groups (must divide every width)
    learning_rate: float = 1e-2  # SGD with momentum 0.9


class ResBlock(nn.Module):
    """conv-norm-relu-conv-norm plus the (projected) input; strided when it changes resolution."""
    width: int
    stride: int
    cfg: CNNConfig
    rules: Rules

    @nn.compact
    def __call__(self, x_BHWC: jax.Array) -> jax.Array:
        names = ("batch", "height", "width", "channels")
        h = nn.Conv(self.width, (3, 3), (self.stride, self.stride))(x_BHWC)
        h = nn.relu(nn.GroupNorm(self.cfg.groups)(constrain(h, names, self.rules)))
        h = nn.GroupNorm(self.cfg.groups)(constrain(nn.Conv(self.width, (3, 3))(h), names, self.rules))
        if self.stride != 1 or x_BHWC.shape[-1] != self.width:
            x_BHWC = nn.Conv(self.width, (1, 1), (self.stride, self.stride))(x_BHWC)
        return constrain(nn.relu(h + x_BHWC), names, self.rules)


class ResNet(nn.Module):
    """A ResNet-style image classifier: 3x3 stem, residual stages, global average pooling, a linear head."""
    cfg: CNNConfig
    rules: Rules = DATA_PARALLEL

    @nn.compact
    def __call__(self, x_BHWC: jax.Array) -> jax.Array:
        names = ("batch", "height", "width", "channels")
        x = constrain(x_BHWC, names, self.rules)
        x = constrain(nn.relu(nn.Conv(self.cfg.widths[0], (3, 3))(x)), names, self.rules)
        for stage, width in enumerate(self.cfg.widths):
            for block in range(self.cfg.blocks):
                x = ResBlock(width, 2 if stage and not block else 1, self.cfg, self.rules)(x)
        return nn.Dense(self.cfg.classes)(jnp.mean(x, axis=(1, 2)))  # logits [B, classes]


class UNet3D(nn.Module):
    """A 3-D U-Net-style segmenter: conv stages with 2x2x2 max pooling down, transposed convs up, skip
    connections, per-voxel logits [B, D, H, W, classes]."""
    cfg: CNNConfig
    rules: Rules = DATA_PARALLEL

    @nn.compact
    def __call__(self, x_BDHWC: jax.Array) -> jax.Array:
        names = ("batch", "depth", "height", "width", "channels")

        def convs(x, width):
            for _ in range(self.cfg.blocks):
                x = nn.Conv(width, (3, 3, 3))(x)
                x = nn.relu(nn.GroupNorm(self.cfg.groups)(constrain(x, names, self.rules)))
            return x

        x = constrain(x_BDHWC, names, self.rules)
        skips = []
        for stage, width in enumerate(self.cfg.widths):
            if stage:
                x = nn.max_pool(x, (2, 2, 2), (2, 2, 2))
            x = convs(x, width)
            skips.append(x)
        for width, skip in zip(reversed(self.cfg.widths[:-1]), reversed(skips[:-1])):
            x = nn.ConvTranspose(width, (2, 2, 2), (2, 2, 2))(x)
            x = convs(jnp.concatenate([constrain(x, names, self.rules), skip], axis=-1), width)
        return constrain(nn.Conv(self.cfg.classes, (1, 1, 1))(x), names, self.rules)


def loss_fn(params, model: nn.Module, images: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy: labels [B] for the classifier, [B, D, H, W] for the segmenter."""
    logits = model.apply(params, images)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def optimizer(cfg: CNNConfig) -> optax.GradientTransformation:
    return optax.sgd(cfg.learning_rate, momentum=0.9)


def train_step(params, opt_state, images: jax.Array, labels: jax.Array, model: nn.Module, cfg: CNNConfig):
    """One SGD step: (params, opt_state, loss)."""
    loss, grads = jax.value_and_grad(loss_fn)(params, model, images, labels)
    updates, opt_state = optimizer(cfg).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def example_batch(key: jax.Array, shape: Sequence[int], classes: int, per_voxel: bool) -> tuple:
    """Random images of `shape` (channels last) and labels (per image, or per voxel)."""
    k1, k2 = jax.random.split(key)
    images = jax.random.normal(k1, tuple(shape), jnp.float32)
    labels = jax.random.randint(k2, tuple(shape[:-1]) if per_voxel else (shape[0],), 0, classes)
    return images, labels
