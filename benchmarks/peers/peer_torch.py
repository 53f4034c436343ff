"""Peer benchmark: PyTorch ``torch.func`` (vmap + grad) and Opacus grad-sample hooks.

Optional and never a dependency of ``per_example_grads``: run it from the
virtualenv that ``benchmarks/peers/setup_peers.sh`` creates::

    benchmarks/peers/.venv-torch/bin/python benchmarks/peers/peer_torch.py --quick
    benchmarks/peers/.venv-torch/bin/python benchmarks/peers/peer_torch.py --out results_torch.md

(``--serve`` makes it a worker of ``benchmarks/bench_vs_peers.py``.)

Models: the benchmark models of ``benchmarks/bench_engines.py`` (mlp, cnn,
transformer) plus the embedding-bag text classifier (embbag), written as
plain ``torch.nn`` modules, softmax cross-entropy on integer labels, float32,
eager mode, 2 threads (``OMP_WAIT_POLICY=PASSIVE`` unless set; see README).
For every (model, B) it times, interleaved round-robin
after warm-up:

- ``torch`` (a): ``torch.autograd.grad`` of the mean loss (the baseline);
- ``torch.func`` (b): ``vmap(grad(loss_of_one_example), in_dims=(None, 0, 0))``
  over ``functional_call``; (c) the same then clip + sum;
- ``opacus`` (b): ``GradSampleModule`` (hooks mode) forward + ``backward()``
  of the summed loss, reading ``p.grad_sample``; (c) the same then clip + sum
  written here (``C / max(norm, C)``, as ``per_example_grads.clip_by_global_norm``).

Layout notes: the CNN runs NCHW (PyTorch's native layout; the data is the
same NHWC array transposed, then copied to standard contiguous strides). Attention is four ``nn.Linear`` projections
(query, key, value, output, with biases, as Keras ``MultiHeadAttention``)
rather than ``nn.MultiheadAttention``, for which Opacus has no grad sampler; the
learned positions are an ``nn.Embedding(32, 64)`` looked up at positions
0..31, the same table as a ``[32, 64]`` weight added to every example.
"""

from __future__ import annotations

import copy
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (stdlib-only harness next to this file)

PEERS = ("torch.func", "opacus")


def build_model(name: str):
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Attention(nn.Module):
        def __init__(self, dim: int, heads: int):
            super().__init__()
            self.heads, self.head_dim = heads, dim // heads
            self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.output = nn.Linear(dim, dim)

        def forward(self, x):
            b, t, d = x.shape

            def split(z):  # [b, t, d] -> [b, heads, t, head_dim]
                return z.reshape(b, t, self.heads, self.head_dim).transpose(1, 2)

            q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
            ctx = torch.softmax(scores, dim=-1) @ v
            return self.output(ctx.transpose(1, 2).reshape(b, t, d))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(C.TF_VOCAB, C.TF_DIM)
            self.positions = nn.Embedding(C.TF_SEQ_LEN, C.TF_DIM)
            self.attention = Attention(C.TF_DIM, C.TF_HEADS)
            self.norm1 = nn.LayerNorm(C.TF_DIM, eps=C.LN_EPS)
            self.ff1 = nn.Linear(C.TF_DIM, C.TF_FFN)
            self.ff2 = nn.Linear(C.TF_FFN, C.TF_DIM)
            self.norm2 = nn.LayerNorm(C.TF_DIM, eps=C.LN_EPS)
            self.head = nn.Linear(C.TF_DIM, 2)

        def forward(self, tokens):
            b, t = tokens.shape
            pos = torch.arange(t, device=tokens.device).expand(b, t).contiguous()
            h = self.tokens(tokens) + self.positions(pos)
            h = self.norm1(h + self.attention(h))
            h = self.norm2(h + self.ff2(torch.relu(self.ff1(h))))
            return self.head(h.mean(dim=1))

    class EmbeddingBag(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(C.BAG_VOCAB, C.BAG_DIM)
            self.head = nn.Linear(C.BAG_DIM, 2)

        def forward(self, tokens):
            return self.head(self.embedding(tokens).mean(dim=1))

    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 5 * 5, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )
    if name == "small_cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 5, stride=2),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 5 * 5, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )
    if name == "transformer":
        return Transformer()
    if name == "embbag":
        return EmbeddingBag()
    raise ValueError(name)


def clip_and_sum(per_example):
    """``sum_i g_i * C / max(||g_i||, C)`` with ``||g_i||`` the global norm over all tensors."""
    import torch

    sq = None
    for g in per_example:
        s = g.reshape(g.shape[0], -1).pow(2).sum(dim=1)
        sq = s if sq is None else sq + s
    norms = sq.sqrt()
    factors = C.CLIP_NORM / torch.clamp(norms, min=C.CLIP_NORM)
    return [torch.tensordot(factors, g, dims=1) for g in per_example]


