"""Byzantine behaviours to measure defences against: what a bad node sends instead of its model.

``spec`` parses ``--byzantine "3:sign-flip:10,5:alie"`` without torch; ``forge`` holds the
behaviours (one small class each), applied alike by both engines to what a node sends.
"""

from meshlearn.lazy import lazy_exports

_WHERE = {"ByzantineSpec": "spec", "parse_byzantine": "spec", "BYZANTINE_HELP": "spec", "Attack": "forge",
          "make_attack": "forge", "attack_generator": "forge"}
__all__ = sorted(_WHERE)

__getattr__ = lazy_exports(__name__, _WHERE)
