"""Peer benchmark: JAX ``jit(vmap(grad))`` per-example gradients on CPU.

Optional and never a dependency of ``per_example_grads``: run it from the
virtualenv that ``benchmarks/peers/setup_peers.sh`` creates::

    benchmarks/peers/.venv-jax/bin/python benchmarks/peers/peer_jax.py --quick
    benchmarks/peers/.venv-jax/bin/python benchmarks/peers/peer_jax.py --out results_jax.md

(``--serve`` makes it a worker of ``benchmarks/bench_vs_peers.py``.)

Models: the benchmark models of ``benchmarks/bench_engines.py`` (mlp, cnn,
transformer) plus the embedding-bag text classifier (embbag), written in plain
``jax.numpy`` / ``jax.lax`` (no Flax, so the venv holds only jax, jaxlib,
numpy), NHWC like Keras, float32, softmax cross-entropy on integer labels.
Parameter layouts follow Keras (e.g. attention kernels ``[64, 4, 16]`` with
``[4, 16]`` biases, as ``keras.layers.MultiHeadAttention``). For every (model,
B) it times, interleaved round-robin after warm-up (the first warm-up call
compiles), each a ``jax.jit`` function whose result is waited for with
``jax.block_until_ready``:

- (a) ``jit(grad(mean loss))`` (the baseline);
- (b) ``jit(vmap(grad(loss_of_one_example), in_axes=(None, 0, 0)))``;
- (c) ``jit`` of (b) followed by clip (``C / max(norm, C)``, as
  ``per_example_grads.clip_by_global_norm``) and sum. XLA compiles this as one
  program and is free to fuse the per-example gradients away.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (stdlib-only harness next to this file)

PEERS = ("jax",)


def init_params(name: str, key):
    import jax
    import jax.numpy as jnp

    keys = iter(jax.random.split(key, 32))

    def glorot(shape, fan_in, fan_out):
        lim = (6.0 / (fan_in + fan_out)) ** 0.5
        return jax.random.uniform(next(keys), shape, jnp.float32, -lim, lim)

    def dense(i, o):
        return {"kernel": glorot((i, o), i, o), "bias": jnp.zeros((o,), jnp.float32)}

    def embedding(v, d):  # Keras' default: uniform(-0.05, 0.05)
        return jax.random.uniform(next(keys), (v, d), jnp.float32, -0.05, 0.05)

    if name == "mlp":
        return {"d1": dense(784, 512), "d2": dense(512, 512), "d3": dense(512, 10)}
    if name == "cnn":

        def conv(k, i, o):
            return {"kernel": glorot((k, k, i, o), k * k * i, k * k * o), "bias": jnp.zeros((o,), jnp.float32)}

        return {"c1": conv(3, 1, 16), "c2": conv(3, 16, 32), "d1": dense(5 * 5 * 32, 64), "d2": dense(64, 10)}
    if name == "transformer":
        d, h = C.TF_DIM, C.TF_HEADS
        hd = d // h

        def proj():
            return {"kernel": glorot((d, h, hd), d, h * hd), "bias": jnp.zeros((h, hd), jnp.float32)}

        def ln():
            return {"gamma": jnp.ones((d,), jnp.float32), "beta": jnp.zeros((d,), jnp.float32)}

        return {
            "tokens": embedding(C.TF_VOCAB, d),
            "positions": 0.05 * jax.random.normal(next(keys), (C.TF_SEQ_LEN, d), jnp.float32),
            "query": proj(),
            "key": proj(),
            "value": proj(),
            "output": {"kernel": glorot((h, hd, d), h * hd, d), "bias": jnp.zeros((d,), jnp.float32)},
            "norm1": ln(),
            "ff1": dense(d, C.TF_FFN),
            "ff2": dense(C.TF_FFN, d),
            "norm2": ln(),
            "head": dense(d, 2),
        }
    if name == "embbag":
        return {"embedding": embedding(C.BAG_VOCAB, C.BAG_DIM), "head": dense(C.BAG_DIM, 2)}
    raise ValueError(name)


def apply(name: str, p, x):
    """Logits ``[B, classes]`` for a batch ``x``."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def dense(q, h):
        return h @ q["kernel"] + q["bias"]

    if name == "mlp":
        h = jax.nn.relu(dense(p["d1"], x))
        h = jax.nn.relu(dense(p["d2"], h))
        return dense(p["d3"], h)
    if name == "cnn":

        def conv(q, h):
            out = lax.conv_general_dilated(h, q["kernel"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return jax.nn.relu(out + q["bias"])

        def pool(h):
            return lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

        h = pool(conv(p["c1"], x))
        h = pool(conv(p["c2"], h))
        h = h.reshape(h.shape[0], -1)
        h = jax.nn.relu(dense(p["d1"], h))
        return dense(p["d2"], h)
    if name == "transformer":

        def ln(q, h):
            mu = h.mean(-1, keepdims=True)
            var = ((h - mu) ** 2).mean(-1, keepdims=True)
            return (h - mu) * lax.rsqrt(var + C.LN_EPS) * q["gamma"] + q["beta"]

        def proj(q, h):  # [B, T, D] -> [B, T, H, hd]
            return jnp.einsum("btd,dhk->bthk", h, q["kernel"]) + q["bias"]

        h = jnp.take(p["tokens"], x, axis=0) + p["positions"]
        q, k, v = proj(p["query"], h), proj(p["key"], h), proj(p["value"], h)
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
        ctx = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, axis=-1), v)
        attn = jnp.einsum("bqhk,hkd->bqd", ctx, p["output"]["kernel"]) + p["output"]["bias"]
        h = ln(p["norm1"], h + attn)
        ff = dense(p["ff2"], jax.nn.relu(dense(p["ff1"], h)))
        h = ln(p["norm2"], h + ff)
        return dense(p["head"], h.mean(axis=1))
    if name == "embbag":
        h = jnp.take(p["embedding"], x, axis=0).mean(axis=1)
        return dense(p["head"], h)
    raise ValueError(name)


