"""Text a trained language model writes: the continuation of a prompt, read from a run's results
folder (its resolved ``config.yaml`` and its final model, ``model.safetensors``)."""

from __future__ import annotations

from pathlib import Path

from meshlearn.config import make_config, read_config_file
from meshlearn.errors import UserInputError
from meshlearn.models import MODEL_FILE, build_model, load_weights
from meshlearn.plugins import load_folder_module

TEXT_DATASETS = ("pystdlib", "text")  # runs whose model file may predate its vocabulary record: bytes


def continue_text(results: str | Path, prompt: str, tokens: int = 200, temperature: float = 0.8,
                  seed: int = 0, models_module: str | Path | None = None) -> str:
    """``tokens`` tokens the run's model writes after ``prompt``, one at a time, each drawn from its
    next-token distribution at ``temperature`` (below 0.001: always the likeliest), seeded by ``seed``;
    decoded with the vocabulary its model file records (bytes as UTF-8, a broken character shown as
    U+FFFD). A run whose config names a models module is read only where ``models_module`` (the
    user's ``--models-module``) is that file (``plugins.load_folder_module``)."""
    import torch
    from safetensors import safe_open

    from meshlearn.data.vocabulary import METADATA_KEY, Vocabulary

    folder = Path(results)
    config_file, weights = folder / "config.yaml", folder / MODEL_FILE
    if not config_file.is_file() or not weights.is_file():
        raise UserInputError(f"{folder} holds no finished run's config.yaml and {MODEL_FILE}: give the results folder "
                             "of a language-model run (meshlearn simulate --dataset pystdlib --model gpt-tiny ...)")
    config = make_config(read_config_file(config_file))
    try:
        with safe_open(str(weights), "pt") as handle:
            metadata = handle.metadata() or {}
    except Exception as exc:  # safetensors raises its own errors for a damaged header
        raise UserInputError(f"{weights} is not a readable safetensors file: {exc}") from None
    if METADATA_KEY not in metadata and config.dataset.partition(":")[0] not in TEXT_DATASETS and \
            config.task != "language-model":
        raise UserInputError(f"the run in {folder} trained {config.model} on {config.dataset}, not a language model on "
                             "text: sample needs a run on pystdlib, text:PATH or LEAF's Shakespeare")
    vocabulary = Vocabulary.from_metadata(metadata)
    if tokens < 1 or temperature < 0:
        raise UserInputError("give --tokens of at least 1 and a --temperature of 0 or more")
    load_folder_module(config_file, config.models_module, models_module)
    torch.manual_seed(config.seed)
    model = build_model(config.model, (config.context,), vocabulary.size)
    load_weights(model, str(weights))
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    written = [int(t) for t in vocabulary.encode(prompt or "\n")]
    start = len(written)
    with torch.no_grad():
        for _ in range(tokens):
            window = torch.tensor([written[-config.context:]], dtype=torch.int64)
            scores = model(window)[0, -1]
            if temperature < 1e-3:  # colder than that is the likeliest byte (and softmax would overflow)
                written.append(int(scores.argmax()))
            else:
                written.append(int(torch.multinomial((scores / temperature).softmax(-1), 1, generator=generator)))
    return vocabulary.decode(written[start:])
