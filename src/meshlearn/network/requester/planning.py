"""Before any claim: the task's data and its memory per provider, which providers fit it
(docs/network.md, "Choosing providers"), and a task too big for every free provider refused in one line."""

from __future__ import annotations

from collections import Counter

from meshlearn.data import Dataset, load_dataset, partition_dataset, test_samples
from meshlearn.errors import TaskFailed, UserInputError
from meshlearn.network.protocol import rpcs
from meshlearn.network.protocol.bootstrapapi import Discover, ProviderRecord
from meshlearn.network.requester.context import TaskContext
from meshlearn.network.task.resources import estimate_memory, wanted_device
from meshlearn.network.task.spec import dataset_spec

ALL_PROVIDERS = 100_000  # a discover's count that lists every free provider


class Planner:
    """The task's plan (its data, its estimate) and what a provider needs to take it."""

    def __init__(self, ctx: TaskContext):
        self.ctx = ctx

    def plan(self, dataset: Dataset | None) -> Dataset | None:
        """Say the request's warnings; the task's data (``dataset`` if the caller loaded it, else
        read here, unless it is on the providers) and, where it is here, the task's estimate."""
        req = self.ctx.request
        for warning in req.warnings:
            self.ctx.say(f"warning: {warning}")
        if dataset is None and not req.data_on_providers:
            dataset = load_dataset(dataset_spec(req.data), context=req.context, vocabulary=req.vocabulary)
        if dataset is not None:
            self._estimate(dataset)
        return dataset

    def _estimate(self, dataset: Dataset) -> None:
        """The task's peak memory per provider (``estimate``), and a note when the batch is larger
        than a shard (a provider then trains on batches of its whole shard)."""
        from meshlearn.models import build_model

        req = self.ctx.request
        sizes = [len(part) for part in partition_dataset(dataset, req.providers, req.partition, req.seed)]
        smallest, largest = min(sizes), max(sizes)
        if req.batch_size > smallest:
            self.ctx.say(f"note: batch size {req.batch_size} is larger than the smallest of {req.providers} shards "
                         f"({smallest} samples): each provider's batches are cut to its shard's size")
        model = build_model(req.model, dataset.input_shape, dataset.num_classes)
        tests = len(test_samples(dataset, req.eval_samples)[1])
        self.ctx.estimate = estimate_memory(model, tuple(dataset.input_shape), min(req.batch_size, largest), largest,
                                            tests, req.momentum, tokens=dataset.tokens, outer_copies=req.outer.copies)

    def needs(self) -> tuple[float, str]:
        """The least RAM (GB) a provider must declare for this task, and why."""
        req, estimate = self.ctx.request, self.ctx.estimate
        estimated = estimate.gb if estimate is not None else 0.0
        if req.min_ram is not None and req.min_ram >= estimated:
            return req.min_ram, f"--min-ram {req.min_ram:g}"
        return estimated, f"the task needs {estimate.describe()} per provider" if estimate else ""

    def wanted(self, count: int) -> dict:
        """A discover's or claim's fields (``bootstrapapi.Fit``'s and ``count``): the providers this task
        may use (docs/network.md, "Choosing providers")."""
        req = self.ctx.request
        return {"count": count, "device": req.device, "location": req.location, "min_ram_gb": self.needs()[0],
                "min_cores": req.min_cores or 0, "fallback": req.device_fallback}

    def _free(self) -> list[ProviderRecord]:
        """Every free provider (at the asked location), whatever its device, RAM and cores."""
        return self.ctx.bootstrap.providers(rpcs.DISCOVER, Discover(count=ALL_PROVIDERS, location=self.ctx.request.location,
                                                                    free_only=True))

    def refuse_too_big(self) -> None:
        """A task whose estimated memory exceeds every free provider's declared RAM is refused (one
        line), before any claim."""
        free, estimate = self._free(), self.ctx.estimate
        if estimate is None or not free or any(p.ram_gb >= estimate.gb for p in free):
            return
        raise UserInputError(f"the task needs {estimate.describe()} per provider, more than any free "
                             f"provider declares (at most {max(p.ram_gb for p in free):g} GB): choose a smaller "
                             "model or batch size, or more providers (smaller shards)")

    def say_skipped(self) -> None:
        """Say which free providers this task skips for their RAM or cores, and fail in one line
        when none of the asked device is free (without --device-fallback)."""
        req, say = self.ctx.request, self.ctx.say
        free = self._free()
        need, why = self.needs()
        low_ram = [p for p in free if p.ram_gb < need]
        if low_ram:
            say(f"skipped for too little RAM ({why}): " + ", ".join(f"{p.id} ({p.ram_gb:g} GB)" for p in low_ram))
        few_cores = [p for p in free if p.cores < (req.min_cores or 0) and p not in low_ram]
        if few_cores:
            say(f"skipped for fewer cores than --min-cores {req.min_cores}: "
                + ", ".join(f"{p.id} ({p.cores})" for p in few_cores))
        wanted = wanted_device(req.device)
        fit = [p for p in free if p not in low_ram and p not in few_cores]
        if wanted and fit and not req.device_fallback and not any(p.device == wanted for p in fit):
            others = Counter(p.device for p in fit)
            raise TaskFailed(f"no free {wanted} provider (free: " + ", ".join(f"{n} {d}" for d, n in others.items())
                             + "): wait for one with --wait, or let others take the task with --device-fallback")

    def say_devices(self, claimed: list[ProviderRecord]) -> None:
        """One line when fewer providers of the asked device were free than asked: those taken
        alone, or (with --device-fallback) which others were taken."""
        req = self.ctx.request
        wanted = wanted_device(req.device)
        if wanted is None or len(claimed) >= req.providers and all(p.device == wanted for p in claimed):
            return
        ours = sum(p.device == wanted for p in claimed)
        others = [p for p in claimed if p.device != wanted]
        if others:
            self.ctx.say(f"only {ours} free {wanted} provider(s) of the {req.providers} asked: also taking "
                         + ", ".join(f"{p.id} ({p.device})" for p in others) + " (--device-fallback)")
        else:
            self.ctx.say(f"only {ours} free {wanted} provider(s) of the {req.providers} asked: training on those "
                         "(--device-fallback takes other devices too)")
