"""Peer benchmark on real model families: PyTorch torch.func, Opacus hooks and Opacus ghost clipping.

Optional and never a dependency of ``per_example_grads``: run it from the
virtualenv that ``benchmarks/peers/setup_peers.sh torch`` creates (torch CPU,
opacus, transformers, torchvision, peft)::

    benchmarks/peers/.venv-torch/bin/python benchmarks/peers/peer_models_torch.py --quick
    benchmarks/peers/.venv-torch/bin/python benchmarks/peers/peer_models_torch.py \\
        --out benchmarks/peers/results_models.md

The counterpart on our side (TensorFlow/Keras) is ``benchmarks/bench_models.py``;
this script does not run it and does not import ``per_example_grads``.

Models, built from configs with random weights (nothing is downloaded):

- ``gpt2``: Hugging Face ``GPT2LMHeadModel`` (4 layers, 256 wide, 4 heads,
  vocab 8192, 128 positions, tied input/output embeddings), next-token loss,
  per example the mean over its T-1 positions; T=64 and 128.
- ``gpt2-lora``: the same with ``peft`` LoRA rank 8 on ``c_attn``,
  ``c_proj`` and ``c_fc`` (only the adapters train); needs ``peft``.
- ``bert``: ``BertForSequenceClassification`` (4 layers, 256 wide, 4 heads,
  intermediate 1024, vocab 8192, 2 labels), T=64.
- ``mobilenet_v2``, ``efficientnet_b0``, ``convnext_tiny``, ``resnet50``:
  torchvision, ``weights=None``, 10 classes, 32x32x3 input, after Opacus's
  ``ModuleValidator.fix`` (BatchNorm -> GroupNorm). ``NAME@224`` runs
  224x224 inputs instead.

Dropout and stochastic depth are set to 0 everywhere, so the model computes
the same function in ``train()`` (which Opacus needs to capture activations)
and ``eval()`` (used by the plain step and torch.func).

Each (model, shape, B) is one cell; its tasks run round-robin in this process
(``_common.run_round_robin``: warm-up, then every repeat calls each task once,
the starting task rotating), and the median is reported, with the ratio to the
same cell's plain step:

- ``torch`` plain: forward + ``torch.autograd.grad`` of the mean loss;
- ``torch.func`` norms / clipped sum: ``vmap(grad(loss of one example))`` over
  ``functional_call``, then the per-example global L2 norms (norms), then the
  factors ``C / max(norm, C)`` with C = 1 and the weighted sum over the batch
  (clipped sum: the DP-SGD gradient before noise);
- ``opacus`` norms / clipped sum: ``GradSampleModule`` (hooks) forward +
  ``backward()`` of the summed per-example losses, ``p.grad_sample`` read,
  then norms, then the same clip and sum;
- ``opacus ghost`` norms / clipped sum: ``GradSampleModuleFastGradientClipping``
  (ghost clipping on, max_grad_norm 1) with ``DPOptimizerFastGradientClipping``
  (noise 0) and ``DPLossFastGradientClipping``; norms = forward + first
  backward + ``get_norm_sample()``, clipped sum = forward + the wrapped loss's
  ``backward()`` (two backward passes), read from ``p.grad``. Its clip factor
  is Opacus's ``min(1, C / (norm + 1e-6))``.

A method that refuses the model (an exception at construction or at the first
call) is reported with the first line of its error, verbatim.
"""

from __future__ import annotations

import argparse
import copy
import gc
import glob
import importlib.util
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (stdlib-only harness next to this file)

TEXT_MODELS = ("gpt2", "gpt2-lora", "bert")
VISION_MODELS = ("mobilenet_v2", "efficientnet_b0", "convnext_tiny", "resnet50")
MODELS = TEXT_MODELS + VISION_MODELS
DEFAULT_MODELS = MODELS
METHODS = ("torch.func", "opacus", "opacus ghost")

GPT2_CFG = dict(vocab_size=8192, n_positions=128, n_embd=256, n_layer=4, n_head=4)
BERT_CFG = dict(
    vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, num_labels=2
)
LORA_RANK = 8
N_CLASSES_VISION = 10

# Check tolerances against the float32 loop over single examples: the norms relative
# to each example's norm, the clipped sum relative to its largest entry. The sum's is
# looser because float32 is: on the randomly initialised MobileNetV2 at 224x224 (B=2)
# torch.func's clipped sum differed from the loop's by 2.2e-3 of its largest entry,
# and against a float64 loop some parameters' per-example gradients were off by up to
# 2e-2 (torch.func) and 5e-3 (the float32 loop itself) of that parameter's largest
# entry, with norms within 5e-5. Wrong per-example gradients (ConvNeXt's downsampling
# convolutions under Opacus hooks) put the norms off by ~1e-2 and the sum by ~0.2.
NORMS_TOL, SUM_TOL = 1e-3, 1e-2
GRAD_SAMPLE_TOL = 5e-2  # per parameter, for naming the wrong grad_sample

QUANTITY_LABELS = {"plain": "plain step", "norms": "norms", "clipped": "clipped sum"}

# Shapes per model when --batch-sizes / --seq-lens are not given.
DEFAULT_B = {"gpt2": (8, 32), "gpt2-lora": (8, 32), "bert": (8, 32)}
DEFAULT_B_VISION = {32: (32,), 224: (8,)}
DEFAULT_T = {"gpt2": (64, 128), "gpt2-lora": (64, 128), "bert": (64,)}


