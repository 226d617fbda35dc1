"""ContextParallel: the sequence split over an axis, attention included, for the attention a model
already has (linen and NNX attention modules, ``jax.nn.dot_product_attention``, Hugging Face's
hand-written einsums), against a plain one-device optax loop."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.parallel.candidates import from_mesh
from parallax.parallel.context.attention import context_parallel, model_has_attention, tiles_computed
from parallax.pricing.fused_bytes import dot_flops
from parallax.sharding.specs import is_spec
from tests import third_party, tiers
from tests.models import TinyLM, batches, lm_loss

pytestmark = pytest.mark.core

SEQ = 8  # every attention's length: the tokens are SEQ + 1, the loss shifting them by one


class NnxLM(nnx.Module):
    """NNX's attention module with a causal and a padding mask combined, and dropout on its weights."""

    def __init__(self, rngs: nnx.Rngs, vocab: int = 64, dim: int = 32, heads: int = 4):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, dim, dropout_rate=0.1, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(dim, 2 * dim, rngs=rngs), nnx.Linear(2 * dim, dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens, keep):
        x = self.embed(tokens)
        mask = nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(keep, keep))
        x = x + self.attn(self.norm(x), mask=mask, deterministic=False)
        return self.head(x + self.down(nnx.gelu(self.up(x))))


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(4)(h, h, mask=nn.make_causal_mask(x[..., 0]))
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(2 * x.shape[-1])(nn.LayerNorm()(x)))), None


class StackedLM(nn.Module):
    """Four attention blocks in a linen ``nn.scan`` stack: what PipelineParallel runs as a pipeline."""

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(64, 32)(tokens)
        stack = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
        return nn.Dense(64)(stack(name="blocks")(x, None)[0])


class DotProductLM(nn.Module):
    """Attention through ``jax.nn.dot_product_attention`` (causal), heads split by hand."""

    vocab: int = 64
    dim: int = 32
    heads: int = 4

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        b, s, _ = x.shape
        # No bias on k: its gradient is zero (a softmax ignores a shift along the keys), which Adam
        # would turn into steps of rounding noise.
        h = nn.LayerNorm()(x)
        q, k, v = (nn.Dense(self.dim, use_bias=name != "k", name=name)(h).reshape(b, s, self.heads, -1)
                   for name in ("q", "k", "v"))
        x = x + nn.Dense(self.dim, name="out")(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, -1))
        return nn.Dense(self.vocab, name="head")(x + nn.Dense(self.dim)(nn.gelu(nn.Dense(2 * self.dim)(x))))


def padded_loss(model, batch):
    """Next-token loss over the tokens the padding mask keeps (each row's tail padded)."""
    tokens, keep = batch["x"], batch["keep"]
    logits = model(tokens[:, :-1], keep[:, :-1])
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]) * keep[:, 1:]
    return per_token.sum() / keep[:, 1:].sum()


def gpt2_padded_loss(model, batch):
    tokens, keep = batch["x"], batch["keep"]
    positions = jnp.broadcast_to(jnp.arange(SEQ), (tokens.shape[0], SEQ))
    logits = model(tokens[:, :-1], keep[:, :-1], positions, deterministic=True).logits
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]) * keep[:, 1:]
    return per_token.sum() / keep[:, 1:].sum()


