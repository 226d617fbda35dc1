"""The few things that differ between the two tested JAX stacks, read the same way on both."""

import jax
import numpy as np
import optax
import pytest

import parallax as px
from parallax._compat import replica_group_size
from parallax.inspect import collective_bytes
from tests.models import MLP, batches, classifier_loss

pytestmark = pytest.mark.core

# Lines as the two stacks print them (abridged from real compiled steps on 8 devices).
JAXLIB_010 = [
    ("%rs = f32[64,32]{0,1} reduce-scatter(%c), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, "
     "use_global_device_ids=true, dimensions={1}", 8),
    ("%ag = f32[256]{0} all-gather(%p), channel_id=1, replica_groups={{0,2},{1,3},{4,6},{5,7}}, dimensions={0}", 2),
    ("%ar = f32[10]{0} all-reduce(%x), channel_id=2, replica_groups=[4,2]<=[8], use_global_device_ids=true", 2),
    ("%ar = f32[10]{0} all-reduce(%x), channel_id=3, replica_groups=[2,4]<=[2,2,2]T(0,2,1), to_apply=%add", 4),
]
JAXLIB_012 = [
    ("%reduce_scatter.15 = f32[64,32]{0,1} reduce-scatter(%wrapped_copy.2), channel_id=1, "
     "replica_groups=mesh['fsdp'=8] {'fsdp'}, use_global_device_ids=true, dimensions={1}", 8),
    ("%all-reduce = (f32[10]{0}, f32[]) all-reduce(%a, %b), channel_id=1, "
     "replica_groups=mesh['data'=2,'fsdp'=2,'tensor'=2] {'data','fsdp'}, use_global_device_ids=true", 4),
    ("%rs = f32[8,4]{1,0} reduce-scatter(%d), replica_groups=mesh['data'=2,'fsdp'=2,'tensor'=2] {'fsdp'}", 2),
]


@pytest.mark.parametrize("line, size", JAXLIB_010 + JAXLIB_012)
def test_replica_group_size_reads_every_format(line, size):
    assert replica_group_size(line) == size


def test_reduce_scatter_bytes_count_the_whole_array_in_both_formats():
    old, new = JAXLIB_010[0][0], JAXLIB_012[0][0]
    assert (collective_bytes(old)["reduce-scatter"].bytes == collective_bytes(new)["reduce-scatter"].bytes
            == 64 * 256 * 4)


def test_compiled_fsdp_step_scatters_what_it_gathers():
    """On whichever stack runs this: FSDP's gradient reduce-scatter moves as much as its gather."""
    strategy = px.FSDP(min_weight_size=256, split="largest")
    batch = batches("mlp", 1, batch_size=16)[0]
    state = px.init_state(MLP(), optax.sgd(0.1), batch, strategy=strategy, loss_fn=classifier_loss)
    step = px.make_train_step(classifier_loss, strategy, compile="shard_map")
    stats = collective_bytes(step.lower(state, batch).compile().as_text())
    gathered = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state.params)
                   if any(x.sharding.spec))
    assert stats["all-gather"].bytes == gathered
    assert stats["reduce-scatter"].bytes == gathered


def test_scan_counts_on_this_stack():
    import jax.numpy as jnp

    from parallax._compat import scan_counts

    def f(w, x, k):
        def body(carry, wi):
            return (carry[0] @ wi * k, carry[1] + 1), carry[0].sum()

        return jax.lax.scan(body, (x, 0.0), w)[0][0].sum()

    jaxpr = jax.make_jaxpr(f)(jnp.ones((3, 4, 4)), jnp.ones((2, 4)), jnp.ones(()))
    (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert scan_counts(scan.params) == (1, 2)  # k closed over; (x, count) carried


def test_a_loop_counts_its_collectives_and_matmuls_once_per_iteration():
    """XLA's cost_analysis counts a while loop's body once; collective_bytes and the cost model
    count it per iteration (the trip count XLA proved), on whichever stack runs this."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from parallax._compat import shard_map
    from parallax.inspect import loop_dot_flops

    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))

    def layer(h, w):
        h = shard_map(lambda x: jax.lax.ppermute(x, "d", [(i, (i + 1) % 4) for i in range(4)]), mesh=mesh,
                      in_specs=P("d"), out_specs=P("d"), manual_axes={"d"})(h @ w)
        return h, None

    w, x = jnp.ones((5, 16, 16)), jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("d")))
    text = jax.jit(lambda w, x: jax.lax.scan(layer, x, w)[0]).lower(w, x).compile().as_text()
    permutes = collective_bytes(text)["collective-permute"]
    assert permutes.count == 5 and permutes.bytes == 5 * 2 * 16 * 4, permutes  # each device's [2, 16] rows
    assert loop_dot_flops(text) == 4 * 2 * 2 * 16 * 16  # the 4 iterations after the first, [2,16] @ [16,16] each
