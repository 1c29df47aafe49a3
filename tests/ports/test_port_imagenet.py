"""Port of Flax's ImageNet example's ResNet (v1.5): a 7x7 stem with batch norm and max
pooling, stages of basic or bottleneck residual blocks built from ``functools.partial``
conv and norm constructors (the last norm of a block starts at zero scale, projections on
shape change), global average pooling and a dense head.  ``ConvLocal`` replaces ``Conv``
in the example's ``_ResNet1Local``.

Small config: 16x16 images, 4 filters, stages (1, 1) for basic blocks (the second stage
has the strided projection), one stage otherwise.  The example's ``BatchNorm`` takes
``axis_name='batch'`` for its ``pmap``; here the batch is not mapped, so the port leaves
the axis name out.
"""
import functools

import jax.numpy as jnp
import optax
import pytest
from port_checks import KEY, Port, check_apply, check_init, check_train, normal, perturb


def build(nn):
    class ResNetBlock(nn.Module):
        filters: int
        conv: nn.Module
        norm: nn.Module
        act: object
        strides: tuple = (1, 1)

        @nn.compact
        def __call__(self, x):
            residual = x
            y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
            y = self.conv(self.filters, (3, 3))(y)
            y = self.norm(scale_init=nn.initializers.zeros_init())(y)
            if residual.shape != y.shape:
                residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(x)
                residual = self.norm(name="norm_proj")(residual)
            return self.act(residual + y)

    class BottleneckResNetBlock(nn.Module):
        filters: int
        conv: nn.Module
        norm: nn.Module
        act: object
        strides: tuple = (1, 1)

        @nn.compact
        def __call__(self, x):
            residual = x
            y = self.act(self.norm()(self.conv(self.filters, (1, 1))(x)))
            y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
            y = self.conv(self.filters * 4, (1, 1))(y)
            y = self.norm(scale_init=nn.initializers.zeros_init())(y)
            if residual.shape != y.shape:
                residual = self.conv(self.filters * 4, (1, 1), self.strides,
                                     name="conv_proj")(x)
                residual = self.norm(name="norm_proj")(residual)
            return self.act(residual + y)

    class ResNet(nn.Module):
        stage_sizes: tuple
        block_cls: nn.Module
        num_classes: int = 5
        num_filters: int = 4
        act: object = nn.relu
        conv: nn.Module = nn.Conv

        @nn.compact
        def __call__(self, x, train: bool = True):
            conv = functools.partial(self.conv, use_bias=False, dtype=jnp.float32)
            norm = functools.partial(nn.BatchNorm, use_running_average=not train,
                                     momentum=0.9, epsilon=1e-5, dtype=jnp.float32)
            x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)],
                     name="conv_init")(x)
            x = nn.relu(norm(name="bn_init")(x))
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
            for i, size in enumerate(self.stage_sizes):
                for j in range(size):
                    strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                    x = self.block_cls(self.num_filters * 2**i, strides=strides, conv=conv,
                                       norm=norm, act=self.act)(x)
            x = jnp.mean(x, axis=(1, 2))
            return nn.Dense(self.num_classes, dtype=jnp.float32)(x)

    return {"basic": functools.partial(ResNet, stage_sizes=(1, 1), block_cls=ResNetBlock),
            "bottleneck": functools.partial(ResNet, stage_sizes=(1,),
                                            block_cls=BottleneckResNetBlock),
            "local": functools.partial(ResNet, stage_sizes=(1,), block_cls=ResNetBlock,
                                       conv=nn.ConvLocal)}


IMAGES = normal((2, 16, 16, 3))
LABELS = jnp.asarray([1, 4], jnp.int32)


def _loss(result):
    logits, _ = result
    return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean()


@pytest.mark.parametrize("kind", ["basic", "bottleneck", "local"])
def test_resnet_init_train_batch_stats_and_grads_equal_linen(kind):
    port = Port(lambda nn: build(nn)[kind])
    variables = perturb(check_init(port, KEY, IMAGES))
    if kind == "basic":  # eval with running averages: the same BatchNorm path in each kind
        check_apply(port, variables, IMAGES, train=False)
    check_train(port, variables, _loss, IMAGES, train=True, mutable=["batch_stats"])