# --- environment -----------------------------------------------------------------------------

_TORCHVISION_OPS_SHIM = None  # keeps the op-schema fragment alive


def torchvision_cpu_shim() -> str | None:
    """Let torchvision's pure-Python models import when its C++ ops cannot load.

    PyPI's Linux wheel of torchvision 0.28.0 is linked against the CUDA build
    of torch (``libtorch_cuda.so``); the CPU wheel of torch 2.13.0 cannot load
    its ``_C.so``, and ``import torchvision`` then fails in
    ``_meta_registrations.py`` with ``RuntimeError: operator torchvision::nms
    does not exist`` (transformers imports torchvision when it is installed,
    so transformers fails the same way). The CPU build of torchvision is only
    on PyTorch's own index, which this machine cannot reach. The classifiers
    used here never call a torchvision C++ op, so when ``_C.so`` does not load
    we declare the two op schemas (no kernels) that the import registers fake
    kernels for; any detection op would still fail loudly. Returns a note for
    the report, or None when nothing was needed.
    """
    global _TORCHVISION_OPS_SHIM
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return None
    libs = glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so"))
    try:
        if not libs:
            raise OSError("no _C.so")
        torch.ops.load_library(libs[0])
        return None
    except (OSError, RuntimeError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].replace(
            os.path.dirname(os.path.dirname(spec.origin)) + os.sep, ""
        )
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_OPS_SHIM = lib
    return (
        "torchvision's C++ ops did not load against the CPU torch (PyPI's torchvision wheel is "
        f"built for CUDA torch: `{reason[:160]}`); the script declared the `torchvision::nms`/`qnms` "
        "schemas so the pure-Python classifiers import. No torchvision C++ op runs in these models."
    )


# --- models and data -------------------------------------------------------------------------


class Cell:
    """One (model, shape, B): the module, its inputs and labels, and how its loss is computed."""

    def __init__(self, name, spec, b, model, inputs, labels, kind, notes, bn_model=None, opacus_inputs=None):
        self.name, self.spec, self.b = name, spec, b
        self.model = model  # eval(), used by the plain step and torch.func
        self.inputs = inputs  # keyword arguments of the forward call, as a user writes it
        self.opacus_inputs = opacus_inputs or inputs  # what Opacus's hooks need (see build_text)
        self.labels = labels
        self.kind = kind  # "lm" or "cls"
        self.notes = notes
        self.bn_model = bn_model  # vision: the model before ModuleValidator.fix (train())


def parse_spec(spec: str):
    """``name`` or ``name@N`` -> (name, N or None)."""
    name, _, size = spec.partition("@")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    return name, int(size) if size else None


def no_dropout_configs():
    return dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)


def text_preflight(model, inputs, opacus_inputs, labels, kind):
    """Why the text models' inputs differ between methods, found on the first 2 examples and 16 tokens.

    torch.func gets the forward call a user writes (``input_ids`` only); Opacus
    gets ``position_ids`` as a [B, T] tensor. Returns notes on what happens
    otherwise: torch.func given [B, T] ``position_ids``, and Opacus's hooks
    given the default positions (a [1, T] lookup).
    """
    import torch
    from opacus import GradSampleModule
    from torch.func import functional_call, grad, vmap

    cut = {k: (v[:2, :16] if torch.is_tensor(v) else v) for k, v in opacus_inputs.items()}
    plain_cut = {k: v for k, v in cut.items() if k in inputs}
    y = labels[:2, :16] if kind == "lm" else labels[:2]
    cell = Cell("preflight", "preflight", 2, model, plain_cut, y, kind, [])
    notes = []
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss_one(p, xi, yi):
        out = functional_call(
            model, p, args=(), kwargs={k: (v.unsqueeze(0) if torch.is_tensor(v) else v) for k, v in xi.items()}
        )
        return per_example_loss(cell, logits_of(out), yi.unsqueeze(0))[0]

    tensors = {k: v for k, v in cut.items() if torch.is_tensor(v)}
    try:
        vmap(grad(loss_one), in_dims=(None, 0, 0))(params, tensors, y)
        notes.append("torch.func also runs with the [B, T] `position_ids` passed in")
    except Exception as e:  # noqa: BLE001 - reported
        notes.append(
            f"torch.func with the [B, T] `position_ids` passed in is refused: `{first_line(e)[:240]}` "
            "(transformers' packed-sequence detection branches on the ids), so torch.func and the "
            "plain step get the forward call without them"
        )
    gsm = GradSampleModule(copy.deepcopy(model), batch_first=True, loss_reduction="sum").train()
    try:
        per_example_loss(cell, logits_of(gsm(**plain_cut)), y).sum().backward()
        shapes = {
            n: tuple(p.grad_sample.shape)
            for n, p in gsm._module.named_parameters()
            if getattr(p, "grad_sample", None) is not None and p.grad_sample.shape[0] != 2
        }
        if shapes:
            notes.append(
                "Opacus hooks without `position_ids` raise nothing but return grad_sample with a "
                "batch dimension of 1 (the batch's sum, not per example) for "
                + ", ".join(f"`{n}` {s}" for n, s in shapes.items())
                + ", so `position_ids` is passed to Opacus as a [B, T] tensor by hand"
            )
        else:
            notes.append("Opacus hooks without `position_ids` gave per-example shapes everywhere")
    except Exception as e:  # noqa: BLE001 - reported
        notes.append(
            f"Opacus hooks without `position_ids` are refused: `{first_line(e)[:240]}`; "
            "`position_ids` is passed to Opacus as a [B, T] tensor by hand"
        )
    return notes


