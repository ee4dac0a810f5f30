"""A task's result: fetched from the first of its providers that holds a valid one and written
into a folder (``fetch_results``; ``meshlearn results`` asks the bootstrap who ran the task:
``results_of_task``), and said in one line (``summary_line``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from safetensors.torch import load as load_safetensors

from meshlearn.errors import (
    NetworkError,
    RemoteError,
    TaskFailed,
    Unreachable,
    UserInputError,
)
from meshlearn.network.requester.links import BootstrapLink, ProviderLink, Reachable
from meshlearn.network.task.results import write_results
from meshlearn.network.task.spec import TaskSpec

log = logging.getLogger(__name__)
RESULT_TIMEOUT = 30.0  # seconds a provider may take to send the result (the model, up to links.RESULT_BYTES)
TASK_TIMEOUT = 10.0  # seconds the bootstrap may take to say who ran a task (``meshlearn results``)


def fetch_results(task_id: str, peers: Iterable[Reachable], secret: bytes, output: Path,
                  extra: dict | None = None, name: str = "") -> dict | None:
    """Get a task's result from the first provider that holds it; write it, with ``extra``
    metrics, into ``output``, its figure naming it ``name`` (by default ``task TASK_ID``)."""
    link = ProviderLink(secret, task_id)
    for peer in peers:
        try:
            reply, blobs = link.results(peer, timeout=RESULT_TIMEOUT)
        except NetworkError:  # gone, refusing, its connection dropped mid-handshake, or a reply without one model
            continue
        model = bytes(blobs[0])
        try:
            load_safetensors(model)
        except Exception:  # noqa: BLE001 - a corrupt copy: try the next provider
            log.warning("the result from %s is not a valid safetensors model", peer.id)
            continue
        metrics = {**reply.metrics, **(extra or {})}
        metrics["fetched_from"] = peer.id
        task = {"task": reply.task if _is_task_settings(reply.task) else None, "fetched_from": peer.id}
        write_results(output, metrics, model, title=name or f"task {task_id}", task=task)
        return metrics
    return None


def _is_task_settings(value) -> bool:
    """A provider's copy of the task settings is kept only if it looks like them: TaskSpec's keys,
    plain JSON values at most three levels deep (it goes into task.yaml, nothing more)."""
    def plain(item, depth: int) -> bool:
        if isinstance(item, (str, int, float, bool, type(None))):
            return True
        if depth == 0:
            return False
        if isinstance(item, list):
            return len(item) <= 1024 and all(plain(x, depth - 1) for x in item)
        return isinstance(item, dict) and len(item) <= 64 and all(
            isinstance(k, str) and plain(v, depth - 1) for k, v in item.items())
    return isinstance(value, dict) and set(value) <= set(TaskSpec.model_fields) and plain(value, 3)


def results_of_task(task_id: str, bootstrap: str, secret: bytes, output: Path) -> dict:
    """``meshlearn results TASK_ID``: ask the bootstrap who ran the task, fetch the result from any of them."""
    try:
        record = BootstrapLink(bootstrap, secret, task_id).fetch_record(timeout=TASK_TIMEOUT)
    except Unreachable:
        raise UserInputError(f"no bootstrap answers at {bootstrap}: check --bootstrap") from None
    except RemoteError as exc:
        raise UserInputError(str(exc)) from None
    metrics = fetch_results(task_id, record.providers, secret, output)
    if metrics is None:
        raise TaskFailed(f"no provider of task {task_id} holds its result (yet)")
    return metrics


def summary_line(metrics: dict) -> str:
    """One line of a task's result: scores, time, leader, and the providers lost or suspected."""
    scores = f"perplexity {metrics['perplexity']:.3f}  bits per token {metrics['bits_per_token']:.3f}" \
        if "perplexity" in metrics else f"accuracy {metrics['accuracy']:.4f}  F1 {metrics['f1']:.4f}"
    return (f"{scores}  loss {metrics['loss']:.4f}  "
            f"time {metrics['training_time']:.1f} s  leader {metrics['leader']}"
            + (f"  lost: {', '.join(metrics['lost'])}" if metrics.get("lost") else "")
            + (f"  suspected: {', '.join(metrics['suspected'])}" if metrics.get("suspected") else "")
            + (f"  models refused from: {', '.join(metrics['refused_from'])} (not robust: honest ones too)"
               if metrics.get("refused_from") else "")
            + (f"  DP epsilon {metrics['privacy']['epsilon']:.3g} at delta {metrics['privacy']['delta']:g}"
               if metrics.get("privacy") else "")
            + links_summary(metrics.get("links")))


def links_summary(links: object) -> str:
    """The engine links' paths in a few words ("  links: 2 punched, 1 relayed (3.2 MB through the
    relay)"), or "" where every link is direct or nothing was said (``links`` came from providers:
    whatever does not fit is skipped)."""
    if not isinstance(links, dict):
        return ""
    paths: dict[str, int] = {}
    relayed = 0
    for of_provider in links.values():
        for link in of_provider.values() if isinstance(of_provider, dict) else ():
            if isinstance(link, dict) and isinstance(link.get("path"), str):
                paths[link["path"]] = paths.get(link["path"], 0) + 1
                relayed += link.get("relay_bytes", 0) if isinstance(link.get("relay_bytes"), int) else 0
    if set(paths) <= {"direct"}:
        return ""
    counts = ", ".join(f"{count} {path}" for path, count in sorted(paths.items()))
    return f"  links: {counts}" + (f" ({relayed / 1e6:.1f} MB through the relay)" if relayed else "")
