"""A read-only live web page of the network (on the bootstrap) or of local runs (simulate,
experiment); docs/dashboard.md. Used by the CLI only: a service gives it a function returning
its state as plain JSON values."""