def make_tasks(model_name: str, b: int, log):
    import jax
    import jax.numpy as jnp
    import numpy as np

    x_np, y_np = C.make_data(model_name, b)
    x, y = jnp.asarray(x_np), jnp.asarray(y_np)
    params = init_params(model_name, jax.random.PRNGKey(0))
    n_params = sum(int(np.prod(l.shape)) for l in jax.tree_util.tree_leaves(params))
    notes = [f"{model_name}: {n_params:,} parameters (jax pytree)"]

    def per_example_loss(p, xb, yb):
        logits = apply(model_name, p, xb)
        return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, yb[:, None], axis=-1)[:, 0]

    def mean_loss(p, xb, yb):
        return per_example_loss(p, xb, yb).mean()

    def loss_one(p, xi, yi):
        return per_example_loss(p, xi[None], yi[None])[0]

    per_example = jax.vmap(jax.grad(loss_one), in_axes=(None, 0, 0))

    def clip_sum(p, xb, yb):
        g = per_example(p, xb, yb)
        leaves = jax.tree_util.tree_leaves(g)
        norms = jnp.sqrt(sum(jnp.sum(l.reshape(l.shape[0], -1) ** 2, axis=1) for l in leaves))
        factors = C.CLIP_NORM / jnp.maximum(norms, C.CLIP_NORM)
        return jax.tree_util.tree_map(lambda l: jnp.tensordot(factors, l, axes=1), g)

    batch_grad_jit = jax.jit(jax.grad(mean_loss))
    per_example_jit = jax.jit(per_example)
    clip_sum_jit = jax.jit(clip_sum)

    tasks = [
        C.Task("jax", "a", lambda: jax.block_until_ready(batch_grad_jit(params, x, y))),
        C.Task("jax", "b", lambda: jax.block_until_ready(per_example_jit(params, x, y))),
        C.Task("jax", "c", lambda: jax.block_until_ready(clip_sum_jit(params, x, y))),
    ]

    def check():
        """Per-example grads have shape [B, *param] and average to the batch gradient."""
        ref = jax.tree_util.tree_leaves(batch_grad_jit(params, x, y))
        per_ex = jax.tree_util.tree_leaves(per_example_jit(params, x, y))
        leaves = jax.tree_util.tree_leaves(params)
        shapes_ok = all(g.shape == (b, *l.shape) for g, l in zip(per_ex, leaves))
        scale = max(float(jnp.abs(r).max()) for r in ref)
        err = max(float(jnp.abs(g.mean(0) - r).max()) for g, r in zip(per_ex, ref)) / scale
        ok = shapes_ok and err < 1e-4
        line = (
            f"{model_name} B={b} jax: per-example grads [B, *shape] "
            f"{'ok' if shapes_ok else 'WRONG SHAPE'}; their mean vs the batch grad: "
            f"max abs diff / max abs grad = {err:.1e} ({'ok' if ok else 'MISMATCH'})"
        )
        if not ok:
            log(f"  CHECK FAILED: {line}")
        return [line]

    return tasks, notes, check


def main() -> int:
    args = C.parse_args(__doc__.splitlines()[0], PEERS)
    cpus = C.pin_cpus(args.threads)  # before jax starts XLA's thread pools
    import jax
    import jaxlib
    import numpy

    versions = {
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": numpy.__version__,
        "backend": f"{jax.default_backend()} ({len(jax.devices())} device)",
        "CPUs": cpus,
        "XLA_FLAGS": repr(os.environ.get("XLA_FLAGS", "")),
    }
    general = [
        "Each jax row is a `jax.jit` function; its first call (compilation) is a warm-up call and is "
        "not timed (its duration is in the status column). (c) is compiled as one program, so XLA "
        "may avoid writing the full per-example gradients."
    ]
    return C.run(
        args, "Peer benchmark: JAX jit(vmap(grad))", versions, general, lambda m, b, **kw: make_tasks(m, b, C.log)
    )  # no (e) tasks: JAX has no DP training loop here


if __name__ == "__main__":
    sys.exit(main())
