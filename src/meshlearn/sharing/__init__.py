"""Sharing schemes: what a node sends of its model (all of it, a random or top-k share, a
quantized copy, or CHOCO-SGD's compressed differences), one file each, behind ``Sharing``.

Names are imported on first use, so reading settings (``spec``) does not load torch.
"""

from meshlearn.lazy import lazy_exports

_WHERE = {
    "SHARINGS": "base", "Shared": "base", "Sharing": "base", "SparseSharing": "base", "make_sharing": "base",
    "register_sharing": "base",
    "SHARING_HELP": "spec", "SharingSpec": "spec", "parse_sharing": "spec",
}
__all__ = sorted(_WHERE)

__getattr__ = lazy_exports(__name__, _WHERE)
