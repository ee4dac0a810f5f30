"""The bootstrap: admits keys, registers providers, claims them for tasks, keeps the task board."""