def torch_inputs(model_name: str, x_np, y_np):
    """``(x, y)`` torch tensors of ``_common.make_data``'s arrays: images NCHW, contiguous (see ``make_tasks``), ids int64."""
    import torch

    x = torch.from_numpy(x_np)
    if model_name in ("cnn", "small_cnn"):
        x = x.permute(0, 3, 1, 2).clone(memory_format=torch.contiguous_format)
    if x.dtype == torch.int32:
        x = x.long()
    return x, torch.from_numpy(y_np).long()


def epoch_tasks(model_name: str, log) -> list:
    """(e): one DP epoch with Opacus's ``PrivacyEngine`` (ghost clipping; per-example hooks) and one plain torch epoch.

    Each trains its own copy of the model (same initial weights) with SGD on
    a ``DataLoader`` over ``_common.EPOCH_N`` examples: Opacus with Poisson
    sampling of expected batch ``EPOCH_BATCH`` (``make_private(...,
    poisson_sampling=True)``), noise multiplier ``EPOCH_SIGMA``, clip
    ``CLIP_NORM``; plain torch with batches of ``EPOCH_BATCH``. A call times
    the epoch's loop alone (``zero_grad``, forward, loss, backward, step).
    """
    import time

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    x, y = torch_inputs(model_name, *C.make_data(model_name, C.EPOCH_N))
    dataset = TensorDataset(x, y)

    def epoch_of(model, optimizer, criterion, loader):
        def epoch():
            model.train()
            start = time.perf_counter()
            for xb, yb in loader:
                optimizer.zero_grad(set_to_none=True)
                criterion(model(xb), yb).backward()
                optimizer.step()
            return C.Seconds(time.perf_counter() - start)

        return epoch

    model = build_model(model_name)
    plain = (
        model,
        torch.optim.SGD(model.parameters(), lr=C.EPOCH_LR),
        torch.nn.CrossEntropyLoss(),
        DataLoader(dataset, batch_size=C.EPOCH_BATCH, shuffle=True),
    )
    tasks = [C.Task("torch (not private)", "e", epoch_of(*plain))]
    try:
        from opacus import PrivacyEngine
    except ImportError:
        return tasks
    for mode in ("ghost", "hooks"):
        try:
            model = build_model(model_name)
            engine = PrivacyEngine()
            optimizer = torch.optim.SGD(model.parameters(), lr=C.EPOCH_LR)
            loader = DataLoader(dataset, batch_size=C.EPOCH_BATCH)
            criterion = torch.nn.CrossEntropyLoss()
            common = dict(
                module=model,
                optimizer=optimizer,
                data_loader=loader,
                noise_multiplier=C.EPOCH_SIGMA,
                max_grad_norm=C.CLIP_NORM,
                poisson_sampling=True,
            )
            if mode == "ghost":
                model, optimizer, criterion, loader = engine.make_private(
                    **common, criterion=criterion, grad_sample_mode="ghost"
                )
            else:
                model, optimizer, loader = engine.make_private(**common)
            tasks.append(C.Task(f"opacus {mode}", "e", epoch_of(model, optimizer, criterion, loader)))
        except Exception as e:  # noqa: BLE001 - a refusal is a result
            log(f"  opacus {mode} epoch of {model_name}: {type(e).__name__}: {e}")

            def refused(e=e):
                raise RuntimeError(f"opacus {mode} refused: {e}")

            tasks.append(C.Task(f"opacus {mode}", "e", refused))
    return tasks


