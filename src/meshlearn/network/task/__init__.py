"""What a task's requester and providers share: its specification, access rules, data share, results, resources and records."""
