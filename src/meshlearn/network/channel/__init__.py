"""Bytes between keys: the signed request/reply channel, its envelope, identities and pinned keys, the relay for peers behind NAT."""