def make_tasks(model_name: str, b: int, peers, log, quantities=("a", "b", "c")):
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap

    x_np, y_np = C.make_data(model_name, b)
    x = torch.from_numpy(x_np)
    if model_name in ("cnn", "small_cnn"):
        # NHWC -> NCHW with standard strides. A transposed [B, 28, 28, 1] array
        # has strides (784, 1, 28, 1), which torch reads as channels_last; the
        # conv then runs channels_last and Opacus 1.6's conv grad sampler
        # (which assumes NCHW strides) returns wrong grad_sample for the
        # second conv. A fresh contiguous copy is what a DataLoader gives.
        x = x.permute(0, 3, 1, 2).clone(memory_format=torch.contiguous_format)
    if x.dtype == torch.int32:
        x = x.long()
    y = torch.from_numpy(y_np).long()

    model = build_model(model_name).eval()
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    n_params = sum(p.numel() for p in params)
    tasks, notes = [], [f"{model_name}: {n_params:,} parameters (torch modules)"]

    def batch_grad():
        loss = F.cross_entropy(model(x), y)
        return torch.autograd.grad(loss, params)

    tasks.append(C.Task("torch", "a", batch_grad))
    if "e" in quantities:
        tasks += epoch_tasks(model_name, log)

    results = {}
    if "torch.func" in peers:
        detached = {n: p.detach() for n, p in model.named_parameters()}

        def loss_one(p, xi, yi):
            logits = functional_call(model, p, (xi.unsqueeze(0),))
            return F.cross_entropy(logits, yi.unsqueeze(0))

        per_example_fn = vmap(grad(loss_one), in_dims=(None, 0, 0))

        def tf_b():
            g = per_example_fn(detached, x, y)
            return [g[n] for n in names]

        def tf_c():
            return clip_and_sum(tf_b())

        tasks += [C.Task("torch.func", "b", tf_b), C.Task("torch.func", "c", tf_c)]
        results["torch.func"] = tf_b

    if "opacus" in peers:
        from opacus import GradSampleModule

        wrapped = GradSampleModule(copy.deepcopy(model), batch_first=True, loss_reduction="sum")
        # Opacus captures activations only in training mode; these models have
        # no dropout or batch norm, so train() computes the same function.
        wrapped.train()
        o_params = [p for _, p in wrapped._module.named_parameters()]

        def op_b():
            wrapped.zero_grad(set_to_none=True)  # also drops the previous grad_sample
            loss = F.cross_entropy(wrapped(x), y, reduction="sum")
            loss.backward()
            return [p.grad_sample for p in o_params]

        def op_c():
            return clip_and_sum(op_b())

        tasks += [C.Task("opacus", "b", op_b), C.Task("opacus", "c", op_c)]
        results["opacus"] = op_b

    def check():
        """Per-example grads have shape [B, *param] and average to the batch gradient."""
        ref = [g.detach() for g in batch_grad()]
        scale = max(float(r.abs().max()) for r in ref)
        lines, kept = [], {}
        for peer, fn in results.items():
            per_ex = [g.detach() for g in fn()]
            shapes_ok = all(tuple(g.shape) == (b, *p.shape) for g, p in zip(per_ex, params))
            err = max(float((g.mean(dim=0) - r).abs().max()) for g, r in zip(per_ex, ref)) / scale
            ok = shapes_ok and err < 1e-4
            lines.append(
                f"{model_name} B={b} {peer}: per-example grads [B, *shape] "
                f"{'ok' if shapes_ok else 'WRONG SHAPE'}; their mean vs the batch grad: "
                f"max abs diff / max abs grad = {err:.1e} ({'ok' if ok else 'MISMATCH'})"
            )
            if not ok:
                log(f"  CHECK FAILED: {lines[-1]}")
            kept[peer] = per_ex
        if len(kept) == 2:  # the two peers' per-example gradients, example by example
            (pa, ga), (pb, gb) = kept.items()
            d = max(float((u - v).abs().max()) for u, v in zip(ga, gb)) / scale
            lines.append(
                f"{model_name} B={b} {pa} vs {pb}: per-example grads max abs diff / max abs grad "
                f"= {d:.1e} ({'ok' if d < 1e-4 else 'MISMATCH'})"
            )
        return lines

    return tasks, notes, check


def main() -> int:
    args = C.parse_args(__doc__.splitlines()[0], PEERS)
    cpus = C.pin_cpus(args.threads)  # before torch creates its thread pools
    # OpenMP threads that spin-wait between parallel regions steal the CPU the
    # other thread needs whenever anything else runs on the machine: on a
    # shared 2-CPU box the 2-thread batch gradient of the MLP took ~140 ms with
    # the default policy and ~4 ms with PASSIVE. TensorFlow's and XLA's pools
    # do not spin like that, so PASSIVE is the fair default. Export
    # OMP_WAIT_POLICY yourself to override (it must be set before torch loads).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import warnings

    import numpy
    import torch

    # Opacus' full backward hooks on the first layer (whose input needs no grad) warn on every call.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")

    torch.set_num_threads(max(1, args.threads))
    versions = {
        "python": sys.version.split()[0],
        "CPUs": cpus,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"],
    }
    try:
        import opacus

        versions["opacus"] = opacus.__version__
    except ImportError:
        if "opacus" in args.peers:
            C.log("opacus not installed: skipping the opacus peer")
            args.peers = [p for p in args.peers if p != "opacus"]
    versions["torch threads"] = f"{torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op"

    general = [
        "torch (a) is eager `torch.autograd.grad` of the mean loss; both peers' ratios are to it. "
        "Opacus (b)/(c) include its forward/backward hooks and the summed `.grad` that "
        "`backward()` also produces."
    ]
    if "cnn" in args.models:
        general.append(
            "cnn input is NCHW with standard contiguous strides. Fed the NHWC array merely "
            "transposed (strides read as channels_last), Opacus 1.6.0 returned wrong grad_sample "
            "for the second conv (max rel. error ~0.9 vs a per-example loop); torch.func was right."
        )
    return C.run(
        args,
        "Peer benchmark: PyTorch (torch.func vmap(grad), Opacus hooks)",
        versions,
        general,
        lambda m, b, **kw: make_tasks(m, b, args.peers, C.log, **kw),
    )


if __name__ == "__main__":
    sys.exit(main())