def build_text(name: str, t: int, b: int, rng):
    import numpy as np
    import torch
    import transformers

    torch.manual_seed(0)
    notes = []
    if name.startswith("gpt2"):
        cfg = transformers.GPT2Config(
            **GPT2_CFG,
            **no_dropout_configs(),
            use_cache=False,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = transformers.GPT2LMHeadModel(cfg)
        tied = model.lm_head.weight is model.transformer.wte.weight
        notes.append(
            f"{name}: lm_head.weight is transformer.wte.weight: {tied}; "
            f"attention implementation `{model.config._attn_implementation}`"
        )
        ids = torch.from_numpy(rng.integers(0, GPT2_CFG["vocab_size"], (b, t)).astype(np.int64))
        inputs = {"input_ids": ids, "use_cache": False}
        labels = ids
        kind = "lm"
        if name == "gpt2-lora":
            import peft

            lcfg = peft.LoraConfig(
                r=LORA_RANK,
                lora_alpha=16,
                lora_dropout=0.0,
                target_modules=["c_attn", "c_proj", "c_fc"],
                fan_in_fan_out=True,
            )
            model = peft.get_peft_model(model, lcfg)
            notes.append(
                f"{name}: peft {peft.__version__} LoRA r={LORA_RANK} on c_attn, c_proj, c_fc "
                "(GPT-2's transformers Conv1D, fan_in_fan_out=True); only the adapters train. As peft "
                "initialises lora_B to zero, the lora_A gradients are zero at this point; "
                "the computation is the same as later in training"
            )
    else:  # bert
        cfg = transformers.BertConfig(**BERT_CFG, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertForSequenceClassification(cfg)
        notes.append(f"{name}: attention implementation `{model.config._attn_implementation}`")
        ids = torch.from_numpy(rng.integers(0, BERT_CFG["vocab_size"], (b, t)).astype(np.int64))
        inputs = {"input_ids": ids}
        labels = torch.from_numpy(rng.integers(0, 2, b).astype(np.int64))
        kind = "cls"
    opacus_inputs = {**inputs, "position_ids": torch.arange(t).expand(b, t).contiguous()}
    model.eval()
    notes += [f"{name}: {n}" for n in text_preflight(model, inputs, opacus_inputs, labels, kind)]
    return model, inputs, labels, kind, notes, opacus_inputs


def build_vision(name: str, size: int, b: int, rng):
    import numpy as np
    import torch
    import torchvision.models as tvm
    from opacus.validators import ModuleValidator

    torch.manual_seed(0)
    kwargs = dict(weights=None, num_classes=N_CLASSES_VISION)
    if name in ("mobilenet_v2", "efficientnet_b0"):
        kwargs["dropout"] = 0.0
    if name in ("efficientnet_b0", "convnext_tiny"):
        kwargs["stochastic_depth_prob"] = 0.0
    original = getattr(tvm, name)(**kwargs)
    errors = ModuleValidator.validate(original, strict=False)
    fixed = ModuleValidator.fix(copy.deepcopy(original))
    after = ModuleValidator.validate(fixed, strict=False)

    def census(m):
        counts = {}
        for mod in m.modules():
            k = type(mod).__name__
            if re.search(r"Norm(\d+d)?$", k):
                counts[k] = counts.get(k, 0) + 1
        return ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no norm layers"

    kinds = sorted({(str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:120] for e in errors})
    notes = [
        f"{name}: ModuleValidator.validate: {len(errors)} error(s) before fix "
        f"({'; '.join(kinds) if kinds else 'none'}), {len(after)} after. Norm layers before fix: "
        f"{census(original)}; after fix: {census(fixed)}"
    ]
    x = torch.from_numpy(rng.standard_normal((b, 3, size, size), "float32")).contiguous()
    y = torch.from_numpy(rng.integers(0, N_CLASSES_VISION, b).astype(np.int64))
    strided = noncontiguous_conv_inputs(fixed, x[:2])
    if strided:
        notes.append(
            f"{name}: {len(strided)} Conv2d layer(s) receive a non-contiguous input "
            f"({', '.join(strided[:4])}{', ...' if len(strided) > 4 else ''}: "
            "channels_last strides, the output of a permute); see the Opacus check below"
        )
    inplace = [m for m in fixed.modules() if getattr(m, "inplace", False) is True]
    if inplace:
        notes.append(f"{name}: {vision_preflight(fixed, x[:2], y[:2], inplace)}")
    return fixed, {"x": x}, y, "cls", notes, original


def noncontiguous_conv_inputs(model, x):
    """Names of the Conv2d layers whose input is not a contiguous NCHW tensor (one forward)."""
    import torch

    found, handles = [], []
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d):
            handles.append(
                m.register_forward_pre_hook(
                    lambda mod, inp, n=n: found.append(n) if not inp[0].is_contiguous() else None
                )
            )
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return found


def vision_preflight(fixed, x, y, inplace):
    """Opacus on the model as ``ModuleValidator.fix`` left it; then turn in-place activations off.

    Opacus wraps each layer's output in a backward hook; an in-place
    activation right after it (``ReLU(inplace=True)``, ``ReLU6``, ``SiLU``)
    is refused by autograd. Setting ``inplace=False`` is a one-line user fix;
    it is applied to the model every method runs (the plain step included).
    """
    import torch.nn.functional as F
    from opacus import GradSampleModule

    def attempt():
        try:
            gsm = GradSampleModule(copy.deepcopy(fixed), batch_first=True, loss_reduction="sum").train()
            F.cross_entropy(gsm(x), y, reduction="sum").backward()
            return None
        except Exception as e:  # noqa: BLE001 - reported
            return f"`{first_line(e)[:200]}` at {where(e)}"

    before = attempt()
    kinds = sorted({type(m).__name__ for m in inplace})
    for m in inplace:
        m.inplace = False
    after = attempt()
    return (
        (
            f"Opacus hooks refused the fixed model: {before}. "
            if before
            else "Opacus hooks accepted the fixed model with its in-place activations. "
        )
        + f"The script set inplace=False on its {len(inplace)} in-place modules ({', '.join(kinds)}), "
        "for every method; " + (f"Opacus still refused it: {after}" if after else "then Opacus ran")
    )


def where(e: BaseException) -> str:
    """``file:line `code``` of the innermost frame of ``e``'s traceback outside torch itself."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if f"{os.sep}torch{os.sep}" not in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    path = f.filename.split(f"site-packages{os.sep}")[-1]
    return f"{path}:{f.lineno} `{(f.line or '').strip()}`"


def build_cell(spec: str, t_or_size: int, b: int) -> Cell:
    import numpy as np

    name, _ = parse_spec(spec)
    rng = np.random.default_rng(1)
    if name in TEXT_MODELS:
        model, inputs, labels, kind, notes, opacus_inputs = build_text(name, t_or_size, b, rng)
        bn = None
    else:
        model, inputs, labels, kind, notes, bn = build_vision(name, t_or_size, b, rng)
        bn.train()
        opacus_inputs = None
    model.eval()
    return Cell(name, spec, b, model, inputs, labels, kind, notes, bn, opacus_inputs)


def logits_of(out):
    return out if hasattr(out, "dim") else out.logits


def per_example_loss(cell: Cell, logits, labels):
    """[B] losses: cross-entropy per example (for the LM, the mean over its T-1 next-token positions)."""
    import torch.nn.functional as F

    if cell.kind == "lm":
        b, t, v = logits.shape
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1), reduction="none")
        return ce.reshape(b, t - 1).mean(dim=1)
    return F.cross_entropy(logits, labels, reduction="none")


# --- methods ---------------------------------------------------------------------------------


def global_norms(per_example):
    sq = None
    for g in per_example:
        s = g.reshape(g.shape[0], -1).pow(2).sum(dim=1)
        sq = s if sq is None else sq + s
    return sq.sqrt()


def clip_and_sum(per_example, norms):
    """``sum_i g_i * C / max(||g_i||, C)``, as ``per_example_grads.clip_by_global_norm`` then a sum."""
    import torch

    factors = C.CLIP_NORM / torch.clamp(norms, min=C.CLIP_NORM)
    return [torch.tensordot(factors, g, dims=1) for g in per_example]


def wrong_grad_samples(o_params, names, ref_first) -> str:
    """Parameters whose Opacus grad_sample (examples 0-1) is off the loop's by > GRAD_SAMPLE_TOL relative."""
    import torch

    bad = []
    for k, (n, p) in enumerate(zip(names, o_params)):
        r = torch.stack([g[k] for g in ref_first])
        gs = getattr(p, "grad_sample", None)
        if gs is None or gs.shape[1:] != r.shape[1:] or gs.shape[0] < 2:
            bad.append(f"`{n}` (grad_sample {None if gs is None else tuple(gs.shape)})")
            continue
        d = float((gs[:2] - r).abs().max() / r.abs().max().clamp(min=1e-30))
        if d > GRAD_SAMPLE_TOL:
            bad.append(f"`{n}` ({d:.2g})")
    return ", ".join(bad) if bad else "none"


def opacus_coverage(model) -> str:
    """Which of the model's trainable layer types Opacus 1.6 has a grad sampler / ghost norm sampler for."""
    from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping

    counts = {}
    for m in model.modules():
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            counts[type(m)] = counts.get(type(m), 0) + 1

    def fmt(types):
        return ", ".join(f"{t.__name__} x{counts[t]}" for t in sorted(types, key=lambda t: t.__name__)) or "none"

    native = [t for t in counts if t in GradSampleModule.GRAD_SAMPLERS]
    fallback = [t for t in counts if t not in GradSampleModule.GRAD_SAMPLERS]
    ghost = [t for t in counts if t in GradSampleModuleFastGradientClipping.NORM_SAMPLERS]
    return (
        f"layers with trainable parameters: Opacus grad sampler for {fmt(native)}; functorch fallback "
        f"for {fmt(fallback)}; ghost-clipped (norm sampler) {fmt(ghost)}"
    )


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


def guarded(fn, errors: dict, key):
    """``fn`` that remembers the first line of the first exception it raises under ``errors[key]``."""

    def g():
        try:
            return fn()
        except Exception as e:
            errors.setdefault(key, first_line(e))
            raise

    return g


def refused(exc: BaseException):
    def fn(*_args, **_kwargs):
        raise exc

    return fn


def make_tasks(cell: Cell, methods, norms_for, log):
    """Tasks of one cell, its notes, and its correctness check."""
    import torch
    from torch.func import functional_call, grad, vmap

    model, inputs, labels = cell.model, cell.inputs, cell.labels
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in params)
    n_all = sum(p.numel() for p in model.parameters())
    notes = list(cell.notes)
    notes.append(f"{cell.name}: {n_all:,} parameters, {n_train:,} trainable")
    if "opacus" in methods or "opacus ghost" in methods:
        notes.append(f"{cell.name}: {opacus_coverage(model)}")
    tasks, results, errors = [], {}, {}

    def add(peer, q, fn):
        if q == "norms" and peer not in norms_for:
            return
        tasks.append(C.Task(peer, q, guarded(fn, errors, (peer, q))))

    def plain():
        loss = per_example_loss(cell, logits_of(model(**inputs)), labels).mean()
        return torch.autograd.grad(loss, params)

    add("torch", "plain", plain)
    if cell.bn_model is not None:
        bn_params = [p for p in cell.bn_model.parameters() if p.requires_grad]

        def plain_bn():
            loss = per_example_loss(cell, logits_of(cell.bn_model(**inputs)), labels).mean()
            return torch.autograd.grad(loss, bn_params)

        add("torch, BatchNorm model before fix", "plain", plain_bn)

    if "torch.func" in methods:
        train_p = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        frozen.update({n: bt for n, bt in model.named_buffers()})
        batched = {k: v for k, v in inputs.items() if torch.is_tensor(v)}
        static = {k: v for k, v in inputs.items() if not torch.is_tensor(v)}

        def loss_one(p, xi, yi):
            one = {k: v.unsqueeze(0) for k, v in xi.items()}
            out = functional_call(model, (p, frozen), args=(), kwargs={**one, **static})
            return per_example_loss(cell, logits_of(out), yi.unsqueeze(0))[0]

        per_ex = vmap(grad(loss_one), in_dims=(None, 0, 0))

        def func_grads():
            g = per_ex(train_p, batched, labels)
            return [g[n] for n in names]

        def func_norms():
            return global_norms(func_grads())

        def func_both():
            g = func_grads()
            n = global_norms(g)
            return n, clip_and_sum(g, n)

        add("torch.func", "norms", func_norms)
        add("torch.func", "clipped", lambda: func_both()[1])
        results["torch.func"] = (func_both, func_norms)

    if "opacus" in methods:
        try:
            from opacus import GradSampleModule

            gsm = GradSampleModule(copy.deepcopy(model), batch_first=True, loss_reduction="sum")
            gsm.train()
            o_params = [p for p in gsm._module.parameters() if p.requires_grad]

            def op_grads():
                gsm.zero_grad(set_to_none=True)  # also drops the previous grad_sample
                loss = per_example_loss(cell, logits_of(gsm(**cell.opacus_inputs)), labels).sum()
                loss.backward()
                return [p.grad_sample for p in o_params]

            def release():
                # grad_sample stays on the parameters after a call; drop it inside the timed
                # call (as every result is freed before the clock stops), so that it does not
                # sit in memory while the other methods run.
                gsm.zero_grad(set_to_none=True)

            def op_norms():
                n = global_norms(op_grads())
                release()
                return n

            def op_both(keep=False):
                g = op_grads()
                n = global_norms(g)
                out = n, clip_and_sum(g, n)
                del g
                if not keep:
                    release()
                return out

        except Exception as e:  # noqa: BLE001 - a refusal is a result
            op_norms = op_both = refused(e)
        add("opacus", "norms", op_norms)
        add("opacus", "clipped", lambda: op_both()[1])
        results["opacus"] = (op_both, op_norms)

    if "opacus ghost" in methods:
        try:
            from opacus.grad_sample import GradSampleModuleFastGradientClipping
            from opacus.optimizers import DPOptimizerFastGradientClipping
            from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

            ghost = GradSampleModuleFastGradientClipping(
                copy.deepcopy(model),
                batch_first=True,
                loss_reduction="mean",
                max_grad_norm=C.CLIP_NORM,
                use_ghost_clipping=True,
            )
            ghost.train()
            g_params = [p for p in ghost._module.parameters() if p.requires_grad]
            opt = DPOptimizerFastGradientClipping(
                torch.optim.SGD(g_params, lr=0.0),
                noise_multiplier=0.0,
                max_grad_norm=C.CLIP_NORM,
                expected_batch_size=cell.b,
                loss_reduction="mean",
            )
            criterion = torch.nn.CrossEntropyLoss(reduction="mean")
            dp_loss = DPLossFastGradientClipping(ghost, opt, criterion, loss_reduction="mean")

            def ghost_norms():
                opt.zero_grad(set_to_none=True)
                loss = per_example_loss(cell, logits_of(ghost(**cell.opacus_inputs)), labels).mean()
                loss.backward()
                return ghost.get_norm_sample()

            def ghost_clipped():
                opt.zero_grad(set_to_none=True)
                logits = logits_of(ghost(**cell.opacus_inputs))
                if cell.kind == "lm":
                    b, t, v = logits.shape
                    loss = dp_loss(logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1), shape=(b, t - 1, v))
                else:
                    loss = dp_loss(logits, labels)
                loss.backward()  # both backward passes; p.grad is the clipped sum
                return [p.grad for p in g_params]

            def ghost_both():
                c = ghost_clipped()
                return ghost.per_sample_gradient_norms, c  # set by the backward's get_clipping_coef

        except Exception as e:  # noqa: BLE001 - a refusal is a result
            ghost_norms = ghost_clipped = ghost_both = refused(e)
        add("opacus ghost", "norms", ghost_norms)
        add("opacus ghost", "clipped", ghost_clipped)
        results["opacus ghost"] = (ghost_both, ghost_norms)

    def check():
        """Each method's norms and clipped sum against a loop of single-example gradients."""
        ref_norms, ref_sum, ref_first = [], None, []
        for i in range(cell.b):
            one = {k: (v[i : i + 1] if torch.is_tensor(v) else v) for k, v in inputs.items()}
            loss = per_example_loss(cell, logits_of(model(**one)), labels[i : i + 1])[0]
            g = torch.autograd.grad(loss, params)
            if i < 2:
                ref_first.append(g)
            n = float(torch.sqrt(sum(x.pow(2).sum() for x in g)))
            ref_norms.append(n)
            f = C.CLIP_NORM / max(n, C.CLIP_NORM)
            ref_sum = [f * x for x in g] if ref_sum is None else [s + f * x for s, x in zip(ref_sum, g)]
        ref_norms_t = torch.tensor(ref_norms)
        scale = max(float(s.abs().max()) for s in ref_sum)
        lines = [
            f"{cell.spec} B={cell.b}: per-example gradient norms (loop over examples) "
            f"min {min(ref_norms):.3g}, median {statistics.median(ref_norms):.3g}, max {max(ref_norms):.3g}"
        ]
        for peer, (fn_both, fn_norms) in results.items():
            try:
                nrm, cs = fn_both(keep=True) if peer == "opacus" else fn_both()
                nrm = nrm.detach().reshape(-1)
                dn = float(((nrm - ref_norms_t).abs() / ref_norms_t).max())
                if peer in norms_for:  # the norms-alone task too, when it was timed
                    if peer == "opacus":
                        o_sample = [None if p.grad_sample is None else p.grad_sample.clone() for p in o_params]
                    nrm2 = fn_norms().detach().reshape(-1)
                    dn = max(dn, float(((nrm2 - ref_norms_t).abs() / ref_norms_t).max()))
                    if peer == "opacus":  # keep the grad_sample of fn_both for the diagnosis below
                        for p, gs in zip(o_params, o_sample):
                            p.grad_sample = gs
                cs = [x.detach() for x in cs]
                ds = max(float((u - v).abs().max()) for u, v in zip(cs, ref_sum)) / scale
                ok = dn < NORMS_TOL and ds < SUM_TOL
                lines.append(
                    f"{cell.spec} B={cell.b} {peer}: norms max rel diff {dn:.1e}, clipped sum "
                    f"max abs diff / max abs {ds:.1e} vs the loop ({'ok' if ok else 'MISMATCH'})"
                )
                if not ok:
                    log(f"  CHECK FAILED: {lines[-1]}")
                    if peer == "opacus":
                        lines.append(
                            f"{cell.spec} B={cell.b} opacus: parameters whose grad_sample differs from "
                            f"the loop's on examples 0-1: {wrong_grad_samples(o_params, names, ref_first)}"
                        )
                if peer == "opacus":
                    release()
            except Exception as e:  # noqa: BLE001
                lines.append(f"{cell.spec} B={cell.b} {peer}: not checked ({first_line(e)})")
        return lines

    return tasks, notes, check, errors


