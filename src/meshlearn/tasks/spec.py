"""Task names, checked without torch (configs and flags), and the registry of tasks."""

from __future__ import annotations

from meshlearn.errors import ConfigError
from meshlearn.plugins import Registry

TASK_HELP = ("auto (the dataset's own: classification for images, language-model for text) | classification "
             "(class labels: accuracy, macro P/R/F1) | language-model (the next token: loss, perplexity, bits per "
             "token) | one registered by --models-module")
BUILT_IN = {"classification": "meshlearn.tasks.classification", "language-model": "meshlearn.tasks.language_model"}
TASKS: Registry = Registry("task", ConfigError, built_in=BUILT_IN)


def resolve_task(asked: str, dataset_task: str, dataset: str) -> str:
    """The task a run trains: the one ``asked`` for, or with ``auto`` the dataset's own; ConfigError
    where the dataset cannot serve the task asked for (text for classification, images for a
    language model)."""
    if asked == "auto":
        return dataset_task
    TASKS.check(asked)
    if asked in BUILT_IN and dataset_task in BUILT_IN and asked != dataset_task:
        what = "text (token windows)" if dataset_task == "language-model" else "labelled samples"
        fits = "pystdlib or text:PATH" if asked == "language-model" else "digits, fashion-mnist:DIR, cifar10:PATH, ..."
        raise ConfigError(f"task {asked} cannot learn from dataset {dataset}, which holds {what}: use a dataset "
                          f"such as {fits}, or --task auto")
    return asked