def padded_batches(steps: int, vocab: int = 64) -> list[dict]:
    """LM batches whose rows keep 5 to 9 tokens, the rest padding (``keep`` 0)."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(steps):
        lengths = rng.integers(5, SEQ + 2, 16)
        keep = (np.arange(SEQ + 1)[None] < lengths[:, None]).astype(np.int32)
        out.append({"x": rng.integers(0, vocab, (16, SEQ + 1)).astype(np.int32), "keep": keep})
    return out


def cp(size: int, method: str) -> px.ContextParallel:
    """The context part by method: "all_gather", "ring", or either balanced ("balanced": all_gather,
    "balanced-ring": ring, with load_balance=True)."""
    balanced = method.startswith("balanced")
    return px.ContextParallel(size, method="ring" if method.endswith("ring") else "all_gather", load_balance=balanced)


STRATEGIES = {  # each with the method its context axis runs attention by
    "cp4": lambda m="all_gather": cp(4, m),  # on 4 of the 8 devices
    "cp2-fsdp4": lambda m="all_gather": px.combine(cp(2, m), px.FSDP(4, min_weight_size=64)),
    "cp2-tp2-dp2": lambda m="all_gather": px.combine(cp(2, m), px.TensorParallel(2), px.DataParallel(2)),
    "pp2-cp2-dp2": lambda m="all_gather": px.combine(px.PipelineParallel(2), cp(2, m), px.DataParallel(2)),
}
MODELS = {
    "linen": (lambda: TinyLM(), lm_loss, lambda: batches("lm", 2)),
    "linen-stack": (lambda: StackedLM(), lm_loss, lambda: batches("lm", 2)),
    "nnx": (lambda: NnxLM(nnx.Rngs(0, dropout=1)), padded_loss, lambda: padded_batches(2)),
    "dot_product_attention": (lambda: DotProductLM(), lambda m, b: lm_loss(lambda x, train: m(x), b),
                              lambda: batches("lm", 2)),
    "gpt2": (lambda: third_party.gpt2(layers=2), gpt2_padded_loss,
             lambda: padded_batches(2, vocab=third_party.VOCAB)),
    "llama": (lambda: third_party.llama(layers=1), gpt2_padded_loss,  # grouped-query heads, rotary positions
              lambda: padded_batches(2, vocab=third_party.VOCAB)),
}


GRID = [
    ("linen", "cp4", "sgd", "all_gather"), ("linen", "cp2-fsdp4", "adamw", "all_gather"),
    ("linen", "cp2-tp2-dp2", "sgd", "ring"),
    ("linen-stack", "pp2-cp2-dp2", "adamw", "all_gather"), ("linen-stack", "cp2-fsdp4", "sgd", "all_gather"),
    ("linen-stack", "cp2-fsdp4", "adamw", "ring"),
    ("nnx", "cp2-tp2-dp2", "adamw", "all_gather"), ("nnx", "cp4", "sgd", "ring"),
    ("dot_product_attention", "cp2-fsdp4", "sgd", "all_gather"), ("dot_product_attention", "cp4", "adamw", "ring"),
    ("gpt2", "cp2-tp2-dp2", "sgd", "all_gather"), ("gpt2", "cp2-fsdp4", "adamw", "ring"),
    ("llama", "cp4", "adamw", "all_gather"),
    # load_balance=True: a causal and padding mask with dropout (NNX), linen's where(mask, ...),
    # jax.nn.dot_product_attention's is_causal, grouped-query heads with rotary positions (Llama), and round the
    # ring: NNX, a scanned stack, Hugging Face's additive bias (GPT-2).
    ("nnx", "cp4", "adamw", "balanced"), ("linen", "cp2-tp2-dp2", "sgd", "balanced"),
    ("dot_product_attention", "cp4", "adamw", "balanced"), ("llama", "cp2-fsdp4", "adamw", "balanced"),
    ("nnx", "cp4", "adamw", "balanced-ring"), ("linen-stack", "cp2-fsdp4", "adamw", "balanced-ring"),
    ("gpt2", "cp2-tp2-dp2", "sgd", "balanced-ring"),
]
# The core tier: the AdamW cases (each hybrid, each family, both methods), the two cells only SGD covers
# (context x tensor x data on a linen model and on GPT-2), and the load-balanced cases below.
CORE = [case for case in GRID if case[2] == "adamw" and case[0] != "llama" and not case[3].startswith("balanced")] + [
    ("linen", "cp2-tp2-dp2", "sgd", "ring"), ("gpt2", "cp2-tp2-dp2", "sgd", "all_gather"),
    ("llama", "cp4", "adamw", "all_gather"),
    # load_balance: a mask by where (linen), is_causal (jax.nn), causal and padding with dropout (NNX) by both methods,
    # a scanned stack round the ring; Hugging Face's additive bias and Llama in the wide tier.
    ("linen", "cp2-tp2-dp2", "sgd", "balanced"), ("dot_product_attention", "cp4", "adamw", "balanced"),
    ("nnx", "cp4", "adamw", "balanced"), ("nnx", "cp4", "adamw", "balanced-ring"),
    ("linen-stack", "cp2-fsdp4", "adamw", "balanced-ring")]


@pytest.mark.parametrize("model, strategy, optimizer, method",
                         tiers.cases(GRID, CORE))
def test_context_parallel_trains_an_unmodified_model_like_one_device(model, strategy, optimizer, method):
    build, loss_fn, data = MODELS[model]
    make = lambda: STRATEGIES[strategy](method)
    mesh = make().make_mesh(jax.devices()[:4]) if strategy == "cp4" else None
    opt = optax.sgd(0.1) if optimizer == "sgd" else optax.adamw(1e-2)
    report = px.testing.assert_equivalent(build(), opt, loss_fn, data(), make(), mesh=mesh)
    assert report.mode == "jit", report


def batched_dots(text: str) -> list[tuple[int, ...]]:
    """The result shape of every batched matmul in a compiled program's text."""
    return [tuple(int(d) for d in dims.split(","))
            for dims in re.findall(r"= f32\[(\d+(?:,\d+){2,})\]\{[\d,]*\} dot\(", text)]