# --- report ----------------------------------------------------------------------------------


class ModelsReport:
    def __init__(self, args, versions, notes):
        self.args, self.versions, self.notes = args, versions, list(notes)
        self.sections = []  # (title, rows, cell notes)
        self.summary = []
        self.started = time.time()
        self.load_start = C.loadavg()

    def add(self, cell: Cell, shape: str, tasks, cell_notes, errors):
        base = next((t for t in tasks if t.peer == "torch" and t.quantity == "plain"), None)
        base_med = statistics.median(base.times) if base and base.times else None
        rows, by = [], {}
        for t in tasks:
            if t.status.startswith("error") and (t.peer, t.quantity) in errors:
                t.status = "error: " + errors[(t.peer, t.quantity)]
            if t.times:
                med = statistics.median(t.times)
                lo, hi = C.quartiles(t.times)
                med_s = f"{med * 1e3:.1f}" + (f" ({len(t.times)} runs)" if t.status else "")
                ratio = f"{med / base_med:.2f}" if base_med else "n/a"
                iqr = f"{lo * 1e3:.1f}-{hi * 1e3:.1f}"
            else:
                med_s, ratio, iqr = "—", "—", "—"
            status = t.status or "ok"
            if t.first_s is not None:
                status += f"; first call {t.first_s * 1e3:.0f} ms"
            rows.append([t.peer, QUANTITY_LABELS[t.quantity], med_s, ratio, iqr, status])
            by[(t.peer, t.quantity)] = (med_s, ratio, t.status)
        self.sections.append((f"{cell.spec} {shape} B={cell.b}", rows, cell_notes))

        wrong = {
            p
            for p in METHODS
            for line in cell_notes
            if line.startswith(f"{cell.spec} B={cell.b} {p}: norms") and "MISMATCH" in line
        }

        def short(peer, q):
            if (peer, q) not in by:
                return "—"
            med_s, ratio, status = by[(peer, q)]
            if status.startswith("error"):
                return "refused"
            if status and ratio != "—":
                ratio = f"{ratio} ({status.split(' (')[0]})"
            elif ratio == "—":
                ratio = status.split(";")[0]
            return ratio + (" **wrong**" if peer in wrong else "")

        plain_ms = by.get(("torch", "plain"), ("—",))[0]
        self.summary.append(
            [cell.spec, shape, str(cell.b), plain_ms]
            + [short(p, "clipped") for p in self.args.methods]
            + [short(p, "norms") for p in self.args.norms if p in self.args.methods]
        )

    def render(self) -> str:
        import platform
        import shlex

        a = self.args
        cmd = " ".join(shlex.quote(x) for x in [os.path.relpath(sys.executable)] + sys.argv)
        lines = [
            "# Peer benchmark on model families: PyTorch (torch.func, Opacus hooks, Opacus ghost clipping)",
            "",
            f"- command: `{cmd}`",
            f"- date: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}",
            f"- wall time of this run: {time.time() - self.started:.0f} s",
            f"- load average (1 min) at start {self.load_start}, at end {C.loadavg()} "
            "(other processes share the CPUs; compare ratios, not milliseconds)",
            f"- machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
            f"os.cpu_count()={os.cpu_count()}",
            "- versions: " + ", ".join(f"{k} {v}" for k, v in self.versions.items()),
            f"- {a.repeats} timed repeats (median), {a.warmup} warm-up call(s), round-robin in one "
            f"process per cell, cap {a.max_seconds_per_call:.0f} s per call",
            "- quantities: plain step = forward + backward of the mean loss (the baseline of every ratio "
            "in its cell); norms = per-example global L2 gradient norms; clipped sum = "
            "sum_i g_i * min(1, C/||g_i||), C = 1 (the DP-SGD gradient before noise). "
            "Loss per example: cross-entropy (GPT-2: mean over its T-1 next-token positions).",
            "",
            "## Summary: ratio to the plain step",
            "",
        ]
        lines += C.markdown_table(
            ["model", "shape", "B", "plain ms"]
            + [f"{m} clipped sum" for m in a.methods]
            + [f"{m} norms" for m in a.norms if m in a.methods],
            self.summary,
        )
        lines += [
            "",
            "refused: the method raised (the cell's table gives the first line of the error); "
            "**wrong**: it ran, but its norms or clipped sum differ from a loop over single "
            "examples (the cell's notes say by how much and where).",
        ]
        for title, rows, cell_notes in self.sections:
            lines += ["", f"## {title}", ""]
            lines += C.markdown_table(["method", "quantity", "median ms", "ratio to plain", "IQR ms", "status"], rows)
            if cell_notes:
                lines += [""] + [f"- {n}" for n in cell_notes]
        return C.with_notes(lines, self.notes)

    def save(self, final: bool = False) -> str:
        """Write the report so far to --out (after every cell, so a crash keeps the finished cells)."""
        text = self.render()
        if not final:
            text = text.replace(
                "\n## Summary", "\n**Partial: the run is still going or stopped early.**\n\n## Summary", 1
            )
        if self.args.out:
            os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
            with open(self.args.out, "w") as f:
                f.write(text)
        return text

    def emit(self):
        text = self.save(final=True)
        sys.stdout.write("\n" + text)
        sys.stdout.flush()
        if self.args.out:
            C.log(f"[written to {self.args.out}]")


