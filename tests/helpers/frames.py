"""Messages built byte by byte, for attacks the encoder would never produce."""

from meshlearn.wire import Kind
from meshlearn.wire.codec import _DTYPE_NDIM, _FIXED, _NAME_LEN, _U64, MAGIC, VERSION


def raw_message(table: list[tuple[int, list[int], int]], count: int | None = None, frames: list[bytes] | None = None,
                kind: Kind = Kind.MODEL, sender: int = 1, iteration: int = 0) -> list[bytes]:
    """Frames whose header's tensor table says (dtype code, dims, byte length) per tensor."""
    count = len(table) if count is None else count
    header = bytearray(_FIXED.pack(MAGIC, VERSION, int(kind), 0, sender, iteration, 1, count, 0))
    for index, (code, dims, nbytes) in enumerate(table):
        name = f"t{index}".encode()
        header += _NAME_LEN.pack(len(name)) + name + _DTYPE_NDIM.pack(code, len(dims))
        header += b"".join(_U64.pack(d) for d in dims) + _U64.pack(nbytes)
    if frames is None:
        frames = [b"\0" * min(nbytes, 4096) for _, _, nbytes in table]
    return [bytes(header)] + frames


def empty_tensor_with_a_huge_dimension(kind: Kind = Kind.MODEL, sender: int = 1, iteration: int = 0) -> list[bytes]:
    """The message that killed nodes: a zero-byte float32 tensor of shape (0, 2**64 - 1)."""
    return raw_message([(1, [0, 2**64 - 1], 0)], kind=kind, sender=sender, iteration=iteration)
