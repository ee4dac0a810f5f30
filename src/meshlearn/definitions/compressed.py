"""Quantized pseudo-gradients with error feedback: what a node sends instead of a model when an
algorithm's exchange carries the model's change over a round (FedAvg's ``compress``).

Each row's change is quantized by the ``quantize`` sharing scheme's rule (unbiased stochastic
rounding onto 2^bits levels per bucket of 512 values, a float32 low end and step per bucket; the
draws seeded from the run's seed, the sender and the exchange, so both engines send the same
bytes). What rounding left out is kept in the node's ``error`` and added to its next change
(error feedback, Seide et al. 2014, Karimireddy et al. 2019, as in INTELLECT-1's int8 exchange),
so nothing a node learned is lost for good, only late.

No torch import at module level (the definitions' rule)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

BITS = {"int8": 8, "int4": 4}


class DeltaCodec:
    """Encodes rows of changes to ``numel`` values of ``dtype`` in ``bits`` a value (8 or 4), and
    decodes and checks a received one (``seed``: the run's, for the rounding's draws)."""

    def __init__(self, numel: int, dtype, seed: int, bits: int):
        from meshlearn.sharing.quantize import Quantize

        self.scheme = Quantize(numel, dtype, seed, bits)
        self.nbytes = self.scheme.wire_bytes()  # bytes of one encoded change

    def encode_(self, change: "Tensor", error: "Tensor", sender: int, iteration: int, out: "Tensor") -> None:
        """In place: ``out`` [nbytes] (uint8) the encoding of ``change + error`` (one row), and
        ``error`` what that encoding leaves out of it (the next change's addition). ``change`` is
        overwritten; ``sender`` and ``iteration`` (the exchange's number) seed the rounding's draws."""
        value = change.add_(error)
        encoded = self.scheme.encode(value, sender, iteration)["buckets"]
        out.copy_(encoded)
        error.copy_(value).sub_(self.decode(out).to(value.device))

    def decode(self, encoded: "Tensor") -> "Tensor":
        """The change ``encoded`` holds (a CPU vector); ValueError saying what is wrong with it
        (size, type, non-finite or negative scales)."""
        return self.scheme.decode({"buckets": encoded.cpu()}, 0, 0).values

    def problem(self, encoded: "Tensor") -> str | None:
        """Why a received encoding must not be used, or None."""
        try:
            self.decode(encoded)
        except ValueError as exc:
            return f"its quantized change is not usable: {exc}"
        return None