def score_tiles(text: str) -> set[tuple[int, int]]:
    """The (rows, columns) of every batched matmul's result."""
    return {shape[-2:] for shape in batched_dots(text)}


def elements(text: str, tile: tuple[int, int]) -> int:
    """The elements of the batched matmul results whose (rows, columns) are ``tile``: the scores and
    their gradients a device computes (each element costs the head dim's multiply-adds)."""
    return sum(int(np.prod(shape)) for shape in batched_dots(text) if shape[-2:] == tile)


def test_each_device_computes_its_queries_rows_of_the_scores_and_no_device_all_of_them():
    """The compiled step's scores are (16/4 queries × 16 keys) per device under ContextParallel(4);
    without it (the same batch) they are (16 × 16): what this test would see were the attention left
    whole. (16 tokens: no other matmul of the model has a dim of that size.) Each device computes an
    eighth of the scores under both, so the gathers duplicate no work; and the step is one program
    that every device runs on its share, so a causal mask leaves every device the same work."""
    batch = {"x": np.random.default_rng(0).integers(0, 64, (16, 17)).astype(np.int32)}
    tiles, texts = {}, {}
    for name, strategy in (("cp", px.combine(px.DataParallel(2), px.ContextParallel(4))), ("dp", px.DataParallel())):
        state = px.init_state(TinyLM(), optax.sgd(0.1), batch, strategy=strategy, loss_fn=lm_loss)
        text = px.make_train_step(lm_loss, strategy).lower(state, batch).compile().as_text()
        tiles[name], texts[name] = score_tiles(text), text
    assert (4, 16) in tiles["cp"] and (16, 16) not in tiles["cp"], tiles
    assert (16, 16) in tiles["dp"], tiles
    assert elements(texts["cp"], (4, 16)) == elements(texts["dp"], (16, 16)) == 2 * (16 // 8) * 4 * 16 * 16, (
        batched_dots(texts["cp"]), batched_dots(texts["dp"]))  # the scores, and their gradient


