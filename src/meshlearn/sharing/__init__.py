"""Sharing schemes: what a node sends of its model (all of it, a random or top-k share, a
quantized copy, or CHOCO-SGD's compressed differences), one file each, behind ``Sharing``."""

from meshlearn.sharing.base import SHARINGS, Shared, Sharing, make_sharing, register_sharing
from meshlearn.sharing.spec import SHARING_HELP, SharingSpec, parse_sharing

__all__ = ["SHARINGS", "SHARING_HELP", "Shared", "Sharing", "SharingSpec", "make_sharing", "parse_sharing",
           "register_sharing"]
