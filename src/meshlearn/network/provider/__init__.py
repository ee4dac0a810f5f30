"""A provider: serves requests, runs its part of a task, finishes it (the leader's result)."""
