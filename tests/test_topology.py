"""Meshes laid out by host: the axes that move the most stay inside one (parallax.sharding.topology).

Two hosts of four devices are simulated here with ``px.Topology`` (one process); the launch in
``tests/test_multiprocess.py`` checks the same layouts over two real processes and trains them.
"""

from __future__ import annotations

import itertools
import re

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import parallax as px
from parallax import inspect
from parallax.pricing import choice as pricing_choice
from parallax.pricing.cost import DeviceSpeeds, calibrate, estimate
from parallax.sharding.mesh import build_mesh
from parallax.sharding.topology import crossing_axes, hosts_of
from parallax.state.candidate import abstract_batch
from parallax.state.search import resolve
from tests.models import MLP, StackedMLP, batches, classifier_loss

pytestmark = pytest.mark.core

TWO_HOSTS = px.Topology(hosts=2, devices_per_host=4)
PARTS = {"dp": lambda n: px.DataParallel(n), "fsdp": lambda n: px.FSDP(n, min_weight_size=0, split="largest"),
         "tp": lambda n: px.TensorParallel(n)}
INSIDE_FIRST = ("tp", "fsdp", "dp")  # what each axis moves per step, most first
AXIS = {"dp": "data", "fsdp": "fsdp", "tp": "tensor"}

# Every 2-axis combination of DP, FSDP and TP, sizes (2, 4) and (4, 2), in either order: 12 meshes.
COMBINATIONS = [(first, second, sizes) for pair in itertools.combinations(PARTS, 2)
                for first, second in (pair, pair[::-1]) for sizes in ((2, 4), (4, 2))]


@pytest.mark.parametrize("first, second, sizes", COMBINATIONS, ids=[f"{a}{m}+{b}{n}" for a, b, (m, n) in COMBINATIONS])
def test_the_kinds_order_keeps_the_busier_kind_of_axis_inside_a_host_in_any_combine_order(first, second, sizes):
    strategy = px.combine(PARTS[first](sizes[0]), PARTS[second](sizes[1]))
    mesh = strategy.make_mesh(topology=TWO_HOSTS)
    assert mesh.axis_names == (AXIS[first], AXIS[second]) and tuple(mesh.shape.values()) == sizes  # the user's order
    inner = min((first, second), key=INSIDE_FIRST.index)
    outer = ({first, second} - {inner}).pop()
    assert crossing_axes(mesh, TWO_HOSTS) == (AXIS[outer],)
    # Where the inner axis fits in a host (size 4, or 2 beside 2 of the outer), each of its groups is one host's.
    hosts = hosts_of(list(mesh.devices.flat), TWO_HOSTS).reshape(mesh.devices.shape)
    groups = np.moveaxis(hosts, mesh.axis_names.index(AXIS[inner]), -1).reshape(-1, mesh.shape[AXIS[inner]])
    assert all(len(set(row)) == 1 for row in groups.tolist())
    assert strategy.host_crossing(mesh, TWO_HOSTS) is None  # parallax's own layout: nothing to warn about


def test_one_host_keeps_the_mesh_it_always_had():
    strategy = px.combine(px.TensorParallel(4), px.FSDP(2))
    assert np.array_equal(strategy.make_mesh().devices, strategy.make_mesh(topology=px.Topology(1, 8)).devices)
    assert [d.id for d in strategy.make_mesh().devices.flat] == list(range(8))
    assert crossing_axes(strategy.make_mesh()) == () and strategy.host_crossing(strategy.make_mesh()) is None


def test_a_mesh_laid_out_over_hosts_trains_like_one_device():
    strategy = px.combine(px.TensorParallel(4), px.FSDP(2, min_weight_size=0, split="largest"))
    mesh = strategy.make_mesh(topology=TWO_HOSTS)
    assert [d.id for d in mesh.devices.flat] != list(range(8))  # the devices are not in the combine order's places
    for tx in (optax.sgd(0.1), optax.adamw(3e-3, weight_decay=0.1)):
        px.testing.assert_equivalent(MLP(), tx, classifier_loss, batches("mlp", 3), strategy, mesh=mesh, compile="jit")


