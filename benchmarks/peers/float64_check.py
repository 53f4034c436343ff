"""Float64 reference for one cell of ``peer_models_torch.py``: whose float32 gradients are off, and where.

When every method of a cell is flagged against the float32 loop over single
examples, this tells float32 numerics from a per-example-gradient bug: it
compares the float32 plain batch gradient, the float32 loop over examples and
torch.func's per-example gradients with the same computations in float64::

    benchmarks/peers/.venv-torch/bin/python benchmarks/peers/float64_check.py mobilenet_v2 32 32

(model, T or image side, B). Vision and BERT models only (their loss has no
sequence dimension); it is a diagnostic, not part of the timed benchmark.
"""

from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    import warnings

    warnings.filterwarnings("ignore")
    import peer_models_torch as P
    import torch
    from torch.func import functional_call, grad, vmap

    spec, size, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(2)
    P.torchvision_cpu_shim()
    cell = P.build_cell(spec, size, b)
    m, inputs, y = cell.model, cell.inputs, cell.labels
    m64 = copy.deepcopy(m).double()
    in64 = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}
    names = [n for n, _ in m.named_parameters()]

    def loss(model, inp, lab):
        return P.per_example_loss(cell, P.logits_of(model(**inp)), lab)

    def rel(a, b_):  # per parameter: max abs diff / max abs of the float64 value
        return max(
            (float((x.double() - r).abs().max() / r.abs().max().clamp(min=1e-300)), n) for x, r, n in zip(a, b_, names)
        )

    batch32 = torch.autograd.grad(loss(m, inputs, y).mean(), list(m.parameters()))
    batch64 = torch.autograd.grad(loss(m64, in64, y).mean(), list(m64.parameters()))
    print("plain batch gradient, float32 vs float64: worst parameter %.1e (%s)" % rel(batch32, batch64))

    params = {n: p.detach() for n, p in m.named_parameters()}

    def loss_one(p, xi, yi):
        one = {k: v.unsqueeze(0) for k, v in xi.items()}
        return P.per_example_loss(cell, P.logits_of(functional_call(m, p, (), one)), yi.unsqueeze(0))[0]

    tensors = {k: v for k, v in inputs.items() if torch.is_tensor(v)}
    g = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, tensors, y)
    worst_loop, worst_func = (0.0, "", -1), (0.0, "", -1)
    for i in range(b):
        one32 = {k: (v[i : i + 1] if torch.is_tensor(v) else v) for k, v in inputs.items()}
        one64 = {k: (v[i : i + 1] if torch.is_tensor(v) else v) for k, v in in64.items()}
        r = torch.autograd.grad(loss(m64, one64, y[i : i + 1])[0], list(m64.parameters()))
        l32 = torch.autograd.grad(loss(m, one32, y[i : i + 1])[0], list(m.parameters()))
        worst_loop = max(worst_loop, (*rel(l32, r), i))
        worst_func = max(worst_func, (*rel([g[n][i] for n in names], r), i))
    print("float32 loop over examples vs float64: worst %.1e (%s, example %d)" % worst_loop)
    print("torch.func per-example (batched) vs float64: worst %.1e (%s, example %d)" % worst_func)
    return 0


if __name__ == "__main__":
    sys.exit(main())
