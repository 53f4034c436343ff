"""A worker computes private gradients, a server applies them: the two share only files of arrays.

The worker holds a copy of the model and the private data; each round it
reads the server's weights, computes one DP-SGD gradient of a Poisson batch
(``peg.dp.private_gradients``: clipped per example, noised on the worker)
and writes it as arrays (``peg.export_gradients``). The server reads each
gradient into its own model (``peg.import_gradients``, matched by position,
checked by shape and dtype), applies it, and accounts the steps it applied
(``peg.dp.PrivacyAccountant``). Only noised gradients leave the worker.

    python examples/parameter_server.py            # 200 rounds: epsilon 1.50, accuracy about 0.90, 10 s on a 2-core CPU
    python examples/parameter_server.py --quick    # 5 rounds, for the tests
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import keras
import numpy as np

import per_example_grads as peg
from per_example_grads.data import load_digits

SIGMA, CLIP, Q, DELTA = 1.1, 1.0, 0.02, 1e-5


def make_model():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])


class Worker:
    def __init__(self, x, y, seed=0):
        self.model, self.x, self.y = make_model(), x, y
        self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.batches = iter(peg.dp.poisson_batches(x, y, sampling_probability=Q, seed=seed).repeat())

    def gradient(self, weights: dict) -> dict:
        self.model.set_weights([weights[f"w{i}"] for i in range(len(weights))])
        xb, yb, mask = next(self.batches)
        grads = peg.dp.private_gradients(
            self.model,
            self.loss,
            xb,
            yb,
            sample_weight=mask,
            l2_norm_clip=CLIP,
            noise_multiplier=SIGMA,
            expected_batch_size=Q * len(self.x),
            seed=None,  # fresh OS-entropy noise for every gradient
        )
        return peg.export_gradients(zip(grads, self.model.trainable_variables))


class Server:
    def __init__(self, num_examples):
        self.model, self.optimizer = make_model(), keras.optimizers.SGD(0.5)
        self.accountant = peg.dp.PrivacyAccountant(SIGMA, Q)
        self.num_examples = num_examples

    def weights(self) -> dict:
        return {f"w{i}": w for i, w in enumerate(self.model.get_weights())}

    def apply(self, arrays: dict) -> None:
        pairs = peg.import_gradients(list(arrays.values()), self.model.trainable_variables, match="position")
        self.optimizer.apply_gradients(pairs)
        self.accountant.step()  # counted when applied: a gradient never applied spends nothing here


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    args = parser.parse_args(argv)
    rounds = 5 if args.quick else args.rounds
    x, y = load_digits()
    keras.utils.set_random_seed(0)
    server, worker = Server(len(x)), Worker(x, y)
    with tempfile.TemporaryDirectory() as exchange:  # stands for a queue, a socket or a shared disk
        folder = pathlib.Path(exchange)
        for r in range(rounds):
            np.savez(folder / "weights.npz", **server.weights())
            with np.load(folder / "weights.npz") as weights:
                np.savez(folder / f"gradient_{r}.npz", **worker.gradient(dict(weights)))
            with np.load(folder / f"gradient_{r}.npz") as gradient:
                server.apply(dict(gradient))
    logits = server.model.predict(x, verbose=0)
    result = {
        "steps": server.accountant.steps,
        "epsilon": server.accountant.epsilon(DELTA),
        "accuracy": float(np.mean(np.argmax(logits, axis=1) == y)),
    }
    print(f"{result['steps']} steps applied, epsilon = {result['epsilon']:.2f}, accuracy = {result['accuracy']:.3f}")
    return result


if __name__ == "__main__":
    main()
