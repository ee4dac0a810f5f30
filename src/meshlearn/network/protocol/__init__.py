"""Every request the network's servers answer, declared once, with its version."""
