"""Port of Flax's ogbg-molpcba example's GraphNet: ``jraph`` graph networks whose edge, node
and global updates are Linen MLPs (dense, ReLU, dropout) over concatenated features, with
embedding and decoding by ``jraph.GraphMapFeatures`` of dense layers, skip connections and
layer norms between message-passing steps.  The Linen modules are made in the compact
method and called by jraph's functions, as in the example.

Small config: 2 graphs (3 and 2 nodes, 4 and 2 edges), latent size 4, one MLP layer, two
message-passing steps, 3 outputs.  Needs ``jraph`` (installed from PyPI as the example
does; skipped where it is missing).
"""
import jax.numpy as jnp
import optax
import pytest
from port_checks import DROPOUT, KEY, Port, check_apply, check_init, check_train, normal, perturb

jraph = pytest.importorskip("jraph")


def build(nn):
    class MLP(nn.Module):
        feature_sizes: tuple
        dropout_rate: float = 0.0
        deterministic: bool = True

        @nn.compact
        def __call__(self, x):
            for size in self.feature_sizes:
                x = nn.relu(nn.Dense(size)(x))
                x = nn.Dropout(self.dropout_rate, deterministic=self.deterministic)(x)
            return x

    class GraphNet(nn.Module):
        latent_size: int = 4
        num_mlp_layers: int = 1
        message_passing_steps: int = 2
        output_globals_size: int = 3
        dropout_rate: float = 0.2
        deterministic: bool = True

        @nn.compact
        def __call__(self, graphs):
            graphs = jraph.GraphMapFeatures(
                embed_node_fn=nn.Dense(self.latent_size),
                embed_edge_fn=nn.Dense(self.latent_size),
                embed_global_fn=nn.Dense(self.latent_size))(graphs)

            def mlp():
                return jraph.concatenated_args(
                    MLP((self.latent_size,) * self.num_mlp_layers, self.dropout_rate,
                        self.deterministic))

            for _ in range(self.message_passing_steps):
                net = jraph.GraphNetwork(update_edge_fn=mlp(), update_node_fn=mlp(),
                                         update_global_fn=mlp())
                updated = net(graphs)
                graphs = graphs._replace(nodes=updated.nodes + graphs.nodes,
                                         edges=updated.edges + graphs.edges,
                                         globals=updated.globals + graphs.globals)
                graphs = graphs._replace(nodes=nn.LayerNorm()(graphs.nodes),
                                         edges=nn.LayerNorm()(graphs.edges),
                                         globals=nn.LayerNorm()(graphs.globals))
            return jraph.GraphMapFeatures(
                embed_global_fn=nn.Dense(self.output_globals_size))(graphs)

    return GraphNet


GRAPHS = jraph.GraphsTuple(
    nodes=normal((5, 4)), edges=normal((6, 3), seed=1), globals=normal((2, 2), seed=2),
    senders=jnp.asarray([0, 1, 2, 0, 3, 4], jnp.int32),
    receivers=jnp.asarray([1, 2, 0, 2, 4, 3], jnp.int32),
    n_node=jnp.asarray([3, 2], jnp.int32), n_edge=jnp.asarray([4, 2], jnp.int32))
LABELS = jnp.asarray([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]], jnp.float32)


def _loss(graphs):
    return optax.sigmoid_binary_cross_entropy(graphs.globals, LABELS).mean()


def test_graphnet_init_eval_train_and_grads_equal_linen():
    variables = perturb(check_init(Port(build), KEY, GRAPHS))
    check_apply(Port(build), variables, GRAPHS)
    check_train(Port(build, deterministic=False), variables, _loss, GRAPHS, rngs=DROPOUT)
