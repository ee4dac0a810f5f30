"""Classification: one class label per sample; accuracy and macro precision, recall and F1."""

from __future__ import annotations

from meshlearn.tasks.base import Task, register_task


@register_task
class Classification(Task):
    """Cross-entropy over class labels (the default behaviour, unchanged)."""

    name = "classification"
