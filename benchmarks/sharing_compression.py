"""Would lossless compression pay on top of the sharing schemes? Compression ratio and speed of
zstd and lz4 on what each scheme sends of a trained model, side by side in one run.

    pip install zstandard lz4
    python benchmarks/sharing_compression.py                 # the digits MLP, trained 300 steps
    python benchmarks/sharing_compression.py --model lenet --dataset cifar10:../shared/datasets/cifar10-jpeg.tar.gz

The model trains with SGD on the dataset first (a fresh model's weights are not what nodes send
for most of a run). A ratio is compressed / raw bytes; speed is raw MB per second of compression.
"""

from __future__ import annotations

import argparse
import time

import torch

from meshlearn.data import load_dataset
from meshlearn.flat import FlatState
from meshlearn.models import build_model
from meshlearn.sharing import make_sharing

SCHEMES = ["full", "topk:0.1", "subsample:0.1", "quantize:8", "choco:0.1"]


def trained_state(model_name: str, dataset_spec: str, steps: int) -> torch.Tensor:
    """The flat state of ``model_name`` after ``steps`` SGD steps on ``dataset_spec``."""
    dataset = load_dataset(dataset_spec)
    torch.manual_seed(0)
    model = build_model(model_name, dataset.input_shape, dataset.num_classes)
    flat = FlatState(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        index = torch.randint(0, len(dataset.train_y), (32,))
        loss = torch.nn.functional.cross_entropy(model(dataset.train_x[index].float()), dataset.train_y[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return flat.state.detach().clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    import lz4.frame
    import zstandard

    state = trained_state(args.model, args.dataset, args.steps)
    codecs = {"zstd-1": zstandard.ZstdCompressor(level=1).compress, "zstd-9": zstandard.ZstdCompressor(level=9).compress,
              "lz4": lz4.frame.compress}
    print(f"{args.model} on {args.dataset}: {state.numel():,} values after {args.steps} steps")
    print("| scheme | tensors' bytes | " + " | ".join(f"{c} ratio | {c} MB/s" for c in codecs) + " |")
    print("|---|---:|" + "---:|---:|" * len(codecs))
    for name in SCHEMES:
        scheme = make_sharing(name, state.numel(), state.dtype, seed=1)
        scheme.start(state * 0.99)  # top-k: the change since the last average is a small one
        payload = b"".join(t.numpy().tobytes() for t in scheme.encode(state, 0, 0).values())
        cells = []
        for compress in codecs.values():
            start = time.perf_counter()
            for _ in range(5):
                packed = compress(payload)
            seconds = (time.perf_counter() - start) / 5
            cells.append(f"{len(packed) / len(payload):.3f} | {len(payload) / seconds / 1e6:.0f}")
        print(f"| {name} | {len(payload):,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