def test_the_ring_computes_a_tile_of_queries_by_a_block_of_keys_and_passes_the_blocks_round():
    """Under DP(2) x ContextParallel(4, method="ring") with 16 tokens every score tile a device computes
    is (16/4 queries x 16/4 keys): no device computes its queries against all keys, as the all-gather
    method does ((4 x 16) tiles, above), and the keys and values move as collective-permutes."""
    batch = {"x": np.random.default_rng(0).integers(0, 64, (16, 17)).astype(np.int32)}
    strategy = px.combine(px.DataParallel(2), px.ContextParallel(4, method="ring"))
    state = px.init_state(TinyLM(), optax.sgd(0.1), batch, strategy=strategy, loss_fn=lm_loss)
    text = px.make_train_step(lm_loss, strategy).lower(state, batch).compile().as_text()
    tiles = score_tiles(text)
    assert (4, 4) in tiles and not tiles & {(4, 16), (16, 16), (16, 4)}, tiles
    assert "collective-permute" in text


def hf_style(q, k, v, keep):
    """Hugging Face Flax's way: a causal and a padding mask turned into an additive finfo.min bias."""
    s = q.shape[1]
    mask = jnp.tril(jnp.ones((s, s), bool))[None, None] & (keep[:, None, None, :] > 0)
    bias = jax.lax.select(mask, jnp.zeros(mask.shape), jnp.full(mask.shape, jnp.finfo(jnp.float32).min))
    weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def test_balanced_attention_skips_what_the_mask_hides_and_every_device_as_much():
    """Per device, the tiles of scores computed (of 4 × CP) under load_balance=True: a causal mask
    leaves each device 2 × CP + 1 (one diagonal chunk and its mirror), however the mask is written
    (linen's where(mask, scores, finfo.min), jax.nn's is_causal, Hugging Face's additive bias); a
    mask that hides nothing leaves all of them; a row the mask hides whole (a padded query, whose
    softmax is uniform over every key) keeps every tile of its chunk, so it computes what one device does."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("context",))
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 32, 2, 4)) for i in range(3))
    def count(fn, *args):  # the same by both methods
        counts = {method: tiles_computed(fn, *args, mesh=mesh, axis="context", method=method).tolist()
                  for method in ("all_gather", "ring")}
        assert counts["all_gather"] == counts["ring"], counts
        return counts["ring"]

    attention = nn.MultiHeadDotProductAttention(2)
    x = q.reshape(2, 32, 8)
    params = attention.init(jax.random.key(0), x, x)
    causal = nn.make_causal_mask(x[..., 0])
    assert count(lambda x: attention.apply(params, x, x, mask=causal), x) == [9] * 4
    assert count(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), q, k, v) == [9] * 4
    assert count(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), q, k, v) == [16] * 4
    keep = np.ones((2, 32), np.int32)
    assert count(hf_style, q, k, v, keep) == [9] * 4
    keep[1, 28:] = 0  # the keys of 28..31 hidden from every query (padding): each row keeps others
    assert count(hf_style, q, k, v, keep) == [9] * 4
    masked_rows = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=jnp.tril(jnp.ones((32, 32), bool)) & (jnp.arange(32) != 1)[:, None])  # row 1 hidden whole
    assert count(masked_rows, q, k, v) == [9 + 7, 9, 9, 9]  # device 0's chunk 0 (rows 0..3) computes all 8 tiles
    for fn, args in ((hf_style, (q, k, v, keep)), (masked_rows, (q, k, v))):
        for method in ("all_gather", "ring"):
            split = context_parallel(lambda *a: fn(*a), mesh=mesh, axis="context", method=method, load_balance=True)  # noqa: B023 (called in this iteration)
            np.testing.assert_allclose(jax.jit(split)(*args), fn(*args), rtol=1e-5, atol=1e-6)
    # A mask the model computes from no input (positions) that leaves every device as many tiles: the gathered
    # loop runs those alone, without a branch, so the step's matmul FLOPs (what px.plan prices) are 9 tiles' of 16.
    def priced(mask):
        split = context_parallel(lambda q: jax.nn.dot_product_attention(q, k, v, mask=mask()), mesh=mesh,
                                 axis="context", load_balance=True)
        jaxpr = jax.make_jaxpr(jax.grad(lambda q: split(q).sum()))(q)
        return sum(dot_flops(jaxpr.jaxpr)), "cond[" in str(jaxpr)
    (causal, causal_branch), (every, every_branch) = priced(lambda: jnp.tril(jnp.ones((32, 32), bool))), priced(
        lambda: None)
    assert not causal_branch and not every_branch and causal / every == pytest.approx(9 / 16), (causal, every)
    assert priced(lambda: jnp.tril(jnp.ones((32, 32), bool)) & (jnp.arange(32) != 1)[:, None])[1]  # 16, 9, 9, 9
    assert priced(lambda: jnp.asarray(np.tril(np.ones((32, 32), bool))))[1]  # a constant: read as the step runs


def test_a_softmax_runs_in_one_pass_over_its_tiles_and_other_weights_a_pass_each():
    """Round the ring and load-balanced, a softmax's weights take one pass over the tiles (the running
    maximum and sum): the keys pass round once, not once per reduction (2 permutes a turn, not 4 over
    three loops), and each tile's scores are computed once. Against one device, values and gradients:
    jax.nn's causal attention; a mask of -inf hiding every key of a row's first tiles (its running
    maximum starts at -inf); and weights that are not a softmax's (squared), which keep the passes."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("context",))
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 16, 2, 8)) for i in range(3))
    late = jnp.arange(16)[None, :] >= 12  # every query sees only the last 4 keys: the ring's first turns see none

    def hidden_early(q, k, v):
        s = jnp.where(late[None, None], jnp.einsum("bqhd,bkhd->bhqk", q, k), -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    def squared(q, k, v):
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1) ** 2, v)

    causal = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    for fn, permutes in ((causal, 2), (hidden_early, 2), (squared, 4)):
        for method, balanced in (("ring", False), ("ring", True), ("all_gather", True)):
            split = context_parallel(fn, mesh=mesh, axis="context", method=method, load_balance=balanced)
            np.testing.assert_allclose(jax.jit(split)(q, k, v), fn(q, k, v), rtol=1e-5, atol=1e-6)
            grads = jax.grad(lambda *a: (jax.jit(split)(*a) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)  # noqa: B023 (called in this iteration)
            for got, want in zip(grads, jax.grad(lambda *a: (fn(*a) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)):  # noqa: B023 (called in this iteration)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))  # sums' order
            if (method, balanced) == ("ring", False):
                assert str(jax.make_jaxpr(split)(q, k, v)).count("ppermute") == permutes, fn
    one = jax.make_jaxpr(context_parallel(causal, mesh=mesh, axis="context", method="ring"))(q, k, v)
    assert str(one).count("dot_general") == 2  # a turn's scores and weighted values, once each


class ReturnsWeights(nn.Module):
    """Attention whose weights the loss also reads (an attention-entropy term): no ring can hold them."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 16)(tokens)
        q, k, v = (nn.Dense(16)(x)[:, :, None] for _ in range(3))
        weights = nn.dot_product_attention_weights(q, k)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape)
        return nn.Dense(64)(out), jnp.mean(weights * jnp.log(weights + 1e-9))


def mlp_loss(model, batch):
    return jnp.mean((model(batch["x"][..., None].astype(jnp.float32)) - 1.0) ** 2)


@pytest.mark.parametrize("build, loss_fn, batch, strategy, message", [
    (TinyLM, lm_loss, {"x": np.zeros((16, 7), np.int32)}, px.combine(px.DataParallel(2), px.ContextParallel(4)),
     r"queries have length 6, which 4 does not divide: pad the sequence to 8"),
    (lambda: nn.Dense(4), mlp_loss, {"x": np.zeros((16, 8), np.int32)}, px.ContextParallel(),
     r"found no attention in the model .* jax.nn.dot_product_attention"),
    (ReturnsWeights, lambda m, b: sum(jnp.mean(x) for x in m(b["x"])), {"x": np.zeros((16, 8), np.int32)},
     px.ContextParallel(method="ring"),
     r"method='ring'\) cannot run this attention in blocks of keys \(nor load_balance=True in tiles\): the model also "
     r"reads its scores or weights elsewhere .* Use method='all_gather'"),
    (StackedLM, lm_loss, {"x": np.zeros((16, 9), np.int32)}, STRATEGIES["pp2-cp2-dp2"]("ring"),
     r"the ring method does not run inside a pipeline's stages .* use ContextParallel\(method='all_gather'\)"),
    (TinyLM, lm_loss, {"x": np.zeros((16, 7), np.int32)}, px.combine(px.DataParallel(4), cp(2, "balanced")),
     r"load_balance=True\) cuts the sequence into 4 chunks, two per device, and an attention's queries have length 6, "
     r"which 4 does not divide: pad the sequence to 8 .* or use a context size that divides 3"),
    (StackedLM, lm_loss, {"x": np.zeros((16, 9), np.int32)}, STRATEGIES["pp2-cp2-dp2"]("balanced"),
     r"load_balance=True does not run inside a pipeline's stages"),
])
def test_what_context_parallelism_cannot_split_is_named_before_compiling(build, loss_fn, batch, strategy, message):
    with pytest.raises(ValueError, match=message):
        px.init_state(build(), optax.sgd(0.1), batch, strategy=strategy, loss_fn=loss_fn)


def test_context_parallel_arguments_and_paths_are_checked():
    with pytest.raises(ValueError, match=r"ContextParallel\(method='rings'\): use 'all_gather' .* or 'ring'"):
        px.ContextParallel(2, method="rings")
    with pytest.raises(ValueError, match=r"ContextParallel\(size=0\)"):
        px.ContextParallel(0)
    with pytest.raises(TypeError, match=r"ContextParallel\(load_balance='yes'\): use True"):
        px.ContextParallel(2, load_balance="yes")
    assert px.Trainer(TinyLM(), optax.sgd(0.1), lm_loss, strategy="cp2+fsdp").strategy == px.combine(
        px.ContextParallel(2), px.FSDP())
    # A state the search built on a ring: its mesh says so, and the step it reads from the mesh runs the ring.
    ring_mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("context_ring",))
    assert from_mesh(ring_mesh) == px.ContextParallel(4, method="ring", axis="context_ring")
    for axis, method in (("context_balanced", "all_gather"), ("context_ring_balanced", "ring")):  # load-balanced
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), (axis,))
        assert from_mesh(mesh) == px.ContextParallel(4, method=method, axis=axis, load_balance=True)
    strategy, batch = px.combine(px.DataParallel(2), px.ContextParallel(4)), batches("lm", 1)[0]
    state = px.init_state(TinyLM(), optax.sgd(0.1), batch, strategy=strategy, loss_fn=lm_loss)
    with pytest.raises(ValueError, match="splits the model's attention over the sequence, which the jit path compiles"):
        px.make_train_step(lm_loss, strategy, compile="shard_map").lower(state, batch)


@pytest.mark.wide("the plan's search for more devices (14 s cold): the core tier trains context parallelism against"
                  " one device")
def test_the_plan_names_more_devices_with_the_sequence_split_for_a_long_sequence_that_fits_nowhere():
    """Two 512-token sequences on 2 devices under FSDP need 16.8 MiB each; 4 devices cannot split a
    batch of 2 rows, but the sequence over them can: load-balanced and gathered (the causal mask's kept
    tiles alone), it needs 2.8 MiB, which fits 8 MB: the plan's fix. Unbalanced, the same split needs
    8.6 MiB (the whole rows of scores), which would not, and the ring 6.4 MiB."""
    batch = {"x": jax.ShapeDtypeStruct((2, 513), jnp.int32)}
    report = px.plan(TinyLM(), optax.adamw(1e-3), batch, loss_fn=lm_loss, strategies=["fsdp"], devices=[2],
                     memory_budget="8MB")
    tried = report.as_dict()["fixes"]["8MB"]
    assert [fix["change"] for fix in tried if fix["error"]] == ["devices=4"]  # the batch does not split
    split = [fix for fix in tried if "ContextParallel" in fix["change"]]
    assert [fix["strategy"] for fix in split] == [
        "ContextParallel(context=2, load_balance=True, shard_params=True) × FSDP(fsdp=2)"]  # the state over both
    assert split[0]["fits"] and split[0]["peak"] < tried[0]["peak"] / 4, tried
    assert ("use devices=4, strategy=ContextParallel(context=2, load_balance=True, shard_params=True) × "
            "FSDP(fsdp=-1)") in str(report)
    plain = px.plan(TinyLM(), optax.adamw(1e-3), batch, loss_fn=lm_loss, devices=[4],
                    strategies=[px.combine(px.ContextParallel(2), px.FSDP(2))]).rows[0]
    assert plain["peak"] > 8e6 > split[0]["peak"], (plain["peak"], split[0]["peak"])  # unbalanced, it would not fit
    # Only a model with attention is offered it (read from its trace).
    assert model_has_attention(NnxLM(nnx.Rngs(0, dropout=1)), padded_batches(1)[0], padded_loss)
    assert not model_has_attention(nn.Dense(4), {"x": np.zeros((16, 8), np.int32)}, mlp_loss)


@pytest.mark.wide("the compiled pipeline's attention tiles (15 s cold); pipeline x context trains against one "
                  "device in the core tier")
def test_a_pipeline_runs_its_stages_attention_split_over_the_context_axis():
    """PipelineParallel(2) × ContextParallel(2) × DataParallel(2) on a stack of attention blocks: the
    pipeline's layers compute (8 queries × 16 keys) score tiles, (16 × 16) without the context axis."""
    batch = {"x": np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)}
    tiles = {}
    for name, strategy in (("cp", STRATEGIES["pp2-cp2-dp2"]()),
                           ("dp", px.combine(px.PipelineParallel(2), px.DataParallel(4)))):
        state = px.init_state(StackedLM(), optax.sgd(0.1), batch, strategy=strategy, loss_fn=lm_loss)
        tiles[name] = score_tiles(px.make_train_step(lm_loss, strategy).lower(state, batch).compile().as_text())
    assert (8, 16) in tiles["cp"] and (16, 16) not in tiles["cp"] and (16, 16) in tiles["dp"], tiles


def test_a_long_sequences_mask_and_tiles_are_computed_a_block_at_a_time_and_compute_what_one_device_does():
    """At long sequences a load-balanced attention holds neither its mask whole nor a chunk² tile of
    scores: the mask's ops run at each tile's shapes (mask_tiles: no equation of the traced step is the
    mask's whole [1, 1, 32, 32]), and a softmax's tile runs ``block`` keys a step. Against one device,
    values and gradients, by both methods (the kept tiles alone, without a branch, round the ring too,
    where every device keeps as many): linen's causal mask (made per row of the batch, the same
    along it: its skips read once for every row and head), jax.nn's is_causal (its mask inside a jit), and
    a mask made from no input that differs per head (a window per head: its skips read head by head)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("context",))
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 32, 2, 8)) for i in range(3))

    def linen_mask(q, k, v):
        return nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(q[..., 0, 0]))

    def windows(q, k, v):  # head 0 sees the last 6 keys, head 1 the last 12
        pos = jnp.arange(32)
        window = (jnp.arange(2) + 1)[:, None, None] * 6
        seen = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < window)
        s = jnp.where(seen[None], jnp.einsum("bqhd,bkhd->bhqk", q, k), jnp.finfo(jnp.float32).min)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    causal = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    for fn in (linen_mask, causal, windows):
        want = fn(q, k, v)
        want_grads = jax.grad(lambda *a: (fn(*a) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)  # noqa: B023 (called in this iteration)
        for method in ("ring", "all_gather"):
            split = context_parallel(fn, mesh=mesh, axis="context", method=method, load_balance=True, block=2)
            inside = [str(e.params["jaxpr"]) for e in jax.make_jaxpr(split)(q, k, v).jaxpr.eqns
                      if e.primitive.name == "shard_map"]  # outside it, the model's mask is left unused
            traced = inside[0]
            assert len(inside) == 1 and not re.search(r"\[\d+,\d+,(32,32|16,32)\]", traced), fn
            assert "f32[2,2,8,2]" in traced  # a step's scores: 8 queries (a chunk) × 2 keys (a block)
            # A causal mask leaves every device as many tiles (of each turn's block round the ring): the loop
            # runs the kept ones alone, no branch; the windows leave unequal counts, a branch per tile.
            assert (" cond[" in traced) == (fn is windows), (fn, method)
            np.testing.assert_allclose(jax.jit(split)(q, k, v), want, rtol=1e-5, atol=1e-6)
            grads = jax.grad(lambda *a: (jax.jit(split)(*a) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)  # noqa: B023 (called in this iteration)
            for got, expected in zip(grads, want_grads):
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * float(jnp.abs(expected).max()))
    # The skips read from the mask's tiles (of 4 × CP = 8 tiles a device): causal, 5 each; the windows hide
    # device 0's queries 24-31 from keys 0-7 for both heads, which the causal mask shows, so 4 and 5.
    assert tiles_computed(linen_mask, q, k, v, mesh=mesh, axis="context").tolist() == [5, 5]
    assert tiles_computed(windows, q, k, v, mesh=mesh, axis="context").tolist() == [4, 5]


def test_shard_params_splits_the_state_over_the_context_axis_and_a_scanned_stack_keeps_its_rows_split():
    """ContextParallel(shard_params=True) splits the params and the optimizer state over the context
    axis as FSDP splits them over its own, on FSDP's dim (a scanned stack's layer dim never), and trains
    like one device. Under context parallelism the batch's rows stay split through a scanned stack: each
    device's dense matmuls take its own rows (16 rows x 16 tokens over FSDP 4 and CP 2: 4 x 8 = 32
    tokens a device), not the whole batch's 128, which the compiler gathered before, every device
    then computing every row's attention."""
    make = lambda: px.combine(
        px.ContextParallel(2, "ring", load_balance=True, shard_params=True, min_weight_size=64),
        px.FSDP(4, min_weight_size=64))
    plan = px.plan_state(StackedLM(), optax.adamw(1e-2), batches("lm", 1)[0], strategy=make(), loss_fn=lm_loss)
    specs = {"/".join(str(getattr(k, "key", k)) for k in path): tuple(spec)
             for path, spec in jax.tree_util.tree_leaves_with_path(plan.specs.params, is_leaf=is_spec)}
    kernel = next(spec for path, spec in specs.items() if path.endswith("blocks/Dense_0/kernel"))
    assert kernel == (None, ("fsdp", "context")), specs  # (layers, in, out): layers whole, FSDP's dim joined
    assert px.ContextParallel(2).fsdp_axes == () and make().fsdp_axes == ("context", "fsdp")
    report = px.testing.assert_equivalent(StackedLM(), optax.adamw(1e-2), lm_loss, batches("lm", 2), make())
    assert report.mode == "jit", report
    batch = batches("lm", 1)[0]
    state = px.init_state(StackedLM(), optax.sgd(0.1), batch, strategy=make(), loss_fn=lm_loss)
    text = px.make_train_step(lm_loss, make()).lower(state, batch).compile().as_text()
    rows = {int(m) for m in re.findall(r"= f32\[(\d+),32\]\{[\d,]*\} dot\(", text)}  # (tokens, features), grads
    assert 32 in rows and not rows & {128, 256}, rows
    with pytest.raises(TypeError, match=r"ContextParallel\(shard_params=1\): use True"):
        px.ContextParallel(2, shard_params=1)
    with pytest.raises(ValueError, match=r"ContextParallel\(min_weight_size=-1\): use an integer >= 0"):
        px.ContextParallel(2, shard_params=True, min_weight_size=-1)