# --- main ------------------------------------------------------------------------------------


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help="comma list of %s; a vision model may be NAME@224 for 224x224 inputs" % ",".join(MODELS),
    )
    p.add_argument(
        "--batch-sizes",
        default=None,
        help="comma list for every model (default: 8,32 for text, 32 for 32x32 images, 8 for 224x224)",
    )
    p.add_argument(
        "--seq-lens", default=None, help="comma list of T for the text models (default: GPT-2 64,128; BERT 64)"
    )
    p.add_argument("--methods", default=",".join(METHODS), help="comma list of %s" % ",".join(METHODS))
    p.add_argument(
        "--norms",
        default=",".join(METHODS),
        help="comma list of the methods whose norms alone are also timed, or 'none' (default: all)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed calls per task (default 5; --quick: 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per task first (default 1)")
    p.add_argument(
        "--max-seconds-per-call",
        type=float,
        default=60.0,
        help="a task whose call takes longer stops being timed and is marked '> cap'",
    )
    p.add_argument("--threads", type=int, default=2, help="CPUs to pin to and torch.set_num_threads (default 2)")
    p.add_argument("--no-check", action="store_true", help="skip the check against a loop over examples")
    p.add_argument("--quick", action="store_true", help="smoke run: B=2, T=16, 1 repeat")
    p.add_argument("--out", default=None, help="also write the Markdown report to this file")
    a = p.parse_args()
    if a.quick:
        a.batch_sizes = a.batch_sizes or "2"
        a.seq_lens = a.seq_lens or "16"
        a.repeats = a.repeats if a.repeats is not None else 1
    a.repeats = a.repeats if a.repeats is not None else 5
    a.models = [m for m in a.models.split(",") if m]
    for m in a.models:
        try:
            parse_spec(m)
        except ValueError as e:
            p.error(str(e))
    a.methods = [m for m in a.methods.split(",") if m]
    for m in a.methods:
        if m not in METHODS:
            p.error(f"unknown method {m!r}; choose from {METHODS}")
    a.norms = [m for m in a.norms.split(",") if m and m != "none"]
    for m in a.norms:
        if m not in METHODS:
            p.error(f"unknown method {m!r} in --norms; choose from {METHODS}")
    a.batch_sizes = [int(s) for s in a.batch_sizes.split(",")] if a.batch_sizes else None
    a.seq_lens = [int(s) for s in a.seq_lens.split(",")] if a.seq_lens else None
    return a