def test_a_user_mesh_whose_tensor_axis_spans_hosts_is_named_with_the_layout_that_would_not():
    strategy = px.combine(px.TensorParallel(4), px.FSDP(2))
    in_order = jax.make_mesh((4, 2), ("tensor", "fsdp"))  # each tensor group: devices 0, 2, 4, 6 (both hosts)
    message = strategy.host_crossing(in_order, TWO_HOSTS)
    assert message.startswith("The mesh's axis 'tensor' (size 4) spans hosts") and "lets 'fsdp' cross" in message
    assert "leave mesh= out" in message and "strategy.make_mesh(devices)" in message
    # Data parallelism across the hosts is what parallax would do too: nothing to say.
    data = px.combine(px.DataParallel(2), px.TensorParallel(4))
    assert data.host_crossing(jax.make_mesh((2, 4), ("data", "tensor")), TWO_HOSTS) is None


_LISTED = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)+)\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "pred": 1}


def _groups(line: str, devices: int) -> list[list[int]]:
    """The device groups of one collective, read here independently of parallax's reader."""
    listed, iota = _LISTED.search(line), _IOTA.search(line)
    if listed:
        return [[int(v) for v in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", listed.group(1))]
    if iota:
        ids = np.arange(devices).reshape([int(v) for v in iota.group(3).split(",")])
        if iota.group(4):
            ids = ids.transpose([int(v) for v in iota.group(4).split(",")])
        return ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()
    by_mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                        r"\s*\{([^}]*)\}", line)
    if by_mesh:  # mesh['axis_0'=4,'axis_1'=2] {'axis_1'}: the ids of the mesh's positions, grouped over those axes;
        # with device_ids=([4,2]T(1,0)), the mesh's positions hold those ids (an iota, transposed)
        axes = re.findall(r"'([^']+)'=(\d+)", by_mesh.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        over = [names.index(a) for a in re.findall(r"'([^']+)'", by_mesh.group(4))]
        rest = [i for i in range(len(names)) if i not in over]
        ids = np.arange(devices)
        if by_mesh.group(2):
            ids = ids.reshape([int(v) for v in by_mesh.group(2).split(",")])
            if by_mesh.group(3):
                ids = ids.transpose([int(v) for v in by_mesh.group(3).split(",")])
        ids = ids.reshape(sizes).transpose(rest + over)
        return ids.reshape(-1, int(np.prod([sizes[i] for i in over]))).tolist()
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if pairs:
        return [[int(v) for v in p.split(",")] for p in re.findall(r"(\d+,\d+)", pairs.group(1))]
    return [list(range(devices))]


def _moved(text: str, mesh) -> dict[str, int]:
    """Collective bytes per device of a compiled step, inside a host and across hosts: each
    collective's groups read from the text, mapped to hosts by the mesh's devices (0-3: host 0)."""
    host = [0 if device.id < 4 else 1 for device in mesh.devices.flat]
    moved = {"inside": 0, "across": 0}
    for line in text.splitlines():
        op = re.search(r"= (.*?) (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(-start)?\(", line)
        if not op:
            continue
        sizes = [np.prod([int(d) for d in dims.split(",") if d], dtype=int) * _BYTES[dtype]
                 for dtype, dims in re.findall(r"\b(f32|s32|u32|bf16|pred)\[([\d,]*)\]", op.group(1))]
        groups = _groups(line, 8)
        size = sum(sizes[len(sizes) // 2:]) if op.group(3) and op.group(2) == "all-gather" else sum(sizes)
        if op.group(2) == "reduce-scatter":
            size *= len(groups[0])
        moved["across" if any(len({host[i] for i in g}) > 1 for g in groups) else "inside"] += int(size)
    return moved


@pytest.mark.wide("12 meshes planned and each compiled on both of its layouts over the hosts (21 s cold)")
@pytest.mark.budget(45, "12 meshes planned, and each compiled here on both of its layouts over the hosts")
def test_the_plan_lays_each_pair_out_with_the_fewest_bytes_across_hosts_as_the_compiled_steps_move_them():
    batch, tx = batches("mlp", 1)[0], optax.adamw(1e-3)
    strategies = [px.combine(PARTS[a](m), PARTS[b](n)) for a, b, (m, n) in COMBINATIONS]
    report = px.plan(MLP(), tx, batch, loss_fn=classifier_loss, strategies=strategies, topology=TWO_HOSTS,
                     compile="jit")
    assert "in host" in str(report) and "across" in str(report)
    chosen = set()
    for strategy, row in zip(strategies, report.rows):
        links = row["links"]
        assert links["hosts"] == 2 and links["inside"] + links["across"] == row["collective_bytes"], row
        # Both layouts of the two axes over the hosts, each compiled here on its own devices.
        axes, layouts = [(name, size) for name, size in strategy.mesh_axes()], {}
        for order in (strategy.inside_first(), strategy.inside_first()[::-1]):
            mesh = build_mesh(axes, jax.devices(), order, TWO_HOSTS)
            plan = px.plan_state(MLP(), tx, batch, strategy=strategy, loss_fn=classifier_loss, mesh=mesh)
            step = px.make_train_step(classifier_loss, strategy, compile="jit")
            text = step.lower(plan.abstract_arrays(), abstract_batch(
                batch, NamedSharding(mesh, strategy.batch_spec()))).compile().as_text()
            layouts[order] = (_moved(text, mesh), crossing_axes(mesh, TWO_HOSTS))
        best = min(layouts, key=lambda order: layouts[order][0]["across"])  # ties: the kinds' order, tried first
        assert tuple(links["inside_first"]) == best, (row["strategy"], layouts, links)
        assert {"inside": links["inside"], "across": links["across"]} == layouts[best][0], (layouts, links)
        assert tuple(links["crossing"]) == layouts[best][1]
        chosen.add(best == strategy.inside_first())
    assert chosen == {True, False}  # the measured bytes overturn the kinds' order on some of these meshes


def test_given_bandwidths_the_plan_prices_each_layout_by_the_seconds_its_bytes_take_on_the_two_links():
    batch = batches("mlp", 1)[0]
    strategy = px.combine(px.DataParallel(2), px.TensorParallel(4))
    # Equal links: the layout moving the fewest bytes in all is any; a slow link between hosts: the fewest across.
    fast_across = px.Topology(2, 4, host_bandwidth=1e9, cross_host_bandwidth=1e12)
    slow_across = px.Topology(2, 4, host_bandwidth=1e12, cross_host_bandwidth=1e9)
    rows = {name: px.plan(MLP(), optax.sgd(0.1), batch, loss_fn=classifier_loss, strategies=[strategy],
                          topology=topology, compile="jit").rows[0]["links"]
            for name, topology in (("fast", fast_across), ("slow", slow_across))}
    assert rows["slow"]["across"] < rows["fast"]["across"]  # a slow link between hosts: fewer bytes cross it
    for name, topology in (("fast", fast_across), ("slow", slow_across)):
        links = rows[name]
        assert links["seconds"] == pytest.approx(links["inside"] / topology.host_bandwidth
                                                 + links["across"] / topology.cross_host_bandwidth)
    report = px.plan(MLP(), optax.sgd(0.1), batch, loss_fn=classifier_loss, strategies=[strategy], topology=slow_across,
                     compile="jit")
    assert "At the topology's bandwidths, the collectives' bytes take per step: DataParallel(data=2)" in str(report)


def test_a_topology_that_does_not_fit_is_refused_by_name():
    with pytest.raises(ValueError, match=r"Topology\(hosts=0\): give a positive int"):
        px.Topology(hosts=0, devices_per_host=4)
    with pytest.raises(ValueError, match=r"describes 16 devices but 8 were given; give hosts × devices_per_host = 8"):
        px.FSDP().make_mesh(topology=px.Topology(hosts=2, devices_per_host=8))
    with pytest.raises(ValueError, match=r"devices=16 but Topology\(hosts=2, devices_per_host=4.*has 8 devices"):
        px.plan(MLP(), "sgd", batches("mlp", 1)[0], loss_fn=classifier_loss, strategies=["dp"], devices=16,
                topology=TWO_HOSTS)


# Eight simulated devices on this machine's 2 cores, calibrated with nothing else running. The picks of auto over hosts
# below are the cost model's answer to the topology at these speeds: calibrated while another suite shares the
# cores, the collectives' fixed costs (which a pipeline pays per microbatch) can double and overturn a close pick.
QUIET_SPEEDS = DeviceSpeeds(
    "reference", seconds_per_flop=4.23e-11, seconds_per_byte=1.58e-09, seconds_per_layout_byte=1.89e-10,
    collectives={"all-gather": (5.40e-04, 5.00e-10), "all-reduce": (4.28e-04, 1.24e-09),
                 "reduce-scatter": (4.04e-04, 8.64e-10), "all-to-all": (6.41e-04, 2.80e-09),
                 "collective-permute": (4.86e-04, 6.32e-10)}, overhead=2.55e-04)


@pytest.fixture
def quiet_speeds(monkeypatch):
    """auto prices its candidates at :data:`QUIET_SPEEDS` (and ``calibrate`` here returns them)."""
    monkeypatch.setattr(pricing_choice, "calibrate", lambda devices=None, **_: QUIET_SPEEDS)
    monkeypatch.setitem(globals(), "calibrate", lambda devices=None, **_: QUIET_SPEEDS)


class Wide(nn.Module):
    """Weights large enough that the bytes of their collectives, not the ops' count, set the price."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(10)(nn.relu(nn.Dense(512)(nn.relu(nn.Dense(512)(x)))))


def test_auto_over_hosts_with_a_slow_link_between_them_picks_data_parallel_across_and_fsdp_inside(quiet_speeds):
    """HSDP from the pricing: each collective priced on the link it runs over (inside a host at the
    calibrated speeds, across at them scaled by the topology's bandwidths)."""
    batch, slow = batches("mlp", 1, 64)[0], px.Topology(2, 4, host_bandwidth=1e12, cross_host_bandwidth=1e9)
    fsdp = lambda n: px.FSDP(n, min_weight_size=0, split="largest")
    among = [fsdp(8), px.combine(px.DataParallel(2), fsdp(4))]
    # On shard_map, whose collectives parallax writes (FSDP's gathers over its axis, the gradients' all-reduce over
    # the data axis); how XLA's partitioner lays out jit's differs between JAX versions.
    found = resolve(Wide(), optax.adamw(1e-3), batch, "auto", loss_fn=px.per_example_loss(classifier_loss),
                    among=among, topology=slow, options=px.StepOptions(compile="shard_map", timed_candidates=0))
    assert found.choice.picked == "DataParallel(data=2) × FSDP(fsdp=4), shard_map", found.choice.describe()
    assert crossing_axes(found.mesh, slow) == ("data",)  # the gradients' all-reduce crosses; the gathers stay inside
    # Each link's bytes at its own speed, as read here from the program's collectives and the devices' hosts.
    program = {path: compiled for (_, path), (_, compiled) in found.step._compiled.items()}[found.compile]  # as priced
    devices = list(found.mesh.devices.flat)
    speeds = calibrate(devices)
    links = inspect.collective_bytes_by_link(program.as_text(), hosts_of(devices, slow))
    scale = slow.host_bandwidth / slow.cross_host_bandwidth
    expected = sum(stat.count * speeds.collectives[kind][0] + stat.bytes * speeds.collectives[kind][1] * factor
                   for link, factor in (("inside", 1.0), ("across", scale)) for kind, stat in links[link].items())
    assert estimate(program, speeds, devices, slow).collectives == pytest.approx(expected, rel=1e-9)
    assert estimate(program, speeds, devices, TWO_HOSTS).collectives < expected  # no bandwidths: one price


def test_the_plan_plans_a_cluster_of_more_hosts_and_devices_than_this_process_has():
    """4 hosts x 4 devices planned from this process of 8: the hosts' layout, their bytes, their seconds."""
    cluster = px.Topology(4, 4, host_bandwidth=1e12, cross_host_bandwidth=1e10)
    strategy = px.combine(px.DataParallel(4), px.FSDP(4, min_weight_size=0, split="largest"))
    (row,) = px.plan(Wide(), optax.adamw(1e-3), batches("mlp", 1, 64)[0], loss_fn=classifier_loss,
                     strategies=[strategy], devices=16, topology=cluster, compile="shard_map").rows
    assert row["error"] is None and row["devices"] == 16 and row["mesh"] == {"data": 4, "fsdp": 4}, row
    links = row["links"]
    assert links["hosts"] == 4 and links["crossing"] == ["data"], links  # FSDP's gathers inside each host
    assert links["inside"] + links["across"] == row["collective_bytes"] and 0 < links["across"] < links["inside"]
    assert links["seconds"] == pytest.approx(links["inside"] / 1e12 + links["across"] / 1e10)


DEEP = StackedMLP(hidden=256, layers=8)  # eight blocks of 2 x 256 x 512 weights in a linen nn.scan (2 M params)


@pytest.mark.wide("strategy='auto' over hosts, pipelines priced")
def test_auto_over_hosts_with_a_slow_link_pipelines_a_stack_across_them(quiet_speeds):
    """A model with a stack: across a slow link the pipeline's stage axis crosses the hosts, where
    only activations move (point to point), rather than FSDP's gathers or the gradients' all-reduce."""
    batch, slow = batches("mlp", 1, 16)[0], px.Topology(2, 4, host_bandwidth=1e12, cross_host_bandwidth=1e9)
    fsdp = lambda n: px.FSDP(n, min_weight_size=0, split="largest")
    among = [fsdp(8), px.combine(px.DataParallel(2), fsdp(4)), px.combine(px.PipelineParallel(2), fsdp(4))]
    found = resolve(DEEP, optax.adamw(1e-3), batch, "auto", loss_fn=classifier_loss, among=among, topology=slow,
                    options=px.StepOptions(timed_candidates=0))
    assert found.choice.picked == "PipelineParallel(stage=2) × FSDP(fsdp=4), jit", found.choice.describe()
    assert crossing_axes(found.mesh, slow) == ("stage",)
    program = {path: compiled for (_, path), (_, compiled) in found.step._compiled.items()}[found.compile]
    across = inspect.collective_bytes_by_link(program.as_text(),
                                              hosts_of(list(found.mesh.devices.flat), slow))["across"]
    assert across["collective-permute"].bytes > 0  # the activations between the stages
    # What else crosses is the params outside the stack (their gradients summed over the stages), never the stack's
    # 8 x 2 x 256 x 256 weights' gathers or reductions.
    state = px.init_state(DEEP, optax.adamw(1e-3), batch, strategy=found.strategy, mesh=found.mesh,
                          loss_fn=classifier_loss)
    outside = sum(leaf.nbytes for name, part in state.params.items() if name != "blocks"
                  for leaf in jax.tree.leaves(part))
    others = sum(stat.bytes for kind, stat in across.items() if kind != "collective-permute")
    assert 0 < others <= outside < sum(leaf.nbytes for leaf in jax.tree.leaves(state.params)) // 100, (others, outside)


@pytest.mark.wide("strategy='auto' over hosts for a list of blocks (about 20 s cold)")
def test_auto_over_hosts_with_a_slow_link_pipelines_a_list_of_blocks_held_stacked(quiet_speeds):
    """Hugging Face's GPT-2, its blocks a list: across a slow link the pipeline over them, held stacked
    by stage, is picked, its stage axis across the hosts; only activations and the gradients of the
    params outside the blocks cross them (restacked every step, the blocks' params cross too, and data
    parallelism is picked over it)."""
    from tests import third_party

    model, batch = third_party.gpt2(layers=4), third_party.batches("text", 1)[0]
    slow = px.Topology(2, 4, host_bandwidth=1e12, cross_host_bandwidth=1e9)
    pipeline = lambda stack: px.combine(
        px.PipelineParallel(2, blocks="FlaxGPT2Block", stack_blocks=stack), px.DataParallel(4))
    among = [px.DataParallel(8), px.combine(px.DataParallel(2), px.TensorParallel(4)), pipeline(True)]
    found = resolve(model, optax.adamw(1e-3), batch, "auto", loss_fn=third_party.causal_lm_loss, among=among,
                    topology=slow, options=px.StepOptions(timed_candidates=0))
    picked = "PipelineParallel(stage=2, blocks='FlaxGPT2Block') × DataParallel(data=4)"
    assert found.choice.picked.startswith(picked), found.choice.describe()
    assert crossing_axes(found.mesh, slow) == ("stage",)
    program = {path: compiled for (_, path), (_, compiled) in found.step._compiled.items()}[found.compile]
    hosts = hosts_of(list(found.mesh.devices.flat), slow)
    across = inspect.collective_bytes_by_link(program.as_text(), hosts)["across"]
    state = px.init_state(model, optax.adamw(1e-3), batch, strategy=found.strategy, mesh=found.mesh,
                          loss_fn=third_party.causal_lm_loss)
    blocks = sum(leaf.nbytes for leaf in jax.tree.leaves(state.params["transformer"]["h"]))
    outside = sum(leaf.nbytes for leaf in jax.tree.leaves(state.params)) - blocks
    others = sum(stat.bytes for kind, stat in across.items() if kind != "collective-permute")
    assert across["collective-permute"].bytes > 0 and across["all-to-all"].bytes == 0, across
    # The rest: the gradients of the params outside the blocks summed over the stages (GPT-2's tied embedding's
    # twice, as the table and as the head: 18.7 KB for 10.5 KB of params), and the pipeline's output handed from
    # the last stage and its gradient back (4 KB each); none of the blocks' 203 KB.
    assert others < 3 * outside < blocks / 4, (others, outside, blocks)
    restacked = resolve(model, optax.adamw(1e-3), batch, "auto", loss_fn=third_party.causal_lm_loss,
                        among=[px.DataParallel(8), pipeline(False)], topology=slow,
                        options=px.StepOptions(timed_candidates=0))
    assert restacked.choice.picked.startswith("DataParallel(data=8)"), restacked.choice.describe()


def test_the_host_layout_is_the_same_whatever_order_the_parts_are_listed_in():
    """``combine(FSDP(2), TP(4))`` and ``combine(TP(4), FSDP(2))`` over 2 hosts of 4 devices: one layout, one
    count of the bytes across hosts. Before, jaxlib's mesh-axes replica groups with ``device_ids=`` (printed for
    the mesh whose axes are listed the other way) were read as one group of every device, so the second
    listing priced the layouts otherwise and kept the tensor axis inside where the first put it across."""
    fsdp = dict(min_weight_size=0, split="largest")
    listings = [px.combine(px.FSDP(2, **fsdp), px.TensorParallel(4)),
                px.combine(px.TensorParallel(4), px.FSDP(2, **fsdp))]
    rows = px.plan(MLP(), optax.adamw(3e-3), batches("mlp", 1)[0], loss_fn=classifier_loss, strategies=listings,
                   topology=px.Topology(2, 4), compile="jit").rows
    links = [row["links"] for row in rows]
    assert links[0] == links[1], links
    assert links[0]["across"] < links[0]["inside"] + links[0]["across"]  # a real split of the bytes by link