def cells_of(args):
    """(spec, shape label, T or image size, B) for every cell to run."""
    out = []
    for spec in args.models:
        name, size = parse_spec(spec)
        if name in TEXT_MODELS:
            for t in args.seq_lens or ([size] if size else DEFAULT_T[name]):
                for b in args.batch_sizes or DEFAULT_B[name]:
                    out.append((spec, f"T={t}", t, b))
        else:
            side = size or 32
            for b in args.batch_sizes or DEFAULT_B_VISION.get(side, (8,)):
                out.append((spec, f"{side}x{side}x3", side, b))
    return out


def main() -> int:
    args = parse_args()
    cpus = C.pin_cpus(args.threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see README "Threads"
    import logging
    import warnings

    import numpy
    import torch

    torch.set_num_threads(max(1, args.threads))
    shim_note = torchvision_cpu_shim()  # before transformers or torchvision is imported
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message=".*non-full backward hook.*")
    import opacus
    import torchvision
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("opacus").setLevel(logging.WARNING)
    versions = {
        "python": sys.version.split()[0],
        "CPUs": cpus,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "transformers": transformers.__version__,
        "opacus": opacus.__version__,
        "numpy": numpy.__version__,
        "OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"],
        "torch threads": f"{torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op",
    }
    try:
        import peft

        versions["peft"] = peft.__version__
    except Exception as e:  # noqa: BLE001
        if any(parse_spec(m)[0] == "gpt2-lora" for m in args.models):
            C.log(f"peft unavailable ({first_line(e)}): skipping gpt2-lora")
            args.models = [m for m in args.models if parse_spec(m)[0] != "gpt2-lora"]
    C.log("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    notes = [
        "Every model runs in float32 on the CPU, eagerly (no torch.compile). The plain step and "
        "torch.func use the module in eval(), Opacus its deep copies in train(); with dropout and "
        "stochastic depth at 0 and no BatchNorm left these compute the same function.",
        "Opacus hooks use loss_reduction='sum' over the per-example losses; ghost clipping uses "
        "loss_reduction='mean' with DPLossFastGradientClipping (for GPT-2 given shape=(B, T-1, V), "
        "so that its per-example loss is the mean over positions, as here). The ghost clipped sum "
        "is p.grad after the wrapped loss's backward(), before the optimizer's step.",
        f"Check: after timing, each method's norms and clipped sum are compared with a loop of "
        f"single-example gradients (float32); 'ok' means norms within {NORMS_TOL:g} relative and the "
        f"clipped sum within {SUM_TOL:g} of its largest entry, else MISMATCH.",
        "Each cell lists its layer types with trainable parameters by how Opacus handles them: a "
        "type without an Opacus grad sampler (transformers' Conv1D in GPT-2, torchvision's "
        "LayerNorm2d and CNBlock, which holds a bare layer_scale parameter, in ConvNeXt) goes "
        "through Opacus's functorch per-layer fallback; under ghost clipping only the types with a "
        "norm sampler (nn.Linear, nn.Embedding in Opacus 1.6) are ghost-clipped, the others get "
        "per-example gradients then norms (its 'fast gradient clipping').",
    ]
    if shim_note:
        notes.append(shim_note)
    report = ModelsReport(args, versions, notes)
    for spec, shape, size, b in cells_of(args):
        C.log(f"== {spec} {shape} B={b}")
        try:
            cell = build_cell(spec, size, b)
            tasks, cell_notes, check, errors = make_tasks(cell, args.methods, args.norms, C.log)
        except Exception as e:  # noqa: BLE001 - the model itself could not be built
            report.notes.append(f"{spec} {shape} B={b}: not built ({first_line(e)})")
            C.log(f"  not built: {first_line(e)}")
            continue
        C.run_round_robin(tasks, args.repeats, args.warmup, args.max_seconds_per_call, C.log)
        if not args.no_check:
            try:
                cell_notes += check()
            except Exception as e:  # noqa: BLE001 - reported, the timings stand
                cell_notes.append(f"{spec} B={b}: check raised {first_line(e)}")
        for (peer, q), msg in errors.items():
            C.log(f"  {peer} {q}: {msg}")
        report.add(cell, shape, tasks, cell_notes, errors)
        report.save()
        del tasks, check, cell
        gc.collect()
    report.emit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
